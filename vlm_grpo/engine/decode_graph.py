"""The decode step recorded as one CUDA graph by hand, so a token costs one graph launch on the host.

`torch.compile(mode="reduce-overhead")` records CUDA graphs too (cudagraph trees), but every call still runs
Dynamo's guards over the whole model (hundreds of LoRA layers' attributes), the trees' checks that ~500 static inputs
kept their addresses, and the copies of the other inputs, and the step ran as two graphs (the `lm_head` apart). On an
H100 (3B, 16 rows, under the profiler) the GPU was busy 4.0 ms of each 6.7 ms decode step and waited on the host for
the rest; recorded by hand, the step is 4.2 ms of back-to-back kernels (`benchmarks/results/h100-decode-profile-modes/`).
Here the model is compiled without graphs (Inductor's fused kernels), one decode step is recorded per (batch, cache)
with `torch.cuda.graph`, and each later step copies its four small inputs into the recorded buffers and replays. The
address checks run once per generation instead of once per token (`begin`): a parameter, buffer or cache tensor that
moved (re-allocated weights, a new cache), or a module replaced, drops the recordings.

What a replay computes is what the compiled call computes (the same kernels on the same buffers; `tests/gpu`); sampling,
the logits processors and the stopping rules stay outside, unchanged. Python-side state the forward changes is changed
only when recording: transformers' static cache keeps its length in a device tensor (advanced by the replay), and the
sliding-window layers' Python counter only matters once the window is full, which the fast path refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["DecodeGraphs", "RecordingFailed"]

logger = logging.getLogger(__name__)


class RecordingFailed(RuntimeError):
    """The decode step could not be recorded as a CUDA graph (it synchronises with the host, or uses an operation
    CUDA graphs do not support); nothing was replayed, and the step can run unrecorded."""


DecodeCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # next tokens, positions, cache slot, mask: copied into before each replay
    logits: torch.Tensor  # written by every replay


class DecodeGraphs:
    """Recorded decode steps, one per (input shapes, cache), valid while the tensors they read stay where they are.

    Call `begin(model, cache)` once per generation (it drops the recordings whose weights or cache moved), then
    `step(call, next_tokens, position, slot, mask, cache)` per token: the first step of a shape runs `call` as it is,
    the second records it and replays, later steps only replay.
    At most `keep` recordings are kept (the training batch's and the evaluation batch's).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.recordings: dict[tuple, _Recording] = {}
        self.recorded = 0  # how many steps were recorded (each new shape, cache or moved weight records once)
        self._warm: set[tuple] = set()
        self._model_signature: tuple[int, ...] | None = None
        self._cache_signatures: dict[int, tuple[int, ...]] = {}
        self._side: torch.cuda.Stream | None = None  # one warm-up stream (cuBLAS keeps a workspace per stream)

    def begin(self, model: nn.Module, cache: Any) -> None:
        """Drop every recording if a parameter or buffer of the model moved or a module was replaced, and this cache's
        recordings if its tensors moved, since they were made (the other cache's recordings stay: training and
        evaluation batches take turns)."""
        signature = _model_signature(model)
        if signature != self._model_signature:
            self.clear()
            self._model_signature = signature
        cache_signature = _cache_signature(cache)
        if self._cache_signatures.get(id(cache)) != cache_signature:
            for key in [k for k in self.recordings if k[0] == id(cache)]:
                del self.recordings[key]
            self._warm = {k for k in self._warm if k[0] != id(cache)}
            self._cache_signatures[id(cache)] = cache_signature

    def clear(self) -> None:
        """Drop every recording (and the memory its graph holds)."""
        self.recordings.clear()
        self._warm.clear()
        self._cache_signatures.clear()
        self._model_signature = None

    def step(
        self,
        call: DecodeCall,
        next_tokens: torch.Tensor,
        position: torch.Tensor,
        slot: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """`call(next_tokens, position, slot, mask, cache)` (float32 logits [B, V]), replayed from a recording.

        The first step of a shape runs `call` unrecorded, on a side stream as `torch.cuda.graph` asks (it compiles,
        and cuBLAS and the allocator set up outside any recording); the second records it and replays. Both are real
        steps: a step is never run twice, because a step is not idempotent (the cache advances its own length).
        The returned logits of a replay live in the recording's buffer: the next `step` overwrites them (after the
        work queued before it, so reading them on the same stream before the next step is safe). Runs on the inputs'
        device (the model's: one device, `FastGenerator` records nothing else)."""
        inputs = (next_tokens, position, slot, mask)
        key = (id(cache), *((tuple(t.shape), t.dtype) for t in inputs))
        with torch.cuda.device(next_tokens.device):
            recording = self.recordings.get(key)
            if recording is None and key not in self._warm:
                self._warm.add(key)
                current = torch.cuda.current_stream()
                if self._side is None or self._side.device != current.device:
                    self._side = torch.cuda.Stream()
                self._side.wait_stream(current)
                with torch.cuda.stream(self._side):
                    logits = call(*inputs, cache)
                current.wait_stream(self._side)
                logits.record_stream(current)
                return logits
            if recording is None:
                recording = self._record(call, inputs, cache)
                for old in list(self.recordings)[: max(0, len(self.recordings) - self.keep + 1)]:
                    del self.recordings[old]
                self.recordings[key] = recording
            else:
                for static, value in zip(recording.inputs, inputs):
                    static.copy_(value)
            recording.graph.replay()
            return recording.logits

    def _record(self, call: DecodeCall, inputs: tuple[torch.Tensor, ...], cache: Any) -> _Recording:
        """Record one step (recording runs nothing: the replay that follows is the step)."""
        static = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's allocation (a DataLoader's pin-memory thread) may go on while recording,
            # as torch.compile's own CUDA graphs allow.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = call(*static, cache)
        except RuntimeError as error:
            raise RecordingFailed(f"the decode step could not be recorded as a CUDA graph ({error})") from error
        self.recorded += 1
        return _Recording(graph, static, logits)


def _model_signature(model: nn.Module) -> tuple[int, ...]:
    """What a recording reads of the model: the storage address of every parameter and buffer, and the identity of
    every module (a stand-in rebuilt around moved weights, e.g. a quantised layer's in `engine.quantized_generation`,
    may read tensors that are neither parameters nor buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    return (*(t.data_ptr() for t in tensors), *(id(m) for m in model.modules()))


def _cache_signature(cache: Any) -> tuple[int, ...]:
    """The storage addresses of a cache's key and value tensors (allocated on first use)."""
    tensors = []
    for layer in getattr(cache, "layers", []):
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    return tuple(t.data_ptr() for t in tensors)
