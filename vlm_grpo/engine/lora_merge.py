"""LoRA merged into the base weights while generating, and the base weights restored bit for bit afterwards.

A merged projection is one GEMM per token instead of three (the base weight, then LoRA's A and B). The merge adds
`scaling * B @ A` to each base weight in place; a bf16 unmerge would round, so the base weights are saved first
(`BaseWeightBackup`: pinned host memory, made once and kept while the frozen weights are unchanged, or a GPU copy)
and copied back after the block. From the host the copy-back is bounded by the host-to-device link (~45 GB/s on an
H100: ~0.1 s for a 3B model's adapted weights, ~0.3 s for a 7B's), so it can be deferred to overlap the next forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..integrations.unsloth import uses_unsloth
from . import pinned_pool
from .fused_projections import merges_as_a_delta
from .quantized_generation import is_quantized_linear

__all__ = ["HOST_SHARE", "MERGE_BACKUPS", "BaseWeightBackup", "DeferredRestore", "choose_backup", "merged_lora"]

logger = logging.getLogger(__name__)


MERGE_BACKUPS = ("auto", "device", "host")
# "auto" keeps the backup in host memory when all local processes' copies take at most this share of the host's
# available memory.
HOST_SHARE = 0.5


def choose_backup(needed_bytes: int, device: torch.device) -> tuple[str, str]:
    """`("device" | "host", why)`: where "auto" keeps the base weights while LoRA is merged into them.

    Host memory when the weights are on a GPU and every local process's copy fits in `HOST_SHARE` of the host's
    available memory (the same speed in `benchmarks/grpo_step.py`, one copy of the adapted weights less on the GPU);
    otherwise on the device.
    """
    if device.type != "cuda":
        return "device", "the weights are not on a GPU"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _host_available_bytes()
    gib = 2**30
    why = (f"{processes} x {needed_bytes / gib:.1f} GiB of base weights; {available / gib:.1f} GiB of host memory "
           "available")  # fmt: skip
    return ("host" if processes * needed_bytes <= HOST_SHARE * available else "device"), why


def _host_available_bytes() -> int:
    """The host memory available to new allocations (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class BaseWeightBackup:
    """Copies of the base weights LoRA is merged into, so `merged_lora` can restore them bit for bit.

    `where="device"`: a fresh copy beside each weight for every merge (one extra copy of the adapted weights in GPU
    memory while generating). `where="host"`: one copy in pinned CPU memory, kept across generations and refreshed
    only when a weight changed since it was restored (its in-place version counter moved, or its storage was
    replaced): LoRA's base weights are frozen, so after the first generation the cost is one host-to-device copy per
    generation and no GPU memory. `where="auto"`: `choose_backup` decides on the first merge (logged).
    """

    def __init__(self, where: str = "auto") -> None:
        if where not in MERGE_BACKUPS:
            raise ValueError(f"merge backup must be one of {', '.join(MERGE_BACKUPS)}, got {where!r}")
        self.setting = where
        self.where = None if where == "auto" else where
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._saved: list[tuple[torch.Tensor, torch.Tensor, nn.Module | None]] = []
        self._pending: DeferredRestore | None = None
        self._stream: torch.cuda.Stream | None = None  # the deferred copies' stream (one, reused)
        self.host_refreshes = 0  # weights copied to the host (the first generation, then only changed ones)
        self._pool: pinned_pool.PinnedPool | None = None  # host copies being pinned in the background (`resolve`)
        self.now: str | None = None  # where this merge's copies go: `where`, or "device" while the pool is made

    def resolve(self, weights: Sequence[torch.Tensor]) -> str:
        """Settle "auto" for these weights (once; later calls keep the choice) and return where they are kept.

        Called before each merge, it also settles where this merge's copies go (`now`). Under "auto", a host backup of
        GPU weights whose pinned copies do not exist yet has them pinned on a background thread (`engine.pinned_pool`:
        pinning a 3B model's 5.6 GiB took 3.9 s of its first step), and until they are made each merge keeps a GPU
        copy instead, where the GPU has room for one. "host" asked by name never takes GPU memory, and without room
        the copies are pinned in place, as before."""
        if self.where is None:
            needed = sum(w.numel() * w.element_size() for w in weights)
            self.where, why = choose_backup(needed, weights[0].device)
            logger.info("LoRA merged for generation: base weights kept on the %s (%s). Set "
                        "fast_generation_merge_backup to force one.", self.where, why)  # fmt: skip
        self.now = self.where
        if self.where == "host" and weights[0].is_cuda:
            pinned_pool.use_fast_pinning()  # before the first pinned copy: 4x faster, without starving the launches
        missing = [w for w in weights if not self._kept(w)] if self.where == "host" else []
        needed = sum(w.numel() * w.element_size() for w in missing)
        first = (self.setting == "auto" and self._pool is None and self.host_refreshes == 0
                 and needed >= pinned_pool.POOL_MIN_BYTES)  # fmt: skip
        # (`room_on_device` is False for weights on the CPU)
        if missing and (first or self._pool is not None) and pinned_pool.room_on_device(needed, weights[0].device):
            if first:
                self._pool = pinned_pool.PinnedPool([(id(w), w.shape, w.dtype) for w in missing], weights[0].is_cuda)
                logger.info("Pinning %.1f GiB of host memory for the base-weight backup in the background; until it "
                            "is ready, merges keep their backup on the GPU.", needed / 2**30)  # fmt: skip
            if not self._pool.ready():
                self.now = "device"
        return self.where

    def _kept(self, weight: torch.Tensor) -> bool:
        """Whether the host holds a current copy of `weight` (saved, and not changed in place or moved since)."""
        entry = self._host.get(id(weight))
        return (
            entry is not None and entry[0] is weight and entry[2] == weight._version and entry[3] == weight.data_ptr()
        )

    def save(self, weight: torch.Tensor, reader: nn.Module | None = None) -> None:
        """Remember `weight` as it is now (call before merging into it). `reader`: the module whose forward reads it
        (what a deferred restore makes wait for its copy)."""
        if (self.now or self.where) == "device":
            self._saved.append((weight, weight.detach().clone(), reader))
            return
        entry = self._host.get(id(weight))
        if not self._kept(weight):  # first copy, or changed: (re)copied, into the pool's buffer where made
            copy = self._pool.take(id(weight), weight.shape, weight.dtype) if self._pool is not None else None
            if copy is None:
                copy = torch.empty(weight.shape, dtype=weight.dtype, device="cpu", pin_memory=weight.is_cuda)
            copy.copy_(weight.detach())
            entry = (weight, copy, weight._version, weight.data_ptr())
            self.host_refreshes += 1
        self._host[id(weight)] = entry
        self._saved.append((weight, entry[1], reader))

    def restore(self, defer: bool = False) -> None:
        """Copy every saved weight back, and note its version so an untouched weight keeps its host copy.

        The copies are queued on the current stream and the host does not wait for them: the next kernel that reads
        a weight runs after its copy, and a host copy is only rewritten (`save`) by a copy queued behind them, so the
        CPU goes on to decode the completions and score the rewards while the weights come back.
        `defer` (host copies of CUDA weights, each saved with its reader): the copies go on a side stream instead, and
        the current stream waits for a weight's copy only when its reader's forward starts (`DeferredRestore`), so the
        host-to-device copies (~0.1 s for a 3B model's adapted weights, ~0.3 s for a 7B's) overlap the next forward
        (TRL's scoring) instead of preceding it. The caller must call `wait` before anything else reads the weights.
        """
        self.wait()
        saved = self._saved
        on_host = (self.now or self.where) == "host"
        deferrable = saved and on_host and saved[0][0].is_cuda and all(r is not None for *_, r in saved)
        if defer and deferrable:
            device = saved[0][0].device
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)
            self._pending = DeferredRestore(saved, self._stream)
        else:
            for weight, original, _ in saved:
                weight.copy_(original, non_blocking=True)
        self._saved = []  # only once every copy is queued: a failed restore leaves them to restore again
        if on_host:
            self._pool = None  # its buffers went to this merge's weights; any left over are freed, not kept all run
            for weight, original, _ in saved:
                self._host[id(weight)] = (weight, original, weight._version, weight.data_ptr())

    def wait(self) -> None:
        """Make the current stream wait for every deferred copy (`restore(defer=True)`): after this, any kernel
        queued reads the base weights whole. Does nothing when no copy is deferred."""
        if self._pending is not None:
            self._pending.finish()
            self._pending = None


