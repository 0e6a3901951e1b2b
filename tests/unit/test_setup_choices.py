"""What the install scripts choose before they install anything.

* scripts/setup.sh picks the torch build by the machine: the CPU-only index without an NVIDIA GPU, PyPI's
  CUDA build with one (a fake ``nvidia-smi`` on PATH, or the driver's /proc entry), DUPLEXKIT_TORCH /
  DUPLEXKIT_TORCH_INDEX override it; when the CPU index cannot be reached it installs from PyPI and says so.
* scripts/demo.sh --dry-run names only the demo's system packages (no Chromium, no test tools).
* scripts/lib_apt.sh says what it installs before it does, goes through sudo when not root and explains
  what to do when neither root nor sudo is there.
* scripts/test.sh sets up the vLLM / frameworks venvs and Chromium only for selections that contain
  their tests.

The venvs are fakes (tests/unit/test_setup_script.py has the same idea): ``bin/python`` logs its
arguments, answers ``-m pip`` with success without installing anything, and runs everything else with
this test's own interpreter. apt, dpkg, id and sudo are fake scripts on PATH where a test needs them.
Nothing is downloaded or installed.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{shutil.which('bash')}\n" + body)  # absolute: some tests run with PATH = fakes only
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_venv(tmp_path):
    """A venv whose pip does nothing; FAKE_NO_TORCH=1 makes the torch check fail (torch 'missing')."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    _script(bindir / "python",
            f'echo "$*" >> "{log}"\n'
            'if [[ "${1:-} ${2:-}" == "-m pip" ]]; then exit 0; fi\n'
            'if [[ -n "${FAKE_NO_TORCH:-}" && "${1:-} ${2:-}" == "- 2.9.1" ]]; then exit 1; fi\n'
            f'exec "{sys.executable}" "$@"\n')
    return tmp_path / "venv", log


@pytest.fixture
def fakebin(tmp_path):
    d = tmp_path / "fakebin"
    d.mkdir()
    return d


def _path_without_nvidia_smi(extra: Path | None = None) -> str:
    """PATH with every directory holding a real nvidia-smi left out (so 'no GPU' holds on a GPU host)."""
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
    return os.pathsep.join(([str(extra)] if extra else []) + dirs)


def _setup(*args: str, venv: Path, path: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEXKIT_TORCH")}
    e.pop("DUPLEXKIT_FORCE", None)
    e.update(DUPLEXKIT_VENV=str(venv), DUPLEXKIT_SKIP_APT="1", PATH=path,
             DUPLEXKIT_NVIDIA_PROC=str(tmp_path / "no-driver"))
    e.update(env)
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=e, timeout=300)


def _torch_line(r: subprocess.CompletedProcess) -> str:
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("[setup] torch:")]
    return line


def _pip_calls(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("-m pip")] if log.exists() else []


# --- the torch build ---------------------------------------------------------------------------------

