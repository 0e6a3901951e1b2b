"""Fixtures of the model-port tests (thinker side).

Parity fixtures regenerate the deterministic tiny checkpoint with ``../shared/parity/make_tiny_checkpoint.py``
into a temporary directory (checked by sha256) and copy the reference tokenizer files there at test
time only; nothing from ``../shared`` is committed into the project. They skip when ``../shared/parity``
is absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

REPO = Path(__file__).resolve().parents[2]
PARITY = (REPO / ".." / "shared" / "parity").resolve()
PARITY_SHA256 = "0896f40ae743f65654ead47b9cb8ddf636be1231150f78224ae853f236d4c42b"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json", "tokenizer_config.json",
                   "generation_config.json", "preprocessor_config.json")


def need_parity() -> Path:
    if not (PARITY / "make_tiny_checkpoint.py").is_file():
        pytest.skip(f"../shared/parity not found at {PARITY}: parity data unavailable")
    return PARITY


@pytest.fixture(scope="session")
def parity_dir() -> Path:
    return need_parity()


@pytest.fixture(scope="session")
def parity_model_dir(parity_dir, tmp_path_factory) -> Path:
    """The parity checkpoint (184 MB, sha256-checked) plus the reference tokenizer files, in a tmp dir."""
    out = tmp_path_factory.mktemp("parity_ckpt")
    subprocess.run([sys.executable, str(parity_dir / "make_tiny_checkpoint.py"), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    h = hashlib.sha256()
    with open(out / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    assert h.hexdigest() == PARITY_SHA256, "parity checkpoint generator produced a different file"
    for name in TOKENIZER_FILES:
        shutil.copyfile(parity_dir / "tokenizer" / name, out / name)
    return out


@pytest.fixture(scope="session")
def parity_model(parity_model_dir):
    from duplexkit.models.minicpmo45 import load

    return load(parity_model_dir, with_code2wav=False, progress=False)


@pytest.fixture(scope="session")
def goldens(parity_dir):
    return dict(np.load(parity_dir / "goldens.npz"))


@pytest.fixture(scope="session")
def cases(parity_dir) -> dict:
    return json.loads((parity_dir / "cases.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tol(cases) -> dict:
    return cases["suggested_tolerances"]["independent_fp32_cpu_implementation"]


@pytest.fixture(scope="session")
def master_audio() -> np.ndarray:
    """The parity master signal (parity README "Inputs"), float32 [96560] at 16 kHz."""
    n_total = 96560
    n = np.arange(n_total)
    z = np.random.default_rng(1234).standard_normal(n_total)
    x = 0.1 * np.sin(2 * np.pi * 220 * n / 16000) + 0.05 * np.sin(2 * np.pi * 1330 * n / 16000) + 0.01 * z
    return x.astype(np.float32)


@pytest.fixture(scope="session")
def formula_image() -> np.ndarray:
    """The parity 448×448 RGB uint8 image."""
    y, x = np.mgrid[0:448, 0:448]
    r = (3 * x + 5 * y) % 256
    g = (x ^ y) % 256
    b = 28 + 200 * (((x // 32) + (y // 32)) % 2)
    return np.stack([r, g, b], -1).astype(np.uint8)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A freshly built tiny checkpoint of duplexkit's own builder (seed 0)."""
    from duplexkit.models.minicpmo45 import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from duplexkit.models.minicpmo45 import load

    return load(tiny_dir, progress=False, with_code2wav=False)


def close(a, b, atol, rtol=0.0, what=""):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    err = np.abs(a - b) - (atol + rtol * np.abs(b))
    assert err.max() <= 0, f"{what}: max |diff| {np.abs(a - b).max():.3g} exceeds atol {atol} rtol {rtol}"


@pytest.fixture(scope="session")
def assert_close():
    """``assert_close(actual, expected, atol, rtol=0, what="")``."""
    return close
