"""The server's allocator trim: :mod:`duplexkit.memory` (shared with the engine process)."""

from duplexkit.memory import malloc_trim, schedule_trim

__all__ = ["malloc_trim", "schedule_trim"]
