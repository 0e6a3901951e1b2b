"""scripts/setup.sh is idempotent: with a matching stamp it runs no pip at all; a stale stamp or a
new DUPLEXKIT_TORCH_INDEX runs the install steps again and rewrites the stamp. A pip step that cannot
download from its index ends with one ``[setup] error:`` line naming the fix, and status 3.

The venv is a fake: ``bin/python`` logs its arguments, answers every ``-m pip`` call with success
without installing anything, and runs everything else (the import checks) with this test's own
interpreter, where duplexkit[all] is installed. Nothing is downloaded or installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"


@pytest.fixture
def fake_venv(tmp_path):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    py = bindir / "python"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{log}"\n'
        'if [[ "${1:-} ${2:-}" == "-m pip" ]]; then\n'
        '  if [[ -n "${FAKE_PIP_FAIL_ON:-}" && "$*" == *"$FAKE_PIP_FAIL_ON"* ]]; then\n'
        '    echo "$FAKE_PIP_ERROR" >&2; exit 1\n'
        '  fi\n'
        '  exit 0\n'
        'fi\n'
        f'exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return tmp_path / "venv", log


def _run(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, DUPLEXKIT_VENV=str(venv), DUPLEXKIT_SKIP_APT="1")
    e.pop("DUPLEXKIT_TORCH_INDEX", None)
    e.pop("DUPLEXKIT_FORCE", None)
    e.update(env)
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=e, timeout=300)


def _pip_calls(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("-m pip")] if log.exists() else []


def test_matching_stamp_runs_no_pip(fake_venv):
    venv, log = fake_venv
    stamp = _run(venv, "--print-stamp").stdout.strip()
    assert len(stamp) == 64
    (venv / ".duplexkit-setup-stamp").write_text(stamp + "\n")
    r = _run(venv)
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout
    assert _pip_calls(log) == []


def test_stale_stamp_reinstalls_and_rewrites_it(fake_venv):
    venv, log = fake_venv
    (venv / ".duplexkit-setup-stamp").write_text("stale\n")
    r = _run(venv)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _pip_calls(log)
    assert any(c.endswith(" -e .[all]") for c in calls), calls
    assert not any("torch==" in c for c in calls), calls  # torch 2.9.1 is already there
    assert (venv / ".duplexkit-setup-stamp").read_text().strip() == _run(venv, "--print-stamp").stdout.strip()
    log.unlink()
    r = _run(venv)  # and the next run is the quick path
    assert "up to date" in r.stdout and _pip_calls(log) == []


def test_torch_index_changes_the_stamp_and_installs_from_it(fake_venv):
    venv, log = fake_venv
    index = "https://download.pytorch.org/whl/cpu"
    plain = _run(venv, "--print-stamp").stdout.strip()
    (venv / ".duplexkit-setup-stamp").write_text(plain + "\n")
    assert _run(venv, "--print-stamp", DUPLEXKIT_TORCH_INDEX=index).stdout.strip() != plain
    r = _run(venv, DUPLEXKIT_TORCH_INDEX=index)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _pip_calls(log)
    from importlib.metadata import version
    if version("torch").endswith("+cpu"):  # this venv already has the CPU build: nothing to swap
        assert not any("--index-url" in c for c in calls), calls
    else:
        assert any(f"--index-url {index} torch==2.9.1 torchaudio==2.9.1" in c for c in calls), calls


OFFLINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
           "connection broken by 'NewConnectionError(\"HTTPSConnection(host='pypi.org', port=443): Failed to "
           "establish a new connection: [Errno -3] Temporary failure in name resolution\")': /simple/fastapi/\n"
           "ERROR: Could not find a version that satisfies the requirement fastapi (from versions: none)\n"
           "ERROR: No matching distribution found for fastapi")


def _error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("[setup] error:")]


def test_unreachable_index_is_one_line_with_the_fix_and_status_3(fake_venv):
    venv, log = fake_venv
    r = _run(venv, DUPLEXKIT_FORCE="1", FAKE_PIP_FAIL_ON="-e .[all]", FAKE_PIP_ERROR=OFFLINE)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Temporary failure in name resolution" in r.stdout + r.stderr  # pip's own message is shown
    (line,) = _error_lines(r)
    assert line.startswith("[setup] error: pip could not download from the package index (PyPI)")
    for fix in ("HTTPS_PROXY=", "PIP_INDEX_URL=", "DUPLEXKIT_TORCH_INDEX=", "PIP_NO_INDEX=1 PIP_FIND_LINKS=",
                "re-run bash scripts/setup.sh"):
        assert fix in line, fix
    assert not (venv / ".duplexkit-setup-stamp").exists()  # the next run tries again


def test_unreachable_torch_index_names_it(fake_venv):
    venv, log = fake_venv
    index = "https://download.pytorch.org/whl/cpu"
    r = _run(venv, DUPLEXKIT_FORCE="1", DUPLEXKIT_TORCH_INDEX=index, PIP_INDEX_URL="https://mirror.example/simple",
             FAKE_PIP_FAIL_ON="install", FAKE_PIP_ERROR="ProxyError('Cannot connect to proxy.')")
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = _error_lines(r)
    # the first pip step (pip's own upgrade) runs against PIP_INDEX_URL
    assert "from the package index (https://mirror.example/simple)" in line


def test_other_pip_failures_exit_1_without_the_network_hint(fake_venv):
    venv, log = fake_venv
    r = _run(venv, DUPLEXKIT_FORCE="1", FAKE_PIP_FAIL_ON="-e .[all]",
             FAKE_PIP_ERROR="ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device")
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = _error_lines(r)
    assert line.startswith("[setup] error: pip install -e .[all] failed (exit 1;") and "HTTPS_PROXY" not in line


def test_real_pip_with_an_unreachable_index(tmp_path):
    """pip itself (dry run, its config files ignored) against an index on a closed local port: the
    editable install needs setuptools from the index for its build, so it fails as it would offline."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    (bindir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and "proxy" not in k.lower()}
    env.update(DUPLEXKIT_VENV=str(tmp_path / "venv"), DUPLEXKIT_SKIP_APT="1", DUPLEXKIT_FORCE="1",
               PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple", PIP_DRY_RUN="1",
               PIP_RETRIES="0", PIP_TIMEOUT="10", PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("DUPLEXKIT_TORCH_INDEX", None)
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = _error_lines(r)
    assert line.startswith(f"[setup] error: pip could not download from the package index (http://127.0.0.1:{port}/simple)")