class DeferredRestore:
    """Base weights being copied back on a side stream, each reader module waiting for its own weight's copy.

    Every copy is followed by an event; a one-shot forward pre-hook on the module that reads the weight makes the
    stream running that forward wait for the event, then removes itself. The copies run in the model's module order,
    the order a forward reads them, so a forward starts as soon as its first layers are back. `finish` waits for all
    of them and removes the hooks left (readers that have not run).
    """

    def __init__(self, saved: Sequence[tuple[torch.Tensor, torch.Tensor, nn.Module]], stream: torch.cuda.Stream):
        self._hooks = []
        self._device = stream.device
        current = torch.cuda.current_stream(self._device)
        stream.wait_stream(current)  # after the generation's last read
        try:
            with torch.cuda.stream(stream):
                for weight, original, reader in saved:
                    weight.copy_(original, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._hooks.append(reader.register_forward_pre_hook(self._waiter(event, len(self._hooks))))
        except BaseException:  # nothing half-deferred: every copy again, in order on the current stream
            for hook in self._hooks:
                hook.remove()
            current.wait_stream(stream)
            for weight, original, _ in saved:
                weight.copy_(original, non_blocking=True)
            raise
        self._last = event

    def _waiter(self, event: torch.cuda.Event, index: int):
        def wait_for_the_copy(module: nn.Module, args: Any) -> None:
            torch.cuda.current_stream(self._device).wait_event(event)
            self._hooks[index].remove()

        return wait_for_the_copy

    def finish(self) -> None:
        """Make the current stream wait for every copy, and remove the hooks left."""
        torch.cuda.current_stream(self._device).wait_event(self._last)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


@contextlib.contextmanager
def merged_lora(
    model: nn.Module,
    backup: BaseWeightBackup | None = None,
    elsewhere: set[int] = frozenset(),
    defer_restore: bool = False,
) -> Iterator[bool]:
    """Merge the active LoRA adapters into the base weights for the duration of the block.

    Yields True when merged (the adapters are disabled inside the block, the merged weights do their work),
    False when the model cannot be merged exactly (DoRA, a non-linear base, no 16-bit LoRA), in which case nothing
    changes. The base weights are saved before merging (`backup`: on the device by default, or in host memory) and
    copied back after, so they come back bit-identical (a bf16 merge followed by an unmerge would round).
    Layers whose `id` is in `elsewhere` are left as they are: their merged weights are kept elsewhere
    (`engine.fused_projections`), and the layers themselves are swapped out while generating.
    `defer_restore`: a host backup's copies overlap the model's next forward (`BaseWeightBackup.restore`); the caller
    calls `backup.wait()` before the weights are read any other way. A block that raises restores at once.
    """
    # Quantised (bitsandbytes) bases are left out: `vlm_grpo.engine.quantized_generation` swaps them for plain layers with
    # their adapters applied while generating, so disabling their adapters here changes nothing.
    layers, compiled = [], False
    for m in model.modules():  # one walk: the LoRA layers, and whether any module is compiled (`_hooks_are_bypassed`)
        compiled = compiled or getattr(m, "_compiled_call_impl", None) is not None
        if hasattr(m, "lora_A") and hasattr(m, "get_base_layer") and not is_quantized_linear(m.get_base_layer()):
            layers.append(m)
    if (
        not layers
        or not hasattr(model, "disable_adapter")
        or not all(merges_as_a_delta(layer) for layer in layers)
        or any(layer.merged for layer in layers)  # PEFT merged an adapter itself (`merge_adapter`): its state, not ours
    ):
        if backup is not None:
            backup.wait()  # whatever reads the weights next reads them whole
        yield False
        return
    backup = backup if backup is not None else BaseWeightBackup("device")
    backup.wait()  # a restore deferred by the last block is complete before these weights are saved and merged
    merges = []
    for layer in layers:
        active = [name for name in layer.active_adapters if name in layer.lora_A]
        if active and not layer.disable_adapters and id(layer) not in elsewhere:
            merges.append((layer, layer.get_base_layer().weight, active))
    if merges:
        backup.resolve([weight for _, weight, _ in merges])
    # Each merged weight's reader: the layer whose forward a deferred copy makes wait (only looked for when asked).
    # A weight read other than through its layer's forward has none, and the restore is then not deferred at all.
    no_readers = defer_restore and _hooks_are_bypassed(model, compiled)
    direct = _embedding_weights(model) if defer_restore else set()
    # The merged layers' adapters are off inside the block, each layer's own flag set and put back. PEFT's
    # `disable_adapter()` would walk the whole model twice and reset every adapter's requires_grad (unfreezing any
    # the user froze): ~90 ms a call for a 3B VLM's 414 LoRA layers, most of the merge's cost.
    merged_layers = []
    completed = False
    try:
        with torch.no_grad():
            for layer, weight, active in merges:
                reader = None if not defer_restore or no_readers or id(weight) in direct else layer.get_base_layer()
                backup.save(weight, reader)
                for name in active:  # W += scaling * (B @ A): PEFT's delta for a Linear base, in one kernel
                    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
                    weight.addmm_(lora_b.to(weight.dtype), lora_a.to(weight.dtype), alpha=layer.scaling[name])
                layer._disable_adapters = True
                merged_layers.append(layer)
        yield True
        completed = True
    finally:
        # Weights back first, then the adapters on: never merged weights with their adapters applied again.
        try:
            with torch.no_grad():
                backup.restore(defer=defer_restore and completed)
        finally:
            for layer in merged_layers:
                layer._disable_adapters = False


def _hooks_are_bypassed(model: nn.Module, compiled: bool) -> bool:
    """Whether the model's layers may run without their forward hooks: inside a compiled module (Dynamo does not run
    them; `compiled`: whether any module is, found in the caller's walk of the model), or under Unsloth (its fused
    LoRA kernels read the base weights without calling the layers)."""
    return uses_unsloth(model) or compiled


def _embedding_weights(model: nn.Module) -> set[int]:
    """The ids of the input and output embeddings' weights (read directly by fused losses and tied layers)."""
    weights = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        with contextlib.suppress(AttributeError, NotImplementedError):
            module = getattr(model, getter)()
            weight = getattr(module, "weight", None) if module is not None else None
            if weight is None and module is not None and hasattr(module, "get_base_layer"):
                weight = getattr(module.get_base_layer(), "weight", None)
            if weight is not None:
                weights.add(id(weight))
    return weights
