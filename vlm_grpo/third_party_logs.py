"""Third-party log lines that report no problem, dropped before a user reads them as one; real errors kept.

bitsandbytes (imported by PEFT whenever it is installed, as with `pip install 'vlm-grpo[dev]'`) looks, on CPUs with
AVX512-BF16, for an optional faster 4-bit kernel in the `kernels` package and warns at import when that package is
not installed: "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'". Its own CPU
kernel serves instead, so nothing is wrong; yet it was the first line of every command. transformers 5.25 installs
`kernels`, and the same warning then says the kernel could not be fetched (not in the local cache with the Hub
offline, or its publisher unverifiable with the Hub unreachable), after `kernels`' own "Skipping publisher trust
check" line for it. Those cases are dropped: the warning for any other cause (a fetched kernel failing) still shows.

transformers says once per kernel that Qwen3.5's and LFM2's linear-attention and convolution layers fall back to
their reference PyTorch code because `flash-linear-attention` / `causal-conv1d` is not installed. Those kernels are
GPU kernels: on a machine without a GPU there is nothing to install, and the four lines only alarm. They are dropped
there and kept wherever a GPU is present, where installing them is the advice to follow.

torchao (installed beside Unsloth) loads its compiled extensions at import; with a CPU build of torch its CUDA ones
cannot load, and it says so per file ("Failed to load .../_C_mxfp8...so"), and its registration of two Enum types
with torch's pytree calls an API torch now deprecates (a `torch.utils._pytree` warning each). Neither is anything a
user can act on: the first is dropped where torch has no CUDA (kept with a CUDA torch, where it is a broken
install), the second always (torchao's call to change).

`library_bars_off` switches transformers' progress bars off for a block: loading from or writing to a local folder
takes a moment and its "Loading weights" / "Writing model shards" bars told nobody anything.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

__all__ = ["datasets_bars_off", "install", "library_bars_off"]

_BITSANDBYTES_CPU = "bitsandbytes.backends.cpu.ops"
_KERNELS_HUB = "kernels._internals.hf_hub"
_BITSANDBYTES_KERNEL = "kernels-community/quantization-bitsandbytes"
# What `kernels` says when the kernel cannot be fetched: the Hub offline without a cached copy, or unreachable.
_NOT_FETCHED = ("is not available in the local cache", "could not verify publisher trust status")
_HUB_KERNELS = "transformers.integrations.hub_kernels"
_TORCHAO = "torchao"
_PYTREE = "torch.utils._pytree"


def _optional_kernel_missing(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it is bitsandbytes' warning that its optional kernel is absent: the `kernels`
    package not installed, or the kernel not fetched from the Hub."""
    if not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"):
        return True
    cause = record.args[0] if isinstance(record.args, tuple) and record.args else None
    if isinstance(cause, ModuleNotFoundError):
        return cause.name != "kernels"
    return not (isinstance(cause, ValueError) and any(words in str(cause) for words in _NOT_FETCHED))


def _bitsandbytes_trust_check_offline(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it is `kernels` saying, offline, that it skips the trust check of bitsandbytes'
    optional kernel (said at every import of bitsandbytes, for a kernel nobody asked for)."""
    message = record.getMessage()
    return not (message.startswith("Skipping publisher trust check") and _BITSANDBYTES_KERNEL in message)


def _gpu_kernel_advice_without_a_gpu(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it advises installing a GPU kernel package on a machine without a GPU."""
    if "is falling back to its reference PyTorch implementation" not in str(record.msg):
        return True
    import torch  # imported by then: the message comes from a model's forward

    return torch.cuda.is_available()


def _cuda_extension_without_cuda(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it is torchao failing to load a compiled extension into a torch without CUDA."""
    if not str(record.msg).startswith("Failed to load "):
        return True
    import torch  # imported by then: torchao imports it first

    return torch.version.cuda is not None


def _enum_registration_notice(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it is torch's notice that registering an Enum as a pytree constant is deprecated
    (torchao's import does it)."""
    return "is an Enum subclass and is now natively supported by torch.compile" not in str(record.msg)


def install() -> None:
    """Attach the filters (idempotent). Must run before the third-party module is imported: the warning is logged at
    its import, so `vlm_grpo/__init__.py` calls this."""
    filters = (
        (_BITSANDBYTES_CPU, _optional_kernel_missing),
        (_KERNELS_HUB, _bitsandbytes_trust_check_offline),
        (_HUB_KERNELS, _gpu_kernel_advice_without_a_gpu),
        (_TORCHAO, _cuda_extension_without_cuda),
        (_PYTREE, _enum_registration_notice),
    )
    for name, keep in filters:
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """transformers' progress bars (and huggingface_hub's, which transformers switches with its own) off inside the
    block, back as they were after it."""
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():  # huggingface_hub warns when HF_HUB_DISABLE_PROGRESS_BARS already decides
        warnings.simplefilter("ignore")
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def datasets_bars_off() -> Iterator[None]:
    """datasets' progress bars off inside the block (a cast of a column's type takes no time, yet drew a "Casting
    the dataset" bar per call), back as they were after it."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()
