"""Benchmark scripts' command lines: ``--help`` and bad arguments give usage and an exit code, not a
crash (heap_diag used to treat ``--help`` as its output directory and segfault in ``fopen``), and the
end-to-end benchmark's JSON is strict (no NaN)."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@functools.lru_cache(maxsize=None)
def _main(script: str):
    """``benchmarks/<script>.py``'s ``main(argv)``, imported in this process (one interpreter and one torch
    import for all of a script's argument checks; each script's own entry point is run once as a real
    process below)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{script}", REPO / "benchmarks" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module.main


def _usage_error(capsys, main, args) -> str:
    """Run ``main(args)``, which must exit 2 (argparse's usage error); return its stderr."""
    path = list(sys.path)  # main() puts benchmarks/ on sys.path for its _cli import
    try:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
    finally:
        sys.path[:] = path
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("script", ["benchmarks/heap_diag.py", "benchmarks/device_smoke.py"])
def test_help_prints_usage(script):
    r = _run(script, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower()


def test_heap_diag_without_a_directory_is_a_usage_error():
    r = _run("benchmarks/heap_diag.py")
    assert r.returncode == 2 and "usage" in r.stdout


@pytest.mark.parametrize("args,needle", [(["--graph-rows", "3"], "invalid choice"),
                                         (["--ways", "foo"], "--ways: choose from")])
def test_code2wav_batch_refuses_bad_arguments_before_building_anything(args, needle):
    r = _run("benchmarks/code2wav_batch.py", *args)
    assert r.returncode == 2 and needle in r.stderr


def test_benchmark_json_has_no_nan_or_infinity():
    """e2e_latency.py and gpu_engine.py write their --out JSON through _cli.no_nan: strict JSON."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _cli
    finally:
        sys.path.pop(0)
    out = _cli.no_nan({"a": float("nan"), "b": [1.0, float("inf"), {"c": float("-inf")}], "d": "x"})
    assert out == {"a": None, "b": [1.0, None, {"c": None}], "d": "x"}
    json.loads(json.dumps(out, allow_nan=False))
    for script in ("e2e_latency.py", "gpu_engine.py"):
        assert "no_nan(" in (REPO / "benchmarks" / script).read_text()


@pytest.mark.parametrize("args,needle", [(["--batches", "0"], "positive integers"), (["--units", "0"], "--units"),
                                         (["--tokens", "x"], "comma-separated integers")])
def test_talker_unit_refuses_bad_arguments(capsys, args, needle):
    pytest.importorskip("torch")
    assert needle in _usage_error(capsys, _main("talker_unit"), args)


def test_talker_unit_help_prints_usage(capsys):
    pytest.importorskip("torch")
    with pytest.raises(SystemExit) as exc:
        _main("talker_unit")(["--help"])
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_talker_unit_smoke_on_the_cpu():
    """The tiny talker on the CPU, as a real process (its entry point and exit status): both ways run and
    the table comes out (not a measurement)."""
    pytest.importorskip("torch")
    r = _run("benchmarks/talker_unit.py", "--size", "tiny", "--device", "cpu", "--batches", "1,2", "--units", "2",
             "--tokens", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not a measurement" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("5 ")]
    assert [(x[1], x[2]) for x in rows] == [("1", "eager-prefill"), ("1", "graph"), ("2", "eager-prefill"), ("2", "graph")]


@pytest.mark.parametrize("args,needle", [(["--modes", "int4"], "int8, fp8"), (["--steps", "0"], "--steps"),
                                         (["--model", "random-real", "--device", "cpu"], "needs --device cuda")])
def test_quant_quality_refuses_bad_arguments(capsys, args, needle):
    pytest.importorskip("torch")
    assert needle in _usage_error(capsys, _main("quant_quality"), args)


def test_quant_quality_smoke_on_the_cpu():
    """The tiny checkpoint on the CPU, as a real process: one quality row per stage and mode, and the
    weight table (fp8 on the CPU is the emulated path)."""
    pytest.importorskip("torch")
    r = _run("benchmarks/quant_quality.py", "--model", "tiny", "--device", "cpu", "--steps", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("thinker ", "talker "))]
    stages = [(" ".join(x[:2]) if x[0] == "thinker" else x[0]) for x in rows]
    assert stages == ["thinker prefill", "thinker decode", "talker"] * 2
    assert any(line.startswith("float32 ") for line in r.stdout.splitlines())
    assert any(line.startswith("int8 ") for line in r.stdout.splitlines())


@pytest.mark.parametrize("args,needle", [(["--units", "0"], "--units"), (["--streams", "a"], "comma-separated"),
                                         (["--streams", "0"], "positive integers"), (["--tokens", ","], "positive"),
                                         (["--modes", "bogus"], "fast, baseline"), (["--stagger", "-2"], ">= 0"),
                                         (["--kv-len", "0"], ">= 256"), (["--device", "foo"], "not a torch device")])
def test_gpu_engine_refuses_bad_arguments_before_building_anything(capsys, args, needle):
    """--units 0 used to hang (no unit was ever submitted); the others failed after the model build.
    ``main`` raises argparse's usage error before it builds anything."""
    pytest.importorskip("torch")
    err = _usage_error(capsys, _main("gpu_engine"), args)
    assert needle in err, err[-500:]


def test_gpu_engine_command_line_exits_2_on_a_bad_argument():
    """The script's own entry point, as a real process: a usage error is exit status 2 (``--units 0``,
    the argument that used to hang)."""
    r = _run("benchmarks/gpu_engine.py", "--units", "0")
    assert r.returncode == 2 and "--units" in r.stderr, r.stderr[-500:]


def test_gpu_engine_exits_non_zero_when_units_fail(tmp_path):
    """A run whose units fail (14 units of a stream whose thinker context holds 256 positions: the
    context fills) prints its table and exits 1, not 0; its JSON is strict (no NaN)."""
    pytest.importorskip("torch")
    out = tmp_path / "g.json"
    r = _run("benchmarks/gpu_engine.py", "--size", "tiny", "--device", "cpu", "--streams", "1", "--units", "14",
             "--tokens", "5", "--pace", "burst", "--no-audio", "--kv-len", "256", "--out", str(out))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "failed (see the err column)" in r.stdout
    data = json.loads(out.read_text())  # strict: json.loads accepts NaN, so look for it too
    assert data["fast/N=5"]["rows"][0]["errors"] == 1 and "NaN" not in out.read_text()
