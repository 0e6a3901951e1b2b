"""The slow group (tests/conftest.py ``SLOW``): its patterns name tests that exist, the hook marks them
``slow`` so ``-m "not slow"`` leaves them out, and every optional group that scripts/test.sh sets up
(the vLLM and frameworks venvs, Chromium) is inside it, so the default run (``-m "not slow and not
ray"``) needs none of them and test.sh builds none."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _conftest():
    spec = importlib.util.spec_from_file_location("_root_conftest_for_slow_group", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_files() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))


def test_every_pattern_names_an_existing_test_file_and_has_a_reason():
    files = _test_files()
    for pattern, why in _conftest().SLOW:
        path = pattern.split("::")[0]
        assert any(fnmatchcase(f, path) or f.startswith(path.rstrip("*")) for f in files), pattern
        assert why.strip(), pattern


def test_the_optional_groups_of_test_sh_are_all_slow():
    """Each ``selected 'REGEX'`` in scripts/test.sh's optional-groups block names test files that the slow
    group holds whole: the default selection then contains none, and test.sh sets none of them up."""
    text = (REPO / "scripts" / "test.sh").read_text()
    regexes = re.findall(r"selected '([^']+)'", text)
    assert len(regexes) >= 3, regexes  # the vLLM venv, the frameworks venv, Chromium
    slow_reason = _conftest().slow_reason
    for rx in regexes:
        matched = [f for f in _test_files() if re.search(rx, f)]
        assert matched, rx
        for f in matched:
            assert slow_reason(f"{f}::test_x") is not None, (rx, f)


def test_minus_m_not_slow_leaves_the_slow_group_out():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", "tests/e2e/test_demo_long_input.py", "tests/unit/test_time_scale.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/unit/test_time_scale.py::") for i in ids), r.stdout
    assert "deselected" in r.stdout


def test_the_model_and_engine_tests_share_one_worker_and_other_files_keep_theirs(request):
    """scripts/test.sh's workers (`--dist loadgroup`): the in-process tiny-engine tests form one group
    (one worker builds the ~2.24 GB Code2Wav flow), every other file is its own unit of work."""
    xdist_group = _conftest().xdist_group

    assert xdist_group("tests/model/test_talker.py::test_x[random]") == "engine"
    assert xdist_group("tests/engine/test_runtime.py::test_y") == "engine"
    assert xdist_group("tests/e2e/test_tiny_e2e.py::test_z") == "tests/e2e/test_tiny_e2e.py"
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["tests/unit/test_slow_group.py"]  # set on every collected test
