"""The installed transformers' spelling of the APIs it renamed, found by feature detection.

transformers 5.2x renamed two things the package uses, keeping the old names as deprecated aliases (removed in
5.40 / v6):
- a model forward's `past_key_values=` is now `cache=`;
- gradient checkpointing is now *activation* checkpointing: `activation_checkpointing_enable` / `_disable` /
  `is_activation_checkpointing` on models, `activation_checkpointing` / `activation_checkpointing_kwargs` in
  `TrainingArguments`.

Every call of these goes through this module. Each helper asks the installed library what it has (a parameter in a
signature, an attribute, a dataclass field), never its version string, so the same code runs on the floors in
setup.cfg (transformers 5.17, which knows only the old names) and on the newest release, and warns on neither.
`tests/conftest.py` fails any test in which package code calls a deprecated third-party API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from .families import core_model

__all__ = [
    "CHECKPOINTING_ARG",
    "CHECKPOINTING_KWARGS_ARG",
    "cache_kwarg",
    "check_trl_device_support",
    "checkpointing_from_args",
    "checkpointing_settings",
    "disable_checkpointing",
    "enable_checkpointing",
    "is_checkpointing",
    "quiet_third_party_checkpointing_deprecations",
]


def _training_args_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


# `TrainingArguments`' name for the checkpointing switch and its kwargs: the new names where they exist.
CHECKPOINTING_ARG = (
    "activation_checkpointing" if "activation_checkpointing" in _training_args_fields() else "gradient_checkpointing"
)
CHECKPOINTING_KWARGS_ARG = f"{CHECKPOINTING_ARG}_kwargs"


def checkpointing_settings(enabled: bool, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for a `TrainingArguments` / `VLMGRPOConfig` that set checkpointing, in this install's names.

    >>> checkpointing_settings(False)[CHECKPOINTING_ARG]
    False
    """
    settings: dict[str, Any] = {CHECKPOINTING_ARG: enabled}
    if kwargs is not None:
        settings[CHECKPOINTING_KWARGS_ARG] = kwargs
    return settings


def checkpointing_from_args(args: Any) -> tuple[bool, dict[str, Any]]:
    """`(enabled, kwargs)` of a `TrainingArguments`' checkpointing, read under the name this install uses."""
    return bool(getattr(args, CHECKPOINTING_ARG)), dict(getattr(args, CHECKPOINTING_KWARGS_ARG) or {})


@functools.cache
def _forward_cache_kwarg(model_class: type) -> str:
    # `inspect.signature` follows the deprecation decorator's `functools.wraps` to the real forward.
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwarg(model: nn.Module) -> str:
    """The name under which `model`'s forward takes a KV cache: `cache` (transformers >= 5.2x) or `past_key_values`.

    Asked per model class: a remote-code model may keep the old name after transformers' own ones moved.
    """
    # Asked of the transformers model: PEFT's wrapper forward takes `**kwargs`, which hides the signature.
    return _forward_cache_kwarg(type(core_model(model)))


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on in any layer of `model` (PEFT-wrapped or not).

    Read from the layers' own flag, which every transformers version sets, so no renamed property is touched.
    """
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def enable_checkpointing(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Switch activation checkpointing on with `torch.utils.checkpoint` kwargs (e.g. `{"use_reentrant": False}`)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.2x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: nn.Module) -> None:
    """Switch activation checkpointing off (a no-op when it is off)."""
    if not is_checkpointing(model):
        return
    disable = getattr(model, "activation_checkpointing_disable", None)
    if disable is not None:
        disable()
    else:  # transformers < 5.2x
        model.gradient_checkpointing_disable()


# transformers' deprecated checkpointing aliases as other libraries still call them: TRL (1.15-1.16) every step, in
# `trl.models.utils.disable_gradient_checkpointing` and `_unwrap_model_for_generation`; PEFT (0.21) once, in
# `PeftModel.__init__`. Theirs to fix, not ours; these exact messages only, so any other deprecation still shows (and
# the test suite fails on any call of ours, whatever filter is active).
_THIRD_PARTY_CHECKPOINTING_DEPRECATIONS = (
    r"`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))` is deprecated"
)


@contextlib.contextmanager
def quiet_third_party_checkpointing_deprecations() -> Iterator[None]:
    """Inside the block, hide transformers' FutureWarnings about the checkpointing aliases TRL and PEFT still call.

    Wraps only our calls into TRL's step and PEFT's `get_peft_model`, so a user is not told to change code that is not
    theirs (or ours).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_THIRD_PARTY_CHECKPOINTING_DEPRECATIONS, category=FutureWarning)
        yield


def _cpu_packed_4bit(model: Any) -> bool:
    """Whether a bitsandbytes 4-bit layer of `model` is, or will be at its first inference forward, in the CPU-only
    AVX512-BF16 layout (`support_avx512bf16_for_cpu`, `quant_state.packing_format_for_cpu`, bitsandbytes 0.49)."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            return True
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            return True
    return False


def check_trl_device_support(device: Any, model: Any = None) -> None:
    """Refuse, before the first step, a TRL that cannot compute GRPO log-probs on `device` (a `torch.device`), and
    training a bitsandbytes 4-bit `model` on a CPU that repacks its weights for inference (AVX512-BF16): the matmul in
    that layout fails in training (an in-place bias add on a view, bitsandbytes 0.49)."""
    if device.type == "cpu" and model is not None and _cpu_packed_4bit(model):
        raise RuntimeError(
            "Training this 4-bit (bitsandbytes) model on this CPU fails: on a CPU with AVX512-BF16 bitsandbytes "
            "repacks 4-bit weights into an inference-only layout at the first forward without gradients, and its "
            "matmul in that layout cannot train. Train on a GPU, or load the model in 16/32-bit (load_in_4bit=False)."
        )
    import trl
    from packaging.version import Version

    # TRL 1.15 computes every GRPO log-prob with a Triton kernel (a fused LM head) and has no CPU path: without a
    # GPU the first step dies deep inside TRL. 1.16 added the fallback.
    if device.type == "cpu" and Version(trl.__version__) < Version("1.16"):
        raise RuntimeError(
            f"trl {trl.__version__} can only train GRPO on a GPU (its log-prob kernel needs Triton on CUDA). "
            "Train on a GPU, or upgrade to trl>=1.16 for CPU training."
        )
