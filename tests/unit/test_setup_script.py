"""scripts/setup.sh is idempotent: with a matching stamp it runs no pip at all; a stale stamp or a
new DUPLEXKIT_TORCH_INDEX runs the install steps again and rewrites the stamp.

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
        'if [[ "${1:-} ${2:-}" == "-m pip" ]]; then exit 0; fi\n'
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
    assert any("install -q -e .[all]" in c for c in calls), calls
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
