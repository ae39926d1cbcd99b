"""The decode step recorded as one CUDA graph by hand, so a token costs one graph launch on the host.

`torch.compile(mode="reduce-overhead")` records CUDA graphs too (cudagraph trees), but every call still runs
Dynamo's guards over the whole model (hundreds of LoRA layers' attributes), the trees' checks that ~500 static inputs
kept their addresses, and the copies of the other inputs, and the step ran as two graphs (the `lm_head` apart). On an
H100 (3B, 16 rows, under the profiler) the GPU was busy 4.0 ms of each 6.7 ms decode step and waited on the host for
the rest; recorded by hand, the step is 4.2 ms of back-to-back kernels (`benchmarks/results/h100-decode-profile-modes/`).
Here the model is compiled without graphs (Inductor's fused kernels), one decode step is recorded per (batch, cache)
with `torch.cuda.graph`, and each later step is one replay: the step reads and writes buffers that outlive the
generation (`engine.token_loop`), so nothing is copied in. The address checks run once per generation instead of
once per token (`begin`): a parameter, buffer or cache tensor that moved (re-allocated weights, a new cache), or a
module replaced, drops the recordings.

What a replay computes is what the step computes (the compiled forward's kernels, and with logits processors that read
only the scores, the sampling's, on the same buffers; `tests/gpu`); the stopping check stays on the host. Python-side
state the forward changes is changed only when recording: transformers' static cache keeps its length in a device tensor (advanced by the replay), and the
sliding-window layers' Python counter only matters once the window is full, which the fast path refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .cache_kinds import state_tensors

__all__ = ["DecodeGraphs", "RecordingFailed"]

logger = logging.getLogger(__name__)


class RecordingFailed(RuntimeError):
    """The decode step could not be recorded as a CUDA graph (it synchronises with the host, or uses an operation
    CUDA graphs do not support); nothing was replayed, and the step can run unrecorded."""


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    output: Any  # what the step returned when recorded (logits, or None): rewritten by every replay
    # The step itself, holding what it reads (buffers, sampler, cache): while the recording lives, none of them is
    # freed, so their memory is not handed to other tensors and their `id`s in the key cannot be reused.
    call: Callable[[], Any]


class DecodeGraphs:
    """Recorded decode steps, one per (step, cache), valid while the tensors they read stay where they are.

    Call `begin(model, cache)` once per generation (it drops the recordings whose weights or cache moved), then
    `step(call, key, cache)` per token: the first step of a key runs `call` as it is, the second records it and
    replays, later steps only replay. `call` takes no arguments: it reads and writes tensors that outlive the
    generation (`engine.token_loop.DecodeBuffers`, the cache), and `key` names them.
    At most `keep` recordings are kept (the training batch's and the evaluation batch's).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.recordings: dict[tuple, _Recording] = {}
        self.recorded = 0  # how many steps were recorded (each new shape, cache or moved weight records once)
        self._warm: dict[tuple, Callable[[], Any]] = {}  # keys stepped once, unrecorded (their objects kept alive)
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
            self._warm = {k: v for k, v in self._warm.items() if k[0] != id(cache)}
            self._cache_signatures[id(cache)] = cache_signature

    def forget(self, obj: Any) -> None:
        """Drop the recordings (and warm-up marks) whose key names `obj` (a cache, buffers or sampler its owner drops),
        so its memory is freed now rather than when a later recording evicts them."""
        self.recordings = {k: v for k, v in self.recordings.items() if id(obj) not in k}
        self._warm = {k: v for k, v in self._warm.items() if id(obj) not in k}
        self._cache_signatures.pop(id(obj), None)

    def clear(self) -> None:
        """Drop every recording (and the memory its graph holds)."""
        self.recordings.clear()
        self._warm.clear()
        self._cache_signatures.clear()
        self._model_signature = None

    def step(self, call: Callable[[], Any], key: tuple, cache: Any, device: torch.device) -> Any:
        """`call()`, replayed from a recording: what it returns (logits, or None for a step that writes its results
        into buffers).

        `key` names the step and every object it reads other than the model and the cache, by `id` (a recording is
        kept per `(id(cache), *key)` and keeps `call`, and so those objects, alive: their ids cannot be reused while
        it exists). The first step of a key runs `call` unrecorded, on a side stream as
        `torch.cuda.graph` asks (it compiles, and cuBLAS and the allocator set up outside any recording); the second
        records it and replays. Both are real steps: a step is never run twice, because a step is not idempotent (the
        cache advances its own length, the buffers their positions). A returned tensor of a replay lives in the
        recording's memory: the next `step` overwrites it (after the work queued before it, so reading it on the same
        stream before the next step is safe). Runs on `device` (the model's: one device, `FastGenerator` records
        nothing else)."""
        key = (id(cache), *key)
        with torch.cuda.device(device):
            recording = self.recordings.get(key)
            if recording is None and key not in self._warm:
                self._warm[key] = call
                for old in list(self._warm)[: max(0, len(self._warm) - self.keep)]:
                    del self._warm[old]
                current = torch.cuda.current_stream()
                if self._side is None or self._side.device != current.device:
                    self._side = torch.cuda.Stream()
                self._side.wait_stream(current)
                with torch.cuda.stream(self._side):
                    output = call()
                current.wait_stream(self._side)
                if isinstance(output, torch.Tensor):
                    output.record_stream(current)
                return output
            if recording is None:
                recording = self._record(call)
                self._warm.pop(key, None)
                for old in list(self.recordings)[: max(0, len(self.recordings) - self.keep + 1)]:
                    del self.recordings[old]
                self.recordings[key] = recording
            recording.graph.replay()
            return recording.output

    def _record(self, call: Callable[[], Any]) -> _Recording:
        """Record one step (recording runs nothing: the replay that follows is the step)."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's allocation (a DataLoader's pin-memory thread) may go on while recording,
            # as torch.compile's own CUDA graphs allow.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = call()
        except RuntimeError as error:
            raise RecordingFailed(f"the decode step could not be recorded as a CUDA graph ({error})") from error
        self.recorded += 1
        return _Recording(graph, output, call)


def _model_signature(model: nn.Module) -> tuple[int, ...]:
    """What a recording reads of the model: the storage address of every parameter and buffer, and the identity of
    every module (a stand-in rebuilt around moved weights, e.g. a quantised layer's in `engine.quantized_generation`,
    may read tensors that are neither parameters nor buffers)."""
    signature = []
    for module in model.modules():  # one walk of the tree (each walk of a 3B VLM with LoRA: ~5 000 modules)
        signature.append(id(module))
        signature.extend(
            t.data_ptr() for t in (*module._parameters.values(), *module._buffers.values()) if t is not None
        )
    return tuple(signature)


def _cache_signature(cache: Any) -> tuple[int, ...]:
    """The storage addresses of a cache's tensors (keys and values, convolution and recurrent states; allocated on
    first use)."""
    return tuple(t.data_ptr() for t in state_tensors(cache))
