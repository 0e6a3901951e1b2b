"""``duplexkit replay`` (duplexkit/replay.py) on a real recording of the inline client with the
scripted engine: the page, the timeline's lanes, the CLI, the PNG (matplotlib optional)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from duplexkit.cli import main
from duplexkit.errors import OptionalDependencyError
from duplexkit.recording import Recorder, RecordingError
from duplexkit.replay import LANES, find_recordings, load_recording, render_png, timeline

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_recording_inline import _one_turn  # noqa: E402


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    root = tmp_path_factory.mktemp("recs")
    r = Recorder(root)
    rec, *_ = asyncio.run(_one_turn(r))
    assert r.flush(20)
    return rec.folder


def test_timeline_has_every_lane_kind(recording):
    tl = timeline(load_recording(recording))
    lanes = {s["lane"] for s in tl["spans"]} | {m["lane"] for m in tl["marks"]}
    assert {"model decisions", "assistant generated", "assistant heard", "latency"} <= lanes
    assert {s["kind"] for s in tl["spans"] if s["lane"] == "model decisions"} >= {"listen", "speak"}
    lat = [m for m in tl["marks"] if m["lane"] == "latency"]
    assert lat and all(m["t"] >= m["t0"] for m in lat)


def test_cli_writes_a_self_contained_page(recording, tmp_path, capsys):
    assert main(["replay", str(recording.parent), "--out", str(tmp_path)]) == 0
    page = tmp_path / f"{recording.name}.html"
    assert str(page) in capsys.readouterr().out
    text = page.read_text()
    assert text.count("data:audio/wav;base64,") == 3 and "http" not in text.replace("http://www.w3.org", "")
    for lane in LANES:
        assert f'data-lane="{lane}"' in text


def test_not_a_recording(tmp_path, capsys):
    with pytest.raises(RecordingError):
        find_recordings(tmp_path)
    assert main(["replay", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


def test_a_missing_path_says_not_found(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["replay", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {missing}: not found (pass a recording folder or the serve --record directory)"]


def test_a_corrupt_events_file_is_an_error_not_an_empty_page(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("{not json\n\n[1, 2]\n")
    assert main(["replay", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"error: no event could be read from {tmp_path / 'events.jsonl'}: 2 line(s) are not JSON events, "
        "the first at line 1"]
    assert captured.out == "" and not (tmp_path / "replay.html").exists()


def test_bad_lines_are_counted_and_the_rest_is_shown(recording, tmp_path, capsys):
    import shutil

    copy = tmp_path / recording.name
    shutil.copytree(recording, copy)
    events = copy / "events.jsonl"
    good = events.read_text().splitlines()
    events.write_text("\n".join([good[0], "{not json", *good[1:], '{"cut by a cra']) + "\n")
    rec = load_recording(copy)
    assert (rec["bad_lines"], rec["first_bad_line"]) == (2, 2) and len(rec["events"]) == len(good)
    assert main(["replay", str(copy)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"warning: {events}: skipped 2 line(s) that are not JSON events, the first at line 2; the page shows the rest"]
    assert (copy / "replay.html").is_file() and str(copy / "replay.html") in captured.out


def test_a_root_with_one_unreadable_recording_renders_the_others(recording, tmp_path, capsys):
    import shutil

    shutil.copytree(recording, tmp_path / "good")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "events.jsonl").write_text("{not json\n")
    assert main(["replay", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"warning: skipped {tmp_path / 'bad'}: no event could be read")
    assert (tmp_path / "good" / "replay.html").is_file() and not (tmp_path / "bad" / "replay.html").exists()


def test_png_needs_matplotlib(recording, tmp_path, monkeypatch):
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(OptionalDependencyError) as e:
            render_png(recording, tmp_path / "x.png")
        assert "pip install 'duplexkit[replay]'" in str(e.value)
    else:
        out = render_png(recording, tmp_path / "x.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
