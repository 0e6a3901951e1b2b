"""Bounds on waits around real processes, sockets and audio devices, and the one factor that scales them.

Tests wait on events (a line printed, a session opened or closed, a sample count reached) and only
fail when an event does not come within a *bound*: a ceiling chosen so that a 2-core machine with
both cores busy (two ``python3 -c 'while 1: pass'`` loops, a shared CI runner) still passes, never a
guess of how long a step "should" take. ``DUPLEXKIT_TEST_TIME_SCALE`` (a float, default 1) multiplies
every such bound, and the few durations that a test needs to be long enough to observe something
in (a replica's drain window); raise it on a slower machine (an emulated CPU, a heavily shared
runner), never lower it below 1 to make the suite faster.
"""

from __future__ import annotations

import os

ENV = "DUPLEXKIT_TEST_TIME_SCALE"


def _read_scale() -> float:
    raw = os.environ.get(ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number >= 1, got {raw!r}") from None
    if not value >= 1:
        raise ValueError(f"{ENV} must be a number >= 1, got {raw!r}")
    return value


#: The factor read from ``DUPLEXKIT_TEST_TIME_SCALE`` (>= 1).
TIME_SCALE = _read_scale()


def bound(seconds: float) -> float:
    """``seconds`` (a bound for a loaded 2-core machine) times :data:`TIME_SCALE`."""
    return seconds * TIME_SCALE
