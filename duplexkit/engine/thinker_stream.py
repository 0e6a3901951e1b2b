"""Opt-in: the thinker stage's GPU work on a dedicated high-priority CUDA stream.

By default the three stage threads (thinker, talker, Code2Wav) launch on the legacy default CUDA
stream of their device, so the GPU runs their kernels in the one order they were queued: a thinker
decode step (a few short kernels, then a ``.tolist()`` host sync) waits behind every vocoder kernel
queued before it. Measured on the H200 at 32 streams (benchmarks/results/2026-12-02-cudnn-per-thread-h200.md), the
thinker's round took 460-970 ms in the engine against ~300 ms alone, its thread waiting at the
per-step host sync and at host-to-device copies behind the vocoder's work.

``DUPLEXKIT_THINKER_STREAM=1`` (read when :class:`~duplexkit.engine.minicpmo45.MiniCPMO45Stages` is
built; default off) runs every thinker entry point of that class (open, update, step, end of turn,
close, the chat pass) and the thinker's start-up warm-up (graph captures included) under one
:class:`ThinkerCudaStream`: a stream created once per engine (at its construction) with the highest priority
CUDA offers (``torch.cuda.Stream.priority_range()[1]``). PyTorch's pool streams are created
non-blocking, so they do not synchronise implicitly with the legacy default stream, and the GPU
scheduler prefers the thinker's pending blocks over the vocoder's.

Hand-over rules (what makes the second stream safe):

* at creation the thinker stream waits for the device's default stream (the weights and static KV
  caches were written there at load);
* device tensors the thinker hands to another stage (the talker's hidden rows of a speaking unit
  and of a chat reply) travel with a :class:`torch.cuda.Event` recorded on the thinker stream after
  the work that wrote them; the consumer calls :func:`accept`, which makes its own current stream
  wait for that event (the GPU waits, the host does not) and calls ``record_stream`` so that the
  caching allocator does not give the memory back to the thinker stream's pool while the consumer's
  kernels may still read it;
* a tensor allocated on one stream and freed after use on the other (the thinker's KV pool when it
  grows, a graph's static inputs when the pool growth drops the graphs) is marked with
  ``record_stream`` on the current stream before it is dropped
  (:func:`duplexkit.models.minicpmo45.fast_kv.keep_for_current_stream`).

CUDA graphs are replayed on the current stream, so the thinker's captured steps replay on its stream;
captures still hold the capture gate exclusive (:mod:`duplexkit.models.minicpmo45.capture_gate`),
and ``torch.cuda.graph`` synchronises the whole device before it begins. On a CPU thinker, or with
the variable unset, nothing here is used and behaviour is unchanged. The vLLM thinker backend
(:class:`~duplexkit.engine.vllm_stages.VllmStages`) ignores the variable: vLLM runs its own streams.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

__all__ = ["ENV_VAR", "thinker_stream_requested", "ThinkerCudaStream", "accept"]

ENV_VAR = "DUPLEXKIT_THINKER_STREAM"


def thinker_stream_requested(value: Optional[str] = None) -> bool:
    """Whether ``DUPLEXKIT_THINKER_STREAM`` asks for the dedicated thinker stream.

    Args:
        value: the setting to parse (default: the environment variable; unset means off).

    Returns:
        True for ``1`` / ``true`` / ``on`` / ``yes``, False for unset, empty, ``0`` / ``false`` /
        ``off`` / ``no`` (case-insensitive).

    Raises:
        ValueError: any other value (a typo should not silently measure the wrong configuration).
    """
    from duplexkit.models.minicpmo45.fast_kv import env_switch

    return env_switch(ENV_VAR, False, value)


class ThinkerCudaStream:
    """One high-priority CUDA stream for a stage's work on ``device``.

    The stream is created here (build it where no CUDA-graph capture can be open on another thread:
    engine construction) and made to wait for everything queued so far on the device's default
    stream (the loaded weights, the static KV caches).

    Args:
        device: a CUDA device (``torch.device`` or string such as ``"cuda:0"``).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"a thinker CUDA stream needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
        """The ``torch.cuda.Stream`` (the highest priority of the device; non-blocking)."""
        self.stream.wait_stream(torch.cuda.default_stream(self.device))

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make the stream current on this thread (and the device current) for the block; nests."""
        import torch

        with torch.cuda.stream(self.stream):
            yield

    def mark_ready(self):
        """A ``torch.cuda.Event`` recorded on the stream now: it completes when every kernel queued
        on the stream so far has run (pass it with the tensors those kernels wrote)."""
        import torch

        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def accept(tensor: Any, ready: Any) -> None:
    """Consumer side of a hand-over from the thinker stream (module doc): the current stream of
    ``tensor``'s device waits for ``ready`` on the GPU, and the tensor's memory is kept from reuse
    until the work queued on that stream when it is freed has run.

    Args:
        tensor: a ``torch.Tensor`` (any dtype and shape) or None; CPU tensors and None are left alone.
        ready: the ``torch.cuda.Event`` from :meth:`ThinkerCudaStream.mark_ready`, or None (nothing
            to wait for).
    """
    if ready is None or tensor is None or not getattr(tensor, "is_cuda", False):
        return
    import torch

    s = torch.cuda.current_stream(tensor.device)
    s.wait_event(ready)
    tensor.record_stream(s)

