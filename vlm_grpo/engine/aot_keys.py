"""What the file name of a layer's ahead-of-time compiled function hashes (`engine.aot_layers`): what the function's
own guards cannot check once saved.

torch drops a saved function's guards on global names (the functions a layer's code reaches by name:
`apply_rotary_pos_emb`, the attention registry, PEFT's helpers) and on object identities. So `signature_key` hashes the
layer's class, its forward's code, its structure (`repr`: every submodule's class and sizes), which object each function
and class name of those submodules' Python modules holds (a library's patch changes it), the call's signature (argument
names; tensors' dtypes, devices, ranks and whether they require grad; other arguments' values), autocast, and which
forward each of the layer's hub-kernel wrappers runs (`engine.kernel_wrappers`). Every
part is the same in every process (no memory addresses, no hash seeds): another process compiles what this one loads.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
import weakref
from typing import Any

import torch

from .kernel_wrappers import wrapped_function, wrapper_forwards

__all__ = ["LEFT_EAGER_MARK", "signature_key"]

#: The attribute holding what it wraps on each `torch.compiler.disable` wrapper `engine.compiled_layers` installs in a
#: transformers module (Qwen3.5's convolution and chunked scan, left eager in a compiled linear-attention layer).
LEFT_EAGER_MARK = "_left_eager"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), str(value.device), value.dim(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *map(_describe, value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def _code_bytes(code: types.CodeType) -> bytes:
    """`code`'s bytecode, names and constants, nested code objects (comprehensions, lambdas) by their own content:
    their `repr` holds a memory address, which would give every process another key."""
    consts = b"".join(
        _code_bytes(c) if isinstance(c, types.CodeType)
        else repr(sorted(c, key=repr)).encode() if isinstance(c, frozenset)  # `x in {...}`: ordered by the hash seed
        else repr(c).encode()
        for c in code.co_consts
    )  # fmt: skip
    return code.co_code + repr(code.co_names).encode() + consts


@functools.cache
def _code(function: Any) -> str:
    """A hash of the code of `function` and of every function it wraps (the same in every process)."""
    digest = hashlib.sha256()
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None:
            digest.update(_code_bytes(code))
        function = getattr(function, "__wrapped__", None)
    return digest.hexdigest()


@functools.cache
def _module_globals(name: str) -> str:
    """A hash of the functions and classes the Python module `name` holds by name (which object each name is): a
    loaded function does not check them (its guards on globals are dropped), and a library that patches a model
    (e.g. replacing `apply_rotary_pos_emb`) changes them. Once per process: patches come before training."""
    entries = []
    for key, value in sorted(vars(sys.modules[name]).items()) if name in sys.modules else ():
        # Not dunder names: Dynamo puts its compiled frames there (`__compiled_fn_<n>_<uuid>`, `__resume_at_...`).
        if callable(value) and not key.startswith("__"):
            if getattr(value, LEFT_EAGER_MARK, None) is not None:
                # By what it wraps: only the linear attention calls it, and that is never compiled ahead of time, so
                # the patch changes no saved function; keyed as the wrapper, every other layer of the model had
                # another key in a new process (unpatched) and was compiled by the trainer's.
                value = getattr(value, LEFT_EAGER_MARK)
            value = wrapped_function(value) or value  # a hub-kernel wrapper by what it wraps (`engine.kernel_wrappers`)
            try:
                code = _code(value)
            except TypeError:  # an unhashable callable object: its name and type stand for it
                code = type(value).__qualname__
            entries.append((key, getattr(value, "__module__", ""), getattr(value, "__qualname__", ""), code))
    return hashlib.sha256(repr(entries).encode()).hexdigest()


# A module's class, forward, structure and the globals of the Python modules its classes come from, hashed once per
# module: its `repr` alone takes ~0.4 ms for a LoRA layer, and a step calls every layer twice (the forward and
# checkpointing's recomputation).
_STRUCTURE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def _attention_functions(module: torch.nn.Module) -> str:
    """Which function transformers' attention registry (`ALL_ATTENTION_FUNCTIONS`) holds under each implementation
    name the module's parts are configured with (a saved function checks the name, not the function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = {getattr(m.config, "_attn_implementation", None) for m in module.modules() if hasattr(m, "config")}
    functions = [(n, ALL_ATTENTION_FUNCTIONS[n]) for n in sorted(filter(None, names)) if n in ALL_ATTENTION_FUNCTIONS]
    return repr([(n, getattr(f, "__module__", ""), getattr(f, "__qualname__", ""), _code(f)) for n, f in functions])


def _structure(module: torch.nn.Module) -> str:
    found = _STRUCTURE.get(module)
    if found is None:
        kind = type(module)
        sources = sorted({type(m).__module__ for m in module.modules()})
        found = _STRUCTURE[module] = hashlib.sha256(
            f"{kind.__module__}.{kind.__qualname__}|{_code(kind.forward)}|{module!r}|{_attention_functions(module)}|".encode()
            + "|".join(map(_module_globals, sources)).encode()
        ).hexdigest()
    return found


def signature_key(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str:
    """A hash of what a loaded function's dropped guards would have checked (the module docstring): two calls with
    the same key may share a saved function, whose own guards check the rest."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    state = (torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device)),
             torch.are_deterministic_algorithms_enabled(), str(torch.get_default_dtype()))  # fmt: skip
    # Not in `_structure`'s hash: `kernelize` swaps the wrappers' forwards at every change of mode.
    parts = (_structure(module), wrapper_forwards(module), state, [_describe(a) for a in args],
             sorted((k, repr(_describe(v))) for k, v in kwargs.items()))  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
