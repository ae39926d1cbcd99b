"""Unsloth interop: make `unsloth_zoo`'s gradient-checkpointing hooks ours.

Unsloth turns gradient checkpointing on through `unsloth_zoo.peft_utils.requires_grad_for_gradient_checkpointing`,
which registers its own requires-grad hooks. Older releases put the post-hook on `output.loss`, which is None in
GRPO (no labels), so vision LoRA got no gradient under checkpointing; that is why this package exists.
`patch_unsloth_zoo()` swaps that function for one that registers `vlm_grpo.models.hooks` instead, so every Unsloth
version behaves the same. It also rebinds the name in modules that imported it already (Unsloth's
`unsloth.models.vision` does `from unsloth_zoo.peft_utils import ...`), so the import order does not matter for
models built afterwards. A model whose Unsloth hooks were registered before the patch is repaired by
`replace_unsloth_hooks(model)`, which `VLMGRPOTrainer` calls for you.

Nothing here imports `unsloth_zoo` unless it is installed and asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Any

from torch import nn

from ..models.hooks import enable_requires_grad_hooks

__all__ = ["is_patched", "patch_unsloth_zoo", "replace_unsloth_hooks", "unpatch_unsloth_zoo", "uses_unsloth"]

logger = logging.getLogger(__name__)

_TARGET = "requires_grad_for_gradient_checkpointing"
_original: Any = None


def _available() -> bool:
    return "unsloth_zoo" in sys.modules or importlib.util.find_spec("unsloth_zoo") is not None


def _peft_utils():
    try:
        return importlib.import_module("unsloth_zoo.peft_utils")
    except Exception as error:  # unsloth_zoo raises at import on machines it does not support
        raise ImportError(
            f"unsloth_zoo is installed but cannot be imported ({type(error).__name__}: {error}). On a machine "
            "without a GPU set UNSLOTH_ZOO_DISABLE_GPU_INIT=1 (or import unsloth first)."
        ) from error


def _is_unsloth_hook(hook: Any) -> bool:
    return getattr(hook, "__module__", "") == "unsloth_zoo.peft_utils" and "requires_grad" in getattr(
        hook, "__qualname__", ""
    )


def replace_unsloth_hooks(model: nn.Module) -> int:
    """Remove Unsloth's requires-grad hooks from `model` and register ours; return how many were removed."""
    removed = 0
    for module in model.modules():
        for hooks, extra in (
            (module._forward_hooks, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
            (module._forward_pre_hooks, ("_forward_pre_hooks_with_kwargs",)),
        ):
            for key in [k for k, hook in hooks.items() if _is_unsloth_hook(hook)]:
                del hooks[key]
                for name in extra:
                    getattr(module, name, {}).pop(key, None)
                removed += 1
    enable_requires_grad_hooks(model)
    return removed


def _ours(model: nn.Module) -> nn.Module:
    """Drop-in for unsloth_zoo's function: same signature, vlm_grpo's hooks."""
    replace_unsloth_hooks(model)
    return model


_ours.__name__ = _TARGET
_ours._vlm_grpo_patched = True  # type: ignore[attr-defined]


def _bound(module: Any) -> Any:
    # The module's own namespace only: getattr on lazy modules (transformers) would import half the library.
    namespace = getattr(module, "__dict__", None)
    return namespace.get(_TARGET) if isinstance(namespace, dict) else None


def is_patched() -> bool:
    """Whether `patch_unsloth_zoo()` is in effect."""
    module = sys.modules.get("unsloth_zoo.peft_utils")
    return module is not None and getattr(getattr(module, _TARGET, None), "_vlm_grpo_patched", False)


def patch_unsloth_zoo() -> bool:
    """Make `unsloth_zoo` register vlm_grpo's requires-grad hooks. Idempotent.

    Returns False (and does nothing) when `unsloth_zoo` is not installed, True once patched.
    """
    global _original
    if not _available():
        return False
    peft_utils = _peft_utils()
    current = getattr(peft_utils, _TARGET)
    if getattr(current, "_vlm_grpo_patched", False):
        return True
    _original = current
    rebound = []
    for name, module in list(sys.modules.items()):
        if _bound(module) is current:
            setattr(module, _TARGET, _ours)
            rebound.append(name)
    logger.info("vlm-grpo: unsloth_zoo's %s now registers vlm_grpo hooks (in %s).", _TARGET, ", ".join(rebound))
    return True


def unpatch_unsloth_zoo() -> None:
    """Undo `patch_unsloth_zoo()` (mainly for tests)."""
    global _original
    if _original is None:
        return
    for module in list(sys.modules.values()):
        if _bound(module) is _ours:
            setattr(module, _TARGET, _original)
    _original = None


def uses_unsloth(model: nn.Module) -> bool:
    """Whether `model` was prepared by Unsloth (its hooks or its patched classes are on it)."""
    if "unsloth_zoo" not in sys.modules and "unsloth" not in sys.modules:
        return False
    for module in model.modules():
        if any(_is_unsloth_hook(h) for h in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())):
            return True
    return type(model).__module__.startswith("unsloth") or hasattr(model, "_saved_temp_tokenizer")


def maybe_patch_for_model(model: nn.Module) -> None:
    """Called by `VLMGRPOTrainer`: for an Unsloth-prepared model, patch unsloth_zoo and swap the model's hooks."""
    if not uses_unsloth(model):
        return
    patch_unsloth_zoo()
    removed = replace_unsloth_hooks(model)
    if removed:
        logger.warning(
            "vlm-grpo: replaced %d requires-grad hook(s) that Unsloth registered before vlm_grpo could patch it. "
            "Training is fine; to skip this step, call vlm_grpo.integrations.unsloth.patch_unsloth_zoo() right "
            "after `import unsloth`, before FastVisionModel.get_peft_model.", removed
        )  # fmt: skip
