"""One helper for the packages that import heavy or threaded submodules on first use (PEP 562).

``duplexkit.engine``, ``duplexkit.audio`` and ``duplexkit.models.minicpmo45`` each keep a table
``name -> submodule`` and get their module ``__getattr__``/``__dir__`` from :func:`lazy_exports`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, table: dict, namespace: dict) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """Build a package's ``__getattr__`` and ``__dir__``.

    Args:
        package: the package's ``__name__``.
        table: attribute name -> relative submodule (``".runtime"``) that defines it.
        namespace: the package's ``globals()``; a resolved name is cached there, so each is
            imported once.

    Returns:
        ``(__getattr__, __dir__)``; ``__getattr__`` raises AttributeError for a name not in ``table``.
    """

    def __getattr__(name: str) -> Any:
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
