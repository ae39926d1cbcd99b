"""Pinned host buffers for the LoRA merge's base-weight backup, allocated on a background thread.

Why: the host backup (`engine.lora_merge.BaseWeightBackup`) keeps one pinned copy of every weight LoRA is merged into.
Pinning is slow: on an H200 host the 306 adapted weights of a Qwen2.5-VL-3B (5.6 GiB) took 3.9 s to allocate, a
quarter of a first step that found its compiled code in the cache (`benchmarks/results/h200-vllm-3b-2x8-r3`, the
cProfile of that first step). Here the buffers are allocated while the first steps run (torch releases the GIL while
it allocates), and the first generation keeps its backup on the GPU meanwhile, where there is room for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

__all__ = ["POOL_MIN_BYTES", "PinnedPool", "room_on_device"]

logger = logging.getLogger(__name__)

# The GPU keeps a backup there, while the pinned buffers are made, only if it takes at most this share of what is
# free: a first step must not run out of memory for a copy that is there to save time.
DEVICE_SHARE = 0.5
# Below this, pinning in place costs less than a tenth of a second (the 3B's 5.6 GiB: 3.9 s): no thread for it.
POOL_MIN_BYTES = 256 * 2**20


class PinnedPool:
    """Pinned host tensors of the given shapes and dtypes, one per key, allocated on a background thread."""

    def __init__(self, specs: Sequence[tuple[int, torch.Size, torch.dtype]], pin: bool = True) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._error: BaseException | None = None
        # Not a daemon: a process that ends while it pins waits the seconds it takes, rather than tearing CUDA down
        # under it.
        self._thread = threading.Thread(target=self._allocate, args=(list(specs), pin), name="vlm-grpo-pinned-backup")
        self._thread.start()

    def _allocate(self, specs: list[tuple[int, torch.Size, torch.dtype]], pin: bool) -> None:
        try:
            for key, shape, dtype in specs:
                self._buffers[key] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
        except BaseException as error:  # noqa: BLE001 (the caller allocates those left itself, and raises then)
            self._error = error

    def ready(self) -> bool:
        """Whether every buffer is allocated (or the allocation stopped): `take` no longer waits."""
        return not self._thread.is_alive()

    def take(self, key: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """The buffer made for `key`, removed from the pool (waits for the allocation to finish); None where there is
        none of that shape and dtype (the caller allocates one)."""
        self._thread.join()
        if self._error is not None:
            logger.warning("Allocating the pinned base-weight backup in the background failed (%s); allocating the "
                           "rest in place.", self._error)  # fmt: skip
            self._error = None
        buffer = self._buffers.pop(key, None)
        return buffer if buffer is not None and buffer.shape == shape and buffer.dtype == dtype else None


def room_on_device(needed_bytes: int, device: torch.device) -> bool:
    """Whether `needed_bytes` more on `device` (a GPU) stay within `DEVICE_SHARE` of what this process can still
    allocate there: the driver's free memory, and under a per-process cap (`torch.cuda.set_per_process_memory_fraction`)
    what the cap leaves beyond the memory this process holds."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
    capped = fraction * total - torch.cuda.memory_reserved(device)
    return needed_bytes <= DEVICE_SHARE * min(free, capped)
