"""``duplexkit replay DIR``: recorded conversations as HTML pages (and PNGs); see :mod:`duplexkit.replay`."""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_USAGE, CliError


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
    from duplexkit.replay import find_recordings, render_html, render_png

    try:
        folders = find_recordings(args.dir)
    except (RecordingError, OSError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    for folder in folders:
        out = Path(args.out) / f"{folder.name}.html" if args.out else None
        page = render_html(folder, out, embed_audio=not args.link_audio)
        print(page)
        if args.png:
            try:
                print(render_png(folder, page.with_suffix(".png")))
            except OptionalDependencyError as exc:
                raise CliError(f"--png: {exc}", EXIT_USAGE) from exc
    return 0
