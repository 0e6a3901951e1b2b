"""Test-only installs of third-party clients for the conformance suite (docs/server.md, "Interop").

Nothing here goes into the project's virtual environment: each client is installed from PyPI with
``--no-deps`` into its own folder under ``DUPLEXKIT_CONFORMANCE_CACHE`` (default
``~/.cache/duplexkit/conformance``), and the tests append that folder to ``sys.path`` (appended, so
the venv's own packages win wherever both have one).

* vLLM-Omni: the ``vllm-omni`` wheel is downloaded with ``pip download --no-deps`` and only its
  ``vllm_omni/clients/`` package is extracted (no ``vllm_omni/__init__.py``: that one imports vLLM;
  ``vllm_omni`` becomes a namespace package holding ``clients`` alone). ``clients`` imports the
  standard library, ``websockets`` (in the venv) and ``pybase64``, installed next to it.
* OpenAI Agents SDK: ``openai-agents`` and the few imports its ``agents.realtime`` needs that the
  venv lacks. It is not in the dev extra: it pins ``websockets<17`` (the venv has 17) and pulls in
  ``mcp`` with its HTTP stack; installed with ``--no-deps`` it runs on the venv's websockets.

A failed install fails the test (the suite must run in CI); set ``DUPLEXKIT_CONFORMANCE_OFFLINE=1``
to skip these tests on a machine without PyPI access.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

VLLM_OMNI = "vllm-omni==0.30.0"
VLLM_OMNI_EXTRA = ["pybase64==1.5.1"]
AGENTS = ["openai-agents==0.24.0", "griffelib==2.4.1", "mcp==2.3.0", "mcp-types==2.3.0",
          "sse-starlette==3.7.0", "cryptography==50.0.2"]


def _cache() -> Path:
    return Path(os.environ.get("DUPLEXKIT_CONFORMANCE_CACHE", Path.home() / ".cache" / "duplexkit" / "conformance"))


def _pip(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _on_path(folder: Path) -> Path:
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return folder


def _guard(fn):
    if os.environ.get("DUPLEXKIT_CONFORMANCE_OFFLINE") == "1":
        pytest.skip("DUPLEXKIT_CONFORMANCE_OFFLINE=1: third-party clients are not installed")
    return fn()


def vllm_omni_clients() -> Path:
    """Install (once) and put on ``sys.path`` vLLM-Omni's ``clients`` package; returns its folder."""
    def install() -> Path:
        target = _cache() / VLLM_OMNI.replace("==", "-")
        if (target / "vllm_omni" / "clients" / "duplex.py").is_file() and (target / "pybase64").is_dir():
            return _on_path(target)
        with tempfile.TemporaryDirectory() as tmp:
            _pip("download", "--no-deps", "--only-binary=:all:", "-d", tmp, VLLM_OMNI)
            wheels = list(Path(tmp).glob("vllm_omni-*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download {VLLM_OMNI} gave no wheel")
            staging = Path(tmp) / "out"
            with zipfile.ZipFile(wheels[0]) as z:
                members = [n for n in z.namelist() if n.startswith("vllm_omni/clients/") and not n.endswith("/")]
                if not members:
                    raise RuntimeError(f"{wheels[0].name} has no vllm_omni/clients package")
                for n in members:
                    z.extract(n, staging)
            _pip("install", "--no-deps", "--target", str(staging), *VLLM_OMNI_EXTRA)
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging), str(target))
        return _on_path(target)

    return _guard(install)


def agents_sdk() -> Path:
    """Install (once) and put on ``sys.path`` the OpenAI Agents SDK; returns its folder."""
    def install() -> Path:
        target = _cache() / AGENTS[0].replace("==", "-")
        if (target / "agents" / "realtime" / "runner.py").is_file() and (target / "mcp").is_dir():
            return _on_path(target)
        with tempfile.TemporaryDirectory() as tmp:
            staging = Path(tmp) / "out"
            _pip("install", "--no-deps", "--only-binary=:all:", "--target", str(staging), *AGENTS)
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging), str(target))
        return _on_path(target)

    return _guard(install)
