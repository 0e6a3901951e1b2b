"""Argument types and output helpers shared by the benchmark scripts (not a benchmark: ``duplexkit
bench`` lists only scripts whose names do not start with ``_``)."""

from __future__ import annotations

import argparse
import math


def int_at_least(minimum: int, why: str = ""):
    """An argparse type: an integer >= ``minimum`` (else a usage error, ending with ``why``)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}{why}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def int_list(s: str) -> list:
    """An argparse type: comma-separated integers >= 1, at least one (``"1,8,32"``)."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def torch_device(s: str):
    """An argparse type: a torch device that exists here (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    try:
        dev = torch.device(s)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"not a torch device: {s!r} ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("CUDA is not available here; use --device cpu (with --size tiny "
                                             "for a smoke run)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{s}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"unsupported device {s!r}: use cpu or cuda[:N]")
    return dev


def non_negative_float(s: str) -> float:
    """argparse type: a finite number >= 0 (``--thinker-window-ms``)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def positive_float(s: str) -> float:
    """argparse type: a finite number > 0 (``--memory`` GiB)."""
    v = non_negative_float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {s!r}")
    return v


def no_nan(x):
    """``x`` with every NaN or infinite float as None, recursively (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [no_nan(v) for v in x]
    return x
