"""``duplexkit replay DIR``: recorded conversations as HTML pages (and PNGs); see :mod:`duplexkit.replay`."""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_USAGE, CliError, _eprint


def add_replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="a recorded conversation (serve --record / record=) as an HTML timeline page",
                       description="Write one self-contained HTML page per recording found in DIR (a recording "
                                   "folder, or a folder of them): timeline lanes, both audio tracks playable "
                                   "with a cursor. docs/debugging.md.")
    p.add_argument("dir", metavar="DIR", help="a recording folder (DIR/<session_id>) or the --record root")
    p.add_argument("--out", default=None, metavar="OUTDIR",
                   help="write the pages as OUTDIR/<session_id>.html (default: replay.html in each recording)")
    p.add_argument("--png", action="store_true", help="also write the timeline as a PNG (needs matplotlib: "
                                                      "pip install 'duplexkit[replay]')")
    p.add_argument("--link-audio", action="store_true",
                   help="reference the WAVs by relative path instead of embedding them")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    from duplexkit.errors import OptionalDependencyError
    from duplexkit.recording import RecordingError
    from duplexkit.replay import find_recordings, load_recording, render_html, render_png

    try:
        folders = find_recordings(args.dir)
    except (RecordingError, OSError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    unreadable = []
    for folder in folders:
        try:
            rec = load_recording(folder)
        except RecordingError as exc:  # among several recordings, one that cannot be read is skipped
            if len(folders) == 1:
                raise CliError(str(exc), EXIT_USAGE) from exc
            _eprint(f"warning: skipped {folder}: {exc}")
            unreadable.append(folder)
            continue
        if rec["bad_lines"]:
            _eprint(f"warning: {folder / 'events.jsonl'}: skipped {rec['bad_lines']} line(s) that are not JSON "
                    f"events, the first at line {rec['first_bad_line']}; the page shows the rest")
        out = Path(args.out) / f"{folder.name}.html" if args.out else None
        page = render_html(folder, out, embed_audio=not args.link_audio, recording=rec)
        print(page)
        if args.png:
            try:
                print(render_png(folder, page.with_suffix(".png")))
            except OptionalDependencyError as exc:
                raise CliError(f"--png: {exc}", EXIT_USAGE) from exc
    if len(unreadable) == len(folders):
        raise CliError(f"no recording under {args.dir} could be read (see the warnings above)", EXIT_USAGE)
    return 0
