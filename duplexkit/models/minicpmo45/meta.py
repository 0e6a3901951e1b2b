"""Building modules on the meta device without poisoning lazily imported modules.

``with torch.device("meta")`` makes every tensor *created* inside it a meta tensor, including
module-level constants of any module that happens to be imported lazily inside the block. One
real case: building a transformers ``LlamaModel`` lazily imports ``transformers.audio_utils`` ->
``torchaudio.compliance.kaldi``, whose module constant ``EPSILON`` then becomes a meta tensor, and
every later ``kaldi.fbank`` in the process fails ("Cannot copy out of meta tensor"). So the
modules our meta constructions pull in are imported first, outside the meta context.
"""

from __future__ import annotations

import contextlib
import importlib

__all__ = ["meta_device"]

_PRELOAD = (
    "torchaudio.compliance.kaldi",
    "transformers.audio_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.whisper.modeling_whisper",
    "transformers.models.siglip.modeling_siglip",
)
_preloaded = False


def _preload() -> None:
    global _preloaded
    if _preloaded:
        return
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # optional pieces (e.g. torchaudio without the engine extra)
            pass
    _preloaded = True


@contextlib.contextmanager
def meta_device():
    """``torch.device("meta")`` after importing, outside it, the modules constructions load lazily."""
    import torch

    _preload()
    with torch.device("meta"):
        yield
