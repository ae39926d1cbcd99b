"""Mode switching, one owner: train or eval, activation checkpointing (on or off, reentrant or not), the KV cache
and the tokenizer's padding side.

`for_inference` and `for_training` set a mode (Unsloth's API, re-exported by `FastBaseVisionModel`). Code that
generates in the middle of someone else's setup (`vlm_grpo.evaluate`, the trainer's rollouts) uses `generating(model)`
instead: eval mode, the KV cache and left padding for the block, then exactly the state it found, checkpointing
untouched, so a held-out evaluation before training cannot switch on checkpointing that the user switched off.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import (
    CHECKPOINTING_ARG,
    checkpointing_from_args,
    disable_checkpointing,
    enable_checkpointing,
    is_checkpointing,
)
from .hooks import enable_requires_grad_hooks

__all__ = [
    "CHECKPOINTING_CHOICES",
    "ModelMode",
    "apply_configured_checkpointing",
    "checkpointing_kwargs",
    "checkpointing_mode",
    "checkpointing_off",
    "for_inference",
    "for_training",
    "generating",
    "is_checkpointing",
    "set_checkpointing",
]

CHECKPOINTING_CHOICES = (True, False, "unsloth", "reentrant", "non_reentrant")


logger = logging.getLogger(__name__)


def checkpointing_kwargs(use_gradient_checkpointing: bool | str) -> dict[str, Any] | None:
    """`torch.utils.checkpoint` kwargs for a `use_gradient_checkpointing` value (None: off); bad values raise."""
    if use_gradient_checkpointing not in CHECKPOINTING_CHOICES:
        raise ValueError(
            f"use_gradient_checkpointing must be one of {CHECKPOINTING_CHOICES}, got {use_gradient_checkpointing!r}."
        )
    if use_gradient_checkpointing is False:
        return None
    # Non-reentrant is PyTorch's recommended mode and needs no input grads; "reentrant" is kept for parity
    # with older recipes (the hooks make it train too). Unsloth's "unsloth" offloading mode maps to non-reentrant.
    return {"use_reentrant": use_gradient_checkpointing == "reentrant"}


def _checkpoint_func_kwargs(model: nn.Module) -> dict[str, Any] | None:
    """The kwargs checkpointing was switched on with (None when off).

    transformers gives every checkpointed layer a `functools.partial` of `torch.utils.checkpoint.checkpoint` holding
    them, so they are known however checkpointing was switched on (`get_peft_model`, `for_training`, transformers).
    """
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            keywords = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None)
            return dict(keywords or {})
    return None


def checkpointing_mode(model: nn.Module) -> bool | str:
    """The model's checkpointing as `for_training` takes it: False (off), "reentrant", or True (non-reentrant).
    Switched on without `use_reentrant`, torch's checkpoint runs reentrant (and warns): "reentrant"."""
    kwargs = _checkpoint_func_kwargs(model)
    if kwargs is None:
        return False
    return "reentrant" if kwargs.get("use_reentrant", True) else True


def set_checkpointing(model: nn.Module, use_gradient_checkpointing: bool | str) -> None:
    """Switch checkpointing on (with the requires-grad hooks that keep frozen-input LoRA training) or off."""
    kwargs = checkpointing_kwargs(use_gradient_checkpointing)
    if kwargs is None:
        disable_checkpointing(model)
        return
    enable_checkpointing(model, kwargs)
    enable_requires_grad_hooks(model)


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and its text config (a VLM reads `use_cache` from either), each once."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config, getattr(config, "text_config", None), getattr(model, "generation_config", None)]
    return list({id(c): c for c in configs if c is not None}.values())


def _set_use_cache(model: nn.Module, value: bool) -> None:
    for config in _configs(model):
        config.use_cache = value


def _tokenizer(model: nn.Module) -> Any:
    processor = getattr(model, "_vlm_grpo_processor", None)
    return None if processor is None else getattr(processor, "tokenizer", processor)


def for_inference(model: nn.Module) -> nn.Module:
    """Eval mode, checkpointing off, KV cache on, left padding. Idempotent; returns `model`."""
    model.eval()
    disable_checkpointing(model)
    _set_use_cache(model, True)
    tokenizer = _tokenizer(model)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    return model


def for_training(model: nn.Module, use_gradient_checkpointing: bool | str = True) -> nn.Module:
    """Train mode, checkpointing (and hooks) on, KV cache off. Idempotent; returns `model`."""
    model.train()
    _set_use_cache(model, False)
    if use_gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", True):
        warnings.warn(f"{type(model).__name__} does not support gradient checkpointing; training without it.")
        use_gradient_checkpointing = False
    set_checkpointing(model, use_gradient_checkpointing)
    return model


@dataclass(frozen=True)
class ModelMode:
    """Everything `for_inference` / `for_training` change, as found on a model (`ModelMode.of`), to put back
    (`restore`)."""

    training: bool
    checkpointing_kwargs: dict[str, Any] | None  # None: off
    checkpointed_layers: tuple[bool, ...]  # each layer's flag (transformers can checkpoint every n-th layer only)
    use_cache: tuple[Any, ...]
    padding_side: str | None

    @classmethod
    def of(cls, model: nn.Module) -> ModelMode:
        tokenizer = _tokenizer(model)
        return cls(
            training=model.training,
            checkpointing_kwargs=_checkpoint_func_kwargs(model),
            checkpointed_layers=tuple(m.gradient_checkpointing for m in _checkpointable(model)),
            use_cache=tuple(getattr(c, "use_cache", None) for c in _configs(model)),
            padding_side=None if tokenizer is None else tokenizer.padding_side,
        )

    def restore(self, model: nn.Module) -> None:
        """Put `model` back in this mode."""
        if ModelMode.of(model) == self:
            return
        if self.checkpointing_kwargs is None:
            disable_checkpointing(model)
        elif _checkpoint_func_kwargs(model) != self.checkpointing_kwargs:
            enable_checkpointing(model, self.checkpointing_kwargs)
            enable_requires_grad_hooks(model)
        if self.checkpointing_kwargs is not None:
            for module, flag in zip(_checkpointable(model), self.checkpointed_layers):
                module.gradient_checkpointing = flag
        model.train(self.training)
        for config, value in zip(_configs(model), self.use_cache):
            config.use_cache = value
        tokenizer = _tokenizer(model)
        if tokenizer is not None and self.padding_side is not None:
            tokenizer.padding_side = self.padding_side


def _checkpointable(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]


@contextlib.contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[nn.Module]:
    """Activation checkpointing off inside the block; afterwards the mode found, exactly (its kwargs, which layers)."""
    mode = ModelMode.of(model)
    disable_checkpointing(model)
    try:
        yield model
    finally:
        mode.restore(model)


@contextlib.contextmanager
def generating(model: nn.Module) -> Iterator[nn.Module]:
    """Inference mode inside the block (eval, KV cache on, left padding); afterwards the mode the model was found in.

    Activation checkpointing is left as it is: transformers' layers checkpoint only in training mode with gradients,
    so it does nothing while generating, and switching it off and on again walks every module several times (~0.2 s a
    rollout for a 3B VLM with LoRA on every linear layer, with the GPU waiting).
    """
    modules = list(model.modules())
    training = [m.training for m in modules]
    configs = _configs(model)
    use_cache = [getattr(c, "use_cache", None) for c in configs]
    tokenizer = _tokenizer(model)
    padding_side = None if tokenizer is None else tokenizer.padding_side
    _set_training(modules, [False] * len(modules))
    _set_use_cache(model, True)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    try:
        yield model
    finally:
        _set_training(modules, training)
        for config, value in zip(configs, use_cache):
            config.use_cache = value
        if tokenizer is not None:
            tokenizer.padding_side = padding_side


def _set_training(modules: list[nn.Module], flags: list[bool]) -> None:
    """Give each module (in `model.modules()` order) its own training flag: what `model.eval()` / `model.train()` do,
    in one pass instead of a recursive `train()` per module (~5 000 for a 3B VLM with LoRA, twice a rollout), and each
    module back in the mode it was found in (a tower the user froze in eval mode stays so). A module whose `train`
    does more than set flags has it called (its children, which follow it, are then set again)."""
    for module, flag in zip(modules, flags, strict=True):
        if _own_train(module):
            module.train(flag)
        else:
            module.__dict__["training"] = flag


def _own_train(module: nn.Module) -> bool:
    """Whether `module.train` does more than `nn.Module.train` (transformers' does only for hub kernels), or the flag
    lives elsewhere than the module's `__dict__`: a `train` set on the object, a class with its own `__setattr__`, a
    TorchScript module (its C++ flag)."""
    if "train" in vars(module) or type(module).__setattr__ is not nn.Module.__setattr__:
        return True
    if isinstance(module, torch.jit.ScriptModule):
        return True
    train = type(module).train
    if train is nn.Module.train:
        return False
    from transformers import PreTrainedModel

    return train is not PreTrainedModel.train or bool(getattr(module, "use_kernels", False))


def apply_configured_checkpointing(model: nn.Module, args: Any) -> None:
    """Give `model` the checkpointing its training `args` configure, whatever state it arrived in (logged when that
    differs).

    The args are the truth, as transformers' Trainer treats them when they switch checkpointing on: a model left
    checkpointing by earlier code (an older `evaluate`, `get_peft_model`'s default) must not train with it when the
    config says off, nor the other way round.
    """
    enabled, kwargs = checkpointing_from_args(args)
    # transformers gives `{"use_reentrant": False}` for no kwargs; kwargs without it leave torch's default, reentrant.
    reentrant = bool(kwargs) and kwargs.get("use_reentrant", True)
    configured: bool | str = ("reentrant" if reentrant else True) if enabled else False
    found = checkpointing_mode(model)
    if configured and not getattr(model, "supports_gradient_checkpointing", True):
        return  # transformers' Trainer refuses it with its own message
    if found != configured:
        logger.warning(
            "Activation checkpointing: the model came with %s; training with %s, as `%s` in the config says.",
            _describe_checkpointing(found), _describe_checkpointing(configured), CHECKPOINTING_ARG,
        )  # fmt: skip
        set_checkpointing(model, configured)


def _describe_checkpointing(mode: bool | str) -> str:
    return {False: "it off", "reentrant": "it on (reentrant)", True: "it on (non-reentrant)"}[mode]
