"""Engines by name, from outside the engine package: the ``duplexkit.engines`` entry-point group.

:func:`~duplexkit.engine.loading.load_engine` takes a checkpoint directory, ``tiny``, or the name of
an engine plugin. A plugin is an entry point of the group ``duplexkit.engines`` whose object is a
factory called as ``factory(model_id=..., **options)`` and returning an
:class:`~duplexkit.engine.api.Engine`. duplexkit declares one itself, in ``pyproject.toml``::

    [project.entry-points."duplexkit.engines"]
    scripted = "duplexkit.testing.scripted:ScriptedEngine"

so ``duplexkit serve scripted`` (and ``load_engine("scripted")`` in an engine child process or a Ray
replica) finds the torch-free scripted engine of :mod:`duplexkit.testing` without any module of the
engine importing it: the dependency points from the installed metadata to the testing package,
never from the engine upwards (docs/architecture.md, "Import rules"). Another package can add an
engine the same way.

A source tree run from its directory without reinstalling (``PYTHONPATH=.`` over an install made
before the entry point existed) has no such metadata: :data:`SOURCE_TREE_PLUGINS` then names the
same object, and :func:`engine_plugins` reads it only for a name the metadata does not declare.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, Callable, Dict

__all__ = ["ENTRY_POINT_GROUP", "SOURCE_TREE_PLUGINS", "engine_plugins", "load_plugin"]

ENTRY_POINT_GROUP = "duplexkit.engines"
"""The entry-point group of engine plugins (``pyproject.toml``)."""

SOURCE_TREE_PLUGINS: Dict[str, str] = {"scripted": "duplexkit.testing.scripted:ScriptedEngine"}
"""What ``pyproject.toml`` declares in :data:`ENTRY_POINT_GROUP`, for an install whose metadata
predates it (``module:attribute`` strings, resolved only when the name is loaded)."""


def engine_plugins() -> Dict[str, str]:
    """Plugin name -> ``module:attribute``: the installed ``duplexkit.engines`` entry points, over
    :data:`SOURCE_TREE_PLUGINS`. Imports nothing."""
    found = dict(SOURCE_TREE_PLUGINS)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def load_plugin(name: str) -> Callable[..., Any]:
    """The factory of the engine plugin ``name`` (imports its module).

    Raises:
        KeyError: no plugin has that name.
        ImportError / AttributeError: the declared module or attribute does not exist.
    """
    target = engine_plugins()[name]
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj
