"""Fail a test in which vlm_grpo (or the test itself) calls a deprecated third-party API.

Deprecations reach us two ways: `warnings.warn(..., FutureWarning / DeprecationWarning)` and transformers'
`logger.warning_once("... deprecated ...")` (e.g. reading `output.past_key_values`). Both are caught as they are
raised, while the caller's frames are still on the stack: walking out from the library that raised it, past the
plumbing a call passes through (torch's `Module.__call__`, PEFT's forwarding wrappers, decorators), the first other
frame is the one that called the deprecated API. When that frame is package or test code, the test fails and names
its file and line, so a rename fails here, in a unit test, instead of in a user's run when the alias is removed.

A deprecated call that third-party code makes on its own (TRL calling transformers' old checkpointing names, say)
is not ours to fix and is left to pytest's warning filters in pyproject.toml.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = (os.path.join(_PACKAGE_DIR, "vlm_grpo") + os.sep, os.path.join(_PACKAGE_DIR, "tests") + os.sep)
# Code a call passes through on its way to the deprecated API, skipped when looking for the caller: these packages
# whole, and the forwarding functions of PEFT's and accelerate's wrappers (a PeftModel hands `forward` kwargs and
# attribute look-ups to the model inside; PEFT's own calls elsewhere, e.g. in `PeftModel.__init__`, are PEFT's).
PLUMBING = {"torch", "functools", "contextlib", "warnings", "logging", "importlib", "inspect"}
WRAPPERS = {"peft", "accelerate"}
FORWARDING = {"forward", "__call__", "__getattr__", "generate", "new_forward", "_call_impl", "_wrapped_call_impl"}
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
CHANNELS = {"warnings", "logging"}  # how a deprecation is reported, never the API deprecated

found: list[str] = []  # "file:line: message" of each deprecated call made by our code during the current test


def _package(frame) -> str:
    return (frame.f_globals.get("__name__") or "").split(".")[0]


def _is_plumbing(frame) -> bool:
    package = _package(frame)
    return package in PLUMBING or (package in WRAPPERS and frame.f_code.co_name in FORWARDING)


def _is_ours(frame) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(OURS)


def _check(message: str, frame) -> None:
    """`frame` raised a deprecation; record it if the deprecated API was called from our code."""
    while frame is not None and _package(frame) in CHANNELS:
        frame = frame.f_back
    if frame is None or _is_ours(frame):  # our own warning, not a third-party API's
        return
    # The library that raised it owns the deprecated API, even a plumbing one: torch deprecating its own
    # `torch.jit.script_method`, used by bitsandbytes as it imports, is bitsandbytes' call, not the importing test's.
    # A module's own import is the caller of whatever its body calls: reaching the import machinery before any frame
    # of ours means a third-party module made the call as it was imported (torch's `torch.utils.mkldnn` decorating
    # with its own deprecated `script_method` when torch.compile first imports it), not the code that imported it.
    emitter = _package(frame)
    while frame is not None and (_is_plumbing(frame) or _package(frame) == emitter):
        if _package(frame) == "importlib":
            return
        frame = frame.f_back
    if frame is not None and _is_ours(frame):
        where = f"{os.path.relpath(frame.f_code.co_filename, _PACKAGE_DIR)}:{frame.f_lineno}"
        found.append(f"{where}: {message.strip().splitlines()[0]}")


_real_warn = warnings.warn


def _warn(message, category=None, stacklevel=1, source=None, **kwargs):
    category = category or (type(message) if isinstance(message, Warning) else UserWarning)
    if issubclass(category, DEPRECATIONS):
        _check(str(message), sys._getframe(1))
    # One frame more than the caller asked for: this wrapper is one frame deeper than `warnings.warn` would be.
    return _real_warn(message, category, stacklevel + 1, source, **kwargs)


class _DeprecationLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecated" in message.lower():
            _check(message, sys._getframe(1))


def install() -> None:
    """Watch every warning and transformers log record for the rest of the process."""
    warnings.warn = _warn
    logging.getLogger("transformers").addHandler(_DeprecationLogHandler(level=logging.WARNING))


@pytest.fixture(autouse=True)
def no_deprecated_calls_from_our_code():
    """Each test starts with none found (and transformers' warn-once memory cleared, so a deprecation raised earlier
    in the session is raised again here); any found fails the test."""
    found.clear()
    cache_clear = getattr(getattr(logging.Logger, "warning_once", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    yield
    if found:
        calls = "\n  ".join(dict.fromkeys(found))
        pytest.fail(f"package or test code calls a deprecated API (use vlm_grpo.compat):\n  {calls}", pytrace=False)
