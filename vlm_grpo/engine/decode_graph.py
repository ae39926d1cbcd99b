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

    Call `begin(model, cache)` once per generation (it drops recordings whose weights or cache moved), then
    `step(call, next_tokens, position, slot, mask, cache)` per token: the first step of a shape runs `call` as it is,
    the second records it and replays, later steps only replay.
    At most `keep` recordings are kept (the training batch's and the evaluation batch's).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.recordings: dict[tuple, _Recording] = {}
        self.recorded = 0  # how many steps were recorded (each new shape, cache or moved weight records once)
        self._warm: set[tuple] = set()
        self._addresses: tuple[int, ...] | None = None

    def begin(self, model: nn.Module, cache: Any) -> None:
        """Drop every recording if a parameter, buffer or cache tensor of this generation moved, or a module was
        replaced, since they were made."""
        addresses = _addresses(model, cache)
        if addresses != self._addresses:
            self.recordings.clear()
            self._warm.clear()
            self._addresses = addresses

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
        work queued before it, so reading them on the same stream before the next step is safe)."""
        inputs = (next_tokens, position, slot, mask)
        key = (id(cache), *((tuple(t.shape), t.dtype) for t in inputs))
        recording = self.recordings.get(key)
        if recording is None and key not in self._warm:
            self._warm.add(key)
            current, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                logits = call(*inputs, cache)
            current.wait_stream(side)
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
            with torch.cuda.graph(graph):
                logits = call(*static, cache)
        except RuntimeError as error:
            raise RecordingFailed(f"the decode step could not be recorded as a CUDA graph ({error})") from error
        self.recorded += 1
        return _Recording(graph, static, logits)


def _addresses(model: nn.Module, cache: Any) -> tuple[int, ...]:
    """What a recording depends on: the storage address of every parameter and buffer of the model and of the cache's
    tensors, and the identity of every module (a stand-in rebuilt around moved weights, e.g. a quantised layer's in
    `engine.quantized_generation`, may read tensors that are neither parameters nor buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    for layer in getattr(cache, "layers", []):
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    return (*(t.data_ptr() for t in tensors), *(id(m) for m in model.modules()))
