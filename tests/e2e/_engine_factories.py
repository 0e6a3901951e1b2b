"""Engine factories for :class:`duplexkit.engine.process.EngineSpec` in tests: importable in the
spawned engine process as ``_engine_factories`` (spawn copies the test's ``sys.path``)."""

from __future__ import annotations

from duplexkit.testing import ScriptedEngine


class MeteredScriptedEngine(ScriptedEngine):
    """A ScriptedEngine with a ``kv_usage()`` that counts its open streams (one slot each)."""

    def kv_usage(self) -> dict:
        return {"thinker": {"slots_used": len(self._streams), "slots_total": 4, "positions_per_slot": 64,
                            "bytes": 4096}}


def metered(**script) -> MeteredScriptedEngine:
    return MeteredScriptedEngine(**script)


class OddLoadError(Exception):
    """An exception whose constructor needs two arguments: it does not survive pickling."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def fails_oddly() -> None:
    raise OddLoadError("the weights", "a missing shard")


def exits_while_loading() -> None:
    import os

    os._exit(3)


def slow_load(marker: str, seconds: float) -> ScriptedEngine:
    """Writes ``marker`` once loading started, then "loads" for ``seconds``."""
    import time
    from pathlib import Path

    Path(marker).write_text("loading")
    time.sleep(seconds)
    return ScriptedEngine()
