"""The ``duplexkit`` command's entry point (the console script and ``python -m duplexkit``).

Importing the CLI takes a moment (argparse, asyncio, the subcommands); a Ctrl+C or SIGTERM then is
held until the import ends and stops the command with the status it has in any later phase (130 /
143, docs/cli.md "Exit status") instead of a traceback from the middle of an import.
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    got: list = []
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        from duplexkit.cli import main as cli_main
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if got:
        terminated = got[0] == signal.SIGTERM
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 143 if terminated else 130
    return cli_main()