def test_no_gpu_plans_the_cpu_index_and_says_how_to_override(fake_venv, tmp_path):
    venv, _ = fake_venv
    r = _setup("--dry-run", venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    line = _torch_line(r)
    assert "no NVIDIA GPU found" in line and f"the CPU-only build from {CPU_INDEX}" in line
    assert "DUPLEXKIT_TORCH=cuda" in r.stdout and "DUPLEXKIT_TORCH_INDEX=URL" in r.stdout
    assert "PyPI's CUDA 12.8 build, with a warning" in r.stdout  # the fallback is announced
    assert "dry run: nothing is installed" in r.stdout


def test_a_fake_nvidia_smi_plans_the_cuda_build(fake_venv, tmp_path, fakebin):
    venv, _ = fake_venv
    _script(fakebin / "nvidia-smi", "exit 0\n")
    r = _setup("--dry-run", venv=venv, path=_path_without_nvidia_smi(fakebin), tmp_path=tmp_path)
    line = _torch_line(r)
    assert "an NVIDIA GPU driver is present" in line and "PyPI's CUDA 12.8 build" in line and CPU_INDEX not in line


def test_the_driver_proc_entry_alone_plans_the_cuda_build(fake_venv, tmp_path):
    venv, _ = fake_venv
    (tmp_path / "nvidia").mkdir()
    r = _setup("--dry-run", venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path,
               DUPLEXKIT_NVIDIA_PROC=str(tmp_path / "nvidia"))
    assert "PyPI's CUDA 12.8 build" in _torch_line(r)


@pytest.mark.parametrize("gpu, env, expect", [
    (False, {"DUPLEXKIT_TORCH": "cuda"}, "DUPLEXKIT_TORCH=cuda -> PyPI's CUDA 12.8 build"),
    (True, {"DUPLEXKIT_TORCH": "cpu"}, f"DUPLEXKIT_TORCH=cpu -> the CPU-only build from {CPU_INDEX}"),
    (True, {"DUPLEXKIT_TORCH_INDEX": "https://download.pytorch.org/whl/cu126"},
     "DUPLEXKIT_TORCH_INDEX is set -> the build on https://download.pytorch.org/whl/cu126 (label cu126)"),
])
def test_overrides_win_over_the_machine(fake_venv, tmp_path, fakebin, gpu, env, expect):
    venv, _ = fake_venv
    if gpu:
        _script(fakebin / "nvidia-smi", "exit 0\n")
    r = _setup("--dry-run", venv=venv, path=_path_without_nvidia_smi(fakebin), tmp_path=tmp_path, **env)
    assert expect in _torch_line(r)


def test_a_bad_choice_is_one_error_line(fake_venv, tmp_path):
    venv, _ = fake_venv
    r = _setup("--dry-run", venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path, DUPLEXKIT_TORCH="rocm")
    assert r.returncode == 1
    assert r.stderr.strip() == "[setup] error: DUPLEXKIT_TORCH must be auto, cpu or cuda, not 'rocm'"


def test_the_choice_is_part_of_the_stamp(fake_venv, tmp_path, fakebin):
    venv, _ = fake_venv
    cpu = _setup("--print-stamp", venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path).stdout
    _script(fakebin / "nvidia-smi", "exit 0\n")
    gpu = _setup("--print-stamp", venv=venv, path=_path_without_nvidia_smi(fakebin), tmp_path=tmp_path).stdout
    assert len(cpu.strip()) == len(gpu.strip()) == 64 and cpu != gpu


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


@pytest.fixture
def local_index(tmp_path):
    """A local HTTP server with a torch/ page, standing in for the CPU index (a mirror of it)."""
    root = tmp_path / "index"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    (root / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a, **k: _Quiet(*a, directory=str(root), **k)  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu"
    srv.shutdown()
    srv.server_close()


def test_no_gpu_installs_torch_from_the_cpu_index(fake_venv, tmp_path, local_index):
    venv, log = fake_venv
    r = _setup(venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path, FAKE_NO_TORCH="1",
               DUPLEXKIT_TORCH_CPU_INDEX=local_index)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _pip_calls(log)
    assert any(f"--force-reinstall --no-deps --index-url {local_index} torch==2.9.1 torchaudio==2.9.1" in c
               for c in calls), calls
    assert "cannot be reached" not in r.stderr
    # each step says what it installs and how much before pip runs; the big steps are not quiet
    out = r.stdout
    assert out.index("[setup] 2/3 torch 2.9.1 + torchaudio 2.9.1: the CPU-only build") < out.index("[setup] 3/3")
    assert "about 0.2 GB to download" in out and "1.9 GB on disk" in out
    assert not any(" -q " in c and "torch==" in c for c in calls) and not any(" -q -e " in c for c in calls)
    assert (venv / ".duplexkit-setup-stamp").exists()


def test_an_unreachable_cpu_index_falls_back_to_pypi_and_says_so(fake_venv, tmp_path):
    venv, log = fake_venv
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _setup(venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path, FAKE_NO_TORCH="1",
               DUPLEXKIT_TORCH_CPU_INDEX=f"http://127.0.0.1:{port}/whl/cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    (warning,) = [ln for ln in r.stderr.splitlines() if ln.startswith("[setup] warning:")]
    assert f"the CPU-only torch index http://127.0.0.1:{port}/whl/cpu cannot be reached" in warning
    assert "Connection refused" in warning and "installing PyPI's torch 2.9.1 instead, the CUDA 12.8 build" in warning
    assert "DUPLEXKIT_TORCH_CPU_INDEX" in warning
    calls = _pip_calls(log)
    assert any(c.endswith("--force-reinstall --no-deps torch==2.9.1 torchaudio==2.9.1") for c in calls), calls
    assert not any("--index-url" in c for c in calls), calls
    assert "holds the CUDA build of torch" in r.stderr.splitlines()[-1]  # said again at the end
    # the stamp records the inputs of the run, not the fallback: the next run with them is up to date
    stamp = _setup("--print-stamp", venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path,
                   DUPLEXKIT_TORCH_CPU_INDEX=f"http://127.0.0.1:{port}/whl/cpu").stdout.strip()
    assert (venv / ".duplexkit-setup-stamp").read_text().strip() == stamp


def test_an_explicit_cpu_choice_does_not_fall_back(fake_venv, tmp_path):
    """DUPLEXKIT_TORCH=cpu asks for that build: pip goes to the CPU index (no reachability probe, no PyPI)."""
    venv, log = fake_venv
    r = _setup(venv=venv, path=_path_without_nvidia_smi(), tmp_path=tmp_path, FAKE_NO_TORCH="1",
               DUPLEXKIT_TORCH="cpu", DUPLEXKIT_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in r.stderr
    assert any("--index-url http://127.0.0.1:9/whl/cpu torch==2.9.1" in c for c in _pip_calls(log))


# --- system packages ---------------------------------------------------------------------------------

DEMO_PACKAGES = {"python3-venv", "libportaudio2"}


def test_demo_dry_run_lists_only_the_demo_packages(tmp_path, fake_venv):
    venv, log = fake_venv
    env = {k: v for k, v in os.environ.items() if k not in ("DUPLEXKIT_SKIP_APT", "DUPLEXKIT_FORCE")}
    env["DUPLEXKIT_VENV"] = str(venv)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--dry-run", "--output", "x.wav"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (apt,) = [ln for ln in r.stdout.splitlines() if ln.startswith("[setup] system packages for the demo:")]
    listed = apt.split(":", 1)[1].split("(")[0].split()
    assert set(listed) == DEMO_PACKAGES, apt
    assert "chromium" not in r.stdout.lower() and "pulseaudio" not in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"[demo] then: TORCHDYNAMO_DISABLE=1 {venv}/bin/duplexkit demo --output x.wav"
    assert _pip_calls(log) == []  # a dry run installs nothing


def test_the_default_set_has_no_chromium_and_the_test_setup_has_it(tmp_path, fake_venv):
    venv, _ = fake_venv
    env = dict(os.environ, DUPLEXKIT_VENV=str(venv))
    env.pop("DUPLEXKIT_SKIP_APT", None)
    dev = subprocess.run(["bash", str(SETUP), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    (apt,) = [ln for ln in dev.stdout.splitlines() if ln.startswith("[setup] system packages for")]
    assert "pulseaudio" in apt and "espeak-ng" in apt and DEMO_PACKAGES <= set(apt.split()) and "chromium" not in apt
    test = subprocess.run(["bash", str(ROOT / "scripts" / "setup_test.sh"), "--dry-run", "browser"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert test.returncode == 0 and test.stdout.startswith("[setup] system packages for the browser tests: chromium")


def _apt(fakebin: Path, tmp_path: Path, uid: int, *, sudo: bool) -> subprocess.CompletedProcess:
    """apt_ensure with fake dpkg (nothing installed), apt-get, id and optionally sudo; PATH holds only them."""
    log = tmp_path / "apt.log"
    _script(fakebin / "dpkg", "exit 1\n")
    _script(fakebin / "id", f"echo {uid}\n")
    _script(fakebin / "apt-get", f'echo "apt-get $*" >> "{log}"; echo "APT OUTPUT $1"\n')
    _script(fakebin / "env", f'echo "env $*" >> "{log}"; shift; exec "$@"\n')
    if sudo:
        _script(fakebin / "sudo", f'echo "sudo $*" >> "{log}"; exec "$@"\n')
    bash = shutil.which("bash")
    cmd = f'source "{ROOT}/scripts/lib_apt.sh"; apt_ensure "the demo" python3-venv libportaudio2'
    return subprocess.run([bash, "-c", cmd], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(fakebin), "HOME": str(tmp_path)})


def test_apt_says_what_it_installs_before_installing_as_root(fakebin, tmp_path):
    r = _apt(fakebin, tmp_path, 0, sudo=False)
    assert r.returncode == 0, r.stderr
    announce = "[setup] installing system packages for the demo as root: apt-get install python3-venv libportaudio2"
    assert r.stdout.index(announce) < r.stdout.index("APT OUTPUT")
    log = (tmp_path / "apt.log").read_text()
    assert "apt-get install -y -q --no-install-recommends python3-venv libportaudio2" in log and "sudo" not in log


def test_apt_goes_through_sudo_when_not_root(fakebin, tmp_path):
    r = _apt(fakebin, tmp_path, 1000, sudo=True)
    assert r.returncode == 0, r.stderr
    assert "through sudo (it may ask for your password)" in r.stdout
    log = (tmp_path / "apt.log").read_text().splitlines()
    assert "sudo apt-get update -q" in log
    assert any(ln.startswith("sudo env DEBIAN_FRONTEND=noninteractive apt-get install") for ln in log), log


def test_apt_without_root_or_sudo_explains_and_installs_nothing(fakebin, tmp_path):
    r = _apt(fakebin, tmp_path, 1000, sudo=False)
    assert r.returncode == 1
    (line,) = r.stderr.splitlines()
    assert line.startswith("[setup] error: the demo needs the Debian packages python3-venv libportaudio2;")
    assert "not root and has no sudo" in line and "DUPLEXKIT_SKIP_APT=1" in line
    assert not (tmp_path / "apt.log").exists()


# --- scripts/test.sh sets up only the groups its selection contains -------------------------------------

def _test_sh(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEXKIT_TORCH")}
    e.pop("DUPLEXKIT_FORCE", None)
    e.update(DUPLEXKIT_VENV=str(venv), DUPLEXKIT_SKIP_APT="1", DUPLEXKIT_VLLM_VENV=str(venv.parent / "no-vllm"))
    e.update(env)
    stamp = subprocess.run(["bash", str(SETUP), "--print-stamp"], capture_output=True, text=True, env=e).stdout
    (venv / ".duplexkit-setup-stamp").write_text(stamp)  # setup.sh takes its quick path
    return subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args], capture_output=True, text=True,
                          env=e, timeout=600)


def test_test_sh_skips_the_vllm_venv_for_a_selection_without_its_tests(fake_venv):
    venv, _ = fake_venv
    r = _test_sh(venv, "--collect-only", "-q", "tests/unit/test_time_scale.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[test] vLLM venv not needed: no tests/engine/test_vllm_*.py selected" in r.stdout
    assert "[test] frameworks venv not needed" in r.stdout
    assert "setup-vllm" not in r.stdout + r.stderr and "chromium" not in r.stdout + r.stderr


def test_test_sh_sees_the_vllm_tests_in_a_selection(fake_venv):
    venv, _ = fake_venv
    r = _test_sh(venv, "--collect-only", "-q", "tests/engine/test_vllm_thinker.py", DUPLEXKIT_SKIP_VLLM="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DUPLEXKIT_SKIP_VLLM=1: no vLLM venv; the selected tests/engine/test_vllm_*.py will skip" in r.stdout
    assert "vLLM venv not needed" not in r.stdout
