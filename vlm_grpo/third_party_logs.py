"""Third-party log lines that report no problem, dropped before a user reads them as one; real errors kept.

bitsandbytes (imported by PEFT whenever it is installed, as with `pip install 'vlm-grpo[dev]'`) looks, on CPUs with
AVX512-BF16, for an optional faster 4-bit kernel in the `kernels` package and warns at import when that package is
not installed: "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'". Its own CPU
kernel serves instead, so nothing is wrong; yet it was the first line of every command. Only that case is dropped:
the same warning for any other cause (`kernels` installed but failing) still shows.
"""

from __future__ import annotations

import logging

__all__ = ["install"]

_BITSANDBYTES_CPU = "bitsandbytes.backends.cpu.ops"


def _optional_kernel_missing(record: logging.LogRecord) -> bool:
    """True (keep the record) unless it is bitsandbytes' warning that the optional `kernels` package is absent."""
    if not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"):
        return True
    cause = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return not (isinstance(cause, ModuleNotFoundError) and cause.name == "kernels")


def install() -> None:
    """Attach the filters (idempotent). Must run before the third-party module is imported: the warning is logged at
    its import, so `vlm_grpo/__init__.py` calls this."""
    logger = logging.getLogger(_BITSANDBYTES_CPU)
    if _optional_kernel_missing not in logger.filters:
        logger.addFilter(_optional_kernel_missing)
