"""Pinned host buffers for the LoRA merge's base-weight backup, allocated on a background thread.

Why: the host backup (`engine.lora_merge.BaseWeightBackup`) keeps one pinned copy of every weight LoRA is merged into.
Pinning is slow: on an H200 host the 306 adapted weights of a Qwen2.5-VL-3B (5.6 GiB) took 3.9 s to allocate, a
quarter of a first step that found its compiled code in the cache (`benchmarks/results/h200-vllm-3b-2x8-r3`, the
cProfile of that first step). Here the buffers are allocated while the first steps run, and the first generation
keeps its backup on the GPU meanwhile, where there is room for it.

That alone did not help: torch's default pinning (`cudaHostAlloc`, each size rounded up to a power of two) holds CUDA's
driver lock while it maps the pages, so beside a thread pinning the 3B's backup (4.9 s) the main thread launched 82
kernels a second instead of 105 000 (`benchmarks/host_pinning.py`, H200). `use_fast_pinning` switches torch to
mapping the pages on 8 threads, then `cudaHostRegister` (PyTorch's `pinned_use_cuda_host_register`): 1.5 s, 59 000
launches a second beside it, the same restore rate (7B: 3.6 s instead of 12.9). A cached 3B first step: 15.0 -> 9.8 s.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch

__all__ = ["POOL_MIN_BYTES", "PinnedPool", "room_on_device", "use_fast_pinning"]

logger = logging.getLogger(__name__)

# The GPU keeps a backup there, while the pinned buffers are made, only if it takes at most this share of what is
# free: a first step must not run out of memory for a copy that is there to save time.
DEVICE_SHARE = 0.5
# Below this, pinning in place costs less than a tenth of a second (the 3B's 5.6 GiB: 3.9 s): no thread for it.
POOL_MIN_BYTES = 256 * 2**20
# PyTorch's pinned-allocator settings (its CUDA semantics notes: 8 threads measured best), and the variables a user
# sets them in: a setting of the user's own wins.
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_fast_pinning: str | None = None  # the reason `use_fast_pinning` gave, once it ran


def _allocator_settings() -> str:
    """The allocator settings in force: torch's record of the last ones parsed, else the environment's."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    recorded = getter() if getter is not None else ""
    return recorded or ",".join(v for v in (os.environ.get(n, "").strip() for n in ALLOC_CONF_VARIABLES) if v)


def use_fast_pinning() -> str:
    """Have torch pin host memory by `cudaHostRegister` with 8 page-mapping threads (once per process; what it did).

    Left as it is where the allocator settings in force already name a `pinned_` option. Those settings are passed
    again with ours: torch's parser resets the options a settings string leaves out (max_split_size and others)."""
    global _fast_pinning
    if _fast_pinning is not None:
        return _fast_pinning
    user = _allocator_settings()
    if "pinned_" in user:
        _fast_pinning = f"left to the allocator settings given ({user})"
    elif not torch.cuda.is_available():
        _fast_pinning = "no CUDA"
    else:
        try:
            settings = ",".join(filter(None, (user, FAST_PINNING)))
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch.cuda's own is deprecated
            (setter or torch.cuda.memory._set_allocator_settings)(settings)
            _fast_pinning = f"set ({FAST_PINNING})"
        except (RuntimeError, AttributeError) as error:  # a torch without the option or the call
            _fast_pinning = f"torch refused it ({error}); pinning with cudaHostAlloc"
        logger.info("Host memory for the base-weight backup: fast pinning %s.", _fast_pinning)
    return _fast_pinning


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
