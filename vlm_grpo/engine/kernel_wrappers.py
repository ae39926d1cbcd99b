"""transformers' hub-kernel wrappers given names a compiled layer's saved guards can hold, and told apart in its key.

Why: transformers 5.25 (with `kernels`, its dependency since) turns functions such as most decoders'
`apply_rotary_pos_emb` into instances of a class that `kernels` defines inside a function (`Func`, one class per
wrapped function), and every attention keeps private copies of them (`_kernel_funcs`). A compiled layer's guards check
those objects' type, and torch refuses to save a guard on a class defined in local scope: every such layer (Qwen2/2.5/
3-VL, Qwen3.5, Gemma 3, Llama, Mistral, Pixtral, LFM2) fell back to torch.compile, and a fresh process traced it again.

What: `name_wrappers` gives each such class a name at the top level of this module that says where its wrapper lives
(`wrapper:transformers:models:qwen2_5_vl:modeling_qwen2_5_vl:apply_rotary_pos_emb`); pickle resolves it in any process
through this module's `__getattr__` (it imports the model's module and takes the wrapper's class there), so the guard
is saved, loaded and checked as any other. `wrapped_function` and `wrapper_forwards` give the key (`engine.aot_keys`)
what a loaded function cannot check: which function a wrapper wraps, and which forward each of a layer's wrappers runs
(the wrapped function, or a hub kernel that `kernelize` put there).
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Callable
from types import MethodType
from typing import Any

from torch import nn

__all__ = ["name_wrappers", "wrapped_function", "wrapper_forwards"]

_PREFIX = "wrapper:"  # names this module answers; ":" separates a module path's parts (pickle splits names on ".")


def __getattr__(name: str) -> type:
    """The wrapper class that `name_wrappers` named `name` (pickle's lookup when it loads a saved guard)."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    *path, attribute = name[len(_PREFIX) :].split(":")
    return type(getattr(importlib.import_module(".".join(path)), attribute))


def _is_wrapper(value: Any) -> bool:
    return hasattr(type(value), "kernel_layer_name") and isinstance(value, nn.Module)


def name_wrappers(module: nn.Module) -> None:
    """Name the local wrapper classes whose instances the Python modules of `module`'s parts hold by name (idempotent;
    the wrappers work as before: `kernels` names them by their layer name, never by their class's name)."""
    for source in sorted({type(m).__module__ for m in module.modules()}):
        for attribute, value in list(getattr(sys.modules.get(source), "__dict__", {}).items()):
            kind = type(value)
            if _is_wrapper(value) and "<locals>" in kind.__qualname__:
                kind.__module__ = __name__
                kind.__qualname__ = kind.__name__ = f"{_PREFIX}{source.replace('.', ':')}:{attribute}"


def wrapped_function(value: Any) -> Callable | None:
    """The function a hub-kernel wrapper wraps (its forward's `func`), or None for anything else."""
    if not _is_wrapper(value):
        return None
    forward = type(value).__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    cells = dict(zip(code.co_freevars, forward.__closure__ or ())) if code is not None else {}
    cell = cells.get("func")
    return cell.cell_contents if cell is not None and callable(cell.cell_contents) else None


# Each module's wrappers, found once (a walk of a LoRA decoder layer's parts takes ~0.1 ms, and the key is computed at
# every call of every layer); `kernelize` swaps their forwards, never the wrappers, so those are read at every call.
_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, str, nn.Module]]] = weakref.WeakKeyDictionary()


def wrapper_forwards(module: nn.Module) -> str:
    """Which forward each wrapper that `module`'s parts keep privately runs: the wrapped function's ("") or a hub
    kernel's (its module and name), in the same words in every process."""
    wrappers = _WRAPPERS.get(module)
    if wrappers is None:
        wrappers = _WRAPPERS[module] = [
            (name, function_name, wrapper)
            for name, part in module.named_modules()
            for function_name, wrapper in sorted(part.__dict__.get("_kernel_funcs", {}).items())
            if isinstance(wrapper, nn.Module)
        ]
    if not wrappers:
        return ""
    entries = []
    for name, function_name, wrapper in wrappers:
        forward = wrapper.__dict__.get("forward")
        if isinstance(forward, MethodType):
            forward = forward.__func__
        where = (
            "" if forward is None else f"{getattr(forward, '__module__', '')}.{getattr(forward, '__qualname__', '')}"
        )
        entries.append((name, function_name, where))
    return repr(entries)
