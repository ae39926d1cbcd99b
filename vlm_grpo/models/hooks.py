"""Requires-grad hooks that keep gradient checkpointing training when the inputs are frozen.

Reentrant gradient checkpointing (`torch.utils.checkpoint` with `use_reentrant=True`) only
back-propagates into a checkpointed block when one of the block's *inputs* requires grad. With LoRA
the embeddings and the vision tower's patch embedding are frozen, so nothing entering the first
block requires grad and the LoRA weights inside silently get no gradient. The original package found
this for vision LoRA: Unsloth's hook made `output.loss` require grad, but GRPO forwards carry no
labels, so `loss` is None and the vision adapters never trained.

The fix, registered by `enable_requires_grad_hooks`:
- the input embeddings' output requires grad (the language model's first block sees a grad input);
- the vision tower's pixel input requires grad (its first block does too);
- the model's output (`loss`, else `logits`) requires grad, so a loss built on it can always call
  `backward()` even when every trainable parameter sits behind a frozen path.

transformers has a hook of its own for the first: `enable_input_require_grads`, which every
`gradient_checkpointing_enable` calls. It registers a fresh hook at each call and forgets the ones before (it
overwrites `_require_grads_hooks` without removing them), and TRL switches checkpointing off and on around every
scoring pass: a run piled up one hook per step, each run by every forward (2 000 after 2 000 steps, found by
`benchmarks/soak.py`). `replace_stale_input_grads_hooks` makes each call replace the hooks of the call before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..families import vision_tower_names

__all__ = [
    "VISION_TOWER_NAMES",
    "disable_requires_grad_hooks",
    "enable_requires_grad_hooks",
    "find_vision_tower",
    "replace_stale_input_grads_hooks",
    "requires_grad_post_hook",
    "requires_grad_pre_hook",
]

_HANDLES_ATTR = "_vlm_grpo_requires_grad_handles"
# Attribute names under which transformers' VLMs keep their vision encoder: the registered families' (from
# `vlm_grpo.families`), then other VLMs', so the hooks also reach the vision tower of a VLM without a record.
VISION_TOWER_NAMES = vision_tower_names()
_PIXEL_KWARGS = ("pixel_values", "hidden_states", "pixel_values_videos")


def _make_require_grad(tensor: torch.Tensor) -> torch.Tensor:
    # Only leaves can be flipped; a tensor with a grad_fn already carries the graph we need.
    if tensor.is_floating_point() and not tensor.requires_grad and tensor.grad_fn is None:
        tensor.requires_grad_(True)
    return tensor


def requires_grad_post_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: make `output` require grad.

    `output` may be a tensor, or a model output: then `loss` when it is not None, else `logits`
    (GRPO forwards carry no labels, so `loss` is None), else the first of `log_probs` /
    `last_hidden_state`. Anything else raises a `TypeError` naming what was found.
    """
    if torch.is_grad_enabled():  # under no_grad (generation, reference log-probs) there is nothing to attach to
        if isinstance(output, torch.Tensor):
            _make_require_grad(output)
        else:
            for name in ("loss", "logits", "log_probs", "last_hidden_state"):
                value = getattr(output, name, None) if not isinstance(output, dict) else output.get(name)
                if isinstance(value, torch.Tensor):
                    _make_require_grad(value)
                    break
            else:
                raise TypeError(
                    f"requires_grad_post_hook on {type(module).__name__}: output of type {type(output).__name__} "
                    "has no tensor `loss`, `logits`, `log_probs` or `last_hidden_state`; register the hook on a "
                    "module that returns a tensor or a transformers ModelOutput."
                )
    return output


def requires_grad_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (`with_kwargs=True`): make the vision tower's pixel input require grad.

    The pixel tensor is the first floating-point positional argument, or the keyword `pixel_values`
    (`hidden_states` for Qwen's vision tower).
    """
    if torch.is_grad_enabled():
        for key in _PIXEL_KWARGS:
            if isinstance(kwargs.get(key), torch.Tensor):
                _make_require_grad(kwargs[key])
                return args, kwargs
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                _make_require_grad(arg)
                break
    return args, kwargs


def find_vision_tower(model: nn.Module) -> nn.Module | None:
    """Return the vision encoder of a transformers VLM (PEFT-wrapped or not), or None for a text model."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES:
            return module
    return None


def enable_requires_grad_hooks(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Register the three hooks (input embeddings, vision tower input, model output) on `model`.

    Idempotent: a second call adds nothing and returns the existing handles. Remove them with
    `disable_requires_grad_hooks(model)`.
    """
    handles = getattr(model, _HANDLES_ATTR, None)
    if handles:
        return handles
    handles = []
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        handles.append(embeddings.register_forward_hook(requires_grad_post_hook))
    vision = find_vision_tower(model)
    if vision is not None:
        handles.append(vision.register_forward_pre_hook(requires_grad_pre_hook, with_kwargs=True))
    handles.append(model.register_forward_hook(requires_grad_post_hook))
    # Stored outside nn.Module's attribute machinery (a plain list) so PEFT/accelerate wrappers leave it alone.
    object.__setattr__(model, _HANDLES_ATTR, handles)
    return handles


def disable_requires_grad_hooks(model: nn.Module) -> int:
    """Remove the hooks that `enable_requires_grad_hooks` registered; return how many were removed."""
    handles = getattr(model, _HANDLES_ATTR, None) or []
    for handle in handles:
        handle.remove()
    object.__setattr__(model, _HANDLES_ATTR, [])
    return len(handles)


def replace_stale_input_grads_hooks(model: nn.Module) -> None:
    """Make transformers' `enable_input_require_grads`, on `model` and every transformers model inside it, remove the
    hooks its previous call registered before registering new ones, so they never pile up (see the module's text)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if not isinstance(module, PreTrainedModel) or "enable_input_require_grads" in vars(module):
            continue
        original = type(module).enable_input_require_grads

        def enable(self: PreTrainedModel = module, original: Any = original) -> None:
            for handle in getattr(self, "_require_grads_hooks", None) or []:
                handle.remove()  # a no-op for one `disable_input_require_grads` already removed
            original(self)

        module.enable_input_require_grads = enable  # the instance's, so every caller (TRL, PEFT, transformers) gets it
