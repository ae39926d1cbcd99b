"""Merged 16-bit export of a (possibly quantised) LoRA model, written atomically.

The libraries do the work: PEFT's `get_delta_weight` and `dequantize_module_weight` give each layer's merged
weight, transformers' `save_pretrained` writes the checkpoint; `atomic_directory` makes the write all-or-nothing.
Kept apart from `model.py` because it walks PEFT's module layout: the one place to update when that changes.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

from ..families import core_model
from ..files import follow_umask
from ..third_party_logs import library_bars_off

__all__ = ["atomic_directory", "merged_state_dict", "write_checkpoint"]


def _merged_weight(name: str, module: Any, base: torch.Tensor) -> torch.Tensor:
    """`base` (the layer's dequantised fp32 weight) with each active adapter of the LoRA layer `module` merged in, as
    PEFT's `merge` does: plain LoRA adds its delta; DoRA (linear layers) rescales each output row of `base + delta` to
    its magnitude vector, the norm taken with the unmerged base weight as its forward takes it. Any other variant is
    refused: adding its delta alone would write a model that is not the trained one."""
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.utils.other import transpose

    weight = base
    for adapter in module.active_adapters:
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):  # an Embedding's
            continue
        delta = module.get_delta_weight(adapter).float().to(base.device)
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is None:
            weight = weight + delta
        elif type(variant) is DoraLinearVariant:
            magnitude = module.lora_magnitude_vector[adapter]
            norm = magnitude.get_weight_norm(base, transpose(delta, module.fan_in_fan_out), scaling=1)
            factor = transpose((magnitude.weight.float().to(base.device) / norm).view(-1, 1), module.fan_in_fan_out)
            weight = factor * (weight + delta)
        else:
            raise NotImplementedError(
                f"{name} is a {type(variant).__name__.removesuffix('Variant')} adapter ({adapter}), which "
                "save_pretrained_merged does not merge. Merge it with PEFT on a copy instead: "
                "`copy.deepcopy(model).merge_and_unload().save_pretrained(path)`."
            )
    return weight


def _merged_bias(name: str, module: Any, layer: nn.Module) -> torch.Tensor | None:
    """The base layer's bias with each active adapter's trained bias (`lora_bias=True`) added, as PEFT's `merge`
    adds it; None where the layer has none (refused where an adapter trained one: the checkpoint has no place for
    it)."""
    bias = getattr(layer, "bias", None)
    trained = [a for a in module.active_adapters if getattr(module, "lora_bias", {}).get(a) and a in module.lora_B]
    if bias is None and trained:
        raise NotImplementedError(
            f"{name} trained a bias (lora_bias=True, adapter {trained[0]}) but its base layer has none, so a merged "
            "checkpoint has no place for it. Save the adapter instead (model.save_pretrained(path))."
        )
    if bias is None:
        return None
    bias = bias.float()
    for adapter in module.active_adapters:
        if getattr(module, "lora_bias", {}).get(adapter) and adapter in module.lora_B:
            bias = bias + module.lora_B[adapter].bias.float().to(bias.device) * module.scaling[adapter]
    return bias


def merged_state_dict(model: nn.Module, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """State dict of the base model with every active LoRA delta added to its weight, cast to `dtype`.

    Does not modify `model` (unlike `merge_and_unload`), so training can continue after an export. bitsandbytes
    4-bit / 8-bit weights are dequantised with PEFT's own helper. Tied parameters (one object under two names) map to
    one tensor under both names, so `save_pretrained` keeps the name transformers expects and drops the alias.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.integrations import dequantize_module_weight

    base = core_model(model)
    state: dict[str, torch.Tensor] = {}
    converted: dict[int, torch.Tensor] = {}  # id of a live parameter -> its exported tensor (shared by tied names)
    replaced: set[int] = set()  # live parameters exported as merged / dequantised temporaries instead

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype)

    def put(name: str, tensor: torch.Tensor) -> None:
        # Only live parameters and buffers come here; their ids are stable while the model lives (a temporary's id
        # could be reused once it is freed, so temporaries are stored directly).
        if id(tensor) in replaced:
            return
        if id(tensor) not in converted:
            converted[id(tensor)] = cast(tensor)
        state[name] = converted[id(tensor)]

    skip_prefixes: list[str] = []
    with torch.no_grad():
        for name, module in base.named_modules():
            if any(name.startswith(p) for p in skip_prefixes):
                continue
            prefix = f"{name}." if name else ""
            if isinstance(module, LoraLayer):
                layer = module.get_base_layer()
                weight = _merged_weight(name, module, dequantize_module_weight(layer).float())
                replaced.add(id(layer.weight))
                state[prefix + "weight"] = cast(weight)
                bias = _merged_bias(name, module, layer)
                if bias is not None:
                    replaced.add(id(layer.bias))
                    state[prefix + "bias"] = cast(bias)
                skip_prefixes.append(prefix)
                continue
            if isinstance(module, ModulesToSaveWrapper):
                trained = module.modules_to_save[module.active_adapter]
                # keep_vars: the live tensors (stable ids, see `put`), not detached copies made for this call.
                for pname, param in trained.state_dict(keep_vars=True).items():
                    put(prefix + pname, param)
                skip_prefixes.append(prefix)
                continue
            for pname, param in module.named_parameters(recurse=False):
                if type(param).__name__ in ("Params4bit", "Int8Params"):  # a quantised layer without LoRA
                    replaced.add(id(param))
                    state[prefix + pname] = cast(dequantize_module_weight(module))
                else:
                    put(prefix + pname, param)
            for bname, buffer in module.named_buffers(recurse=False):
                if bname not in module._non_persistent_buffers_set and buffer is not None:
                    put(prefix + bname, buffer)
    return state


class atomic_directory:
    """Context manager: yields a temporary sibling of `path`, renamed onto `path` only on success."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))

    def __enter__(self) -> str:
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.tmp-", dir=parent)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if os.path.exists(self.path):  # keep the previous version until the new one is in place
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.old-", dir=os.path.dirname(self.path))
            os.rmdir(old)
            os.replace(self.path, old)
        follow_umask(self.tmp)  # mkdtemp made it 0700, safetensors its weights 0600
        os.replace(self.tmp, self.path)
        if old:
            shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(
    model: nn.Module,
    processor: Any,
    state_dict: dict[str, torch.Tensor],
    save_directory: str | os.PathLike,
    dtype: torch.dtype,
) -> str:
    """Write `state_dict` as a plain `dtype` transformers checkpoint, atomically; return its absolute path.

    transformers' own `save_pretrained` writes it (sharded safetensors with their index, config, generation config,
    checkpoint-format key names), called on a weightless (meta-device) copy of the base model's class built from a
    copy of its config without `quantization_config`, so neither the config nor a quantiser's state dict describes
    weights that are no longer quantised. `model` is not touched. The processor is saved alongside.
    """
    from accelerate import init_empty_weights

    base = core_model(model)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the merged weights are plain `dtype`
    with init_empty_weights():
        skeleton = type(base)._from_config(config, dtype=dtype)
    if getattr(base, "generation_config", None) is not None:
        skeleton.generation_config = copy.deepcopy(base.generation_config)
    with atomic_directory(save_directory) as tmp, library_bars_off():  # no "Writing model shards" bar
        skeleton.save_pretrained(tmp, state_dict=state_dict, max_shard_size="5GB")
        if processor is not None:
            processor.save_pretrained(tmp)
    return os.path.abspath(os.fspath(save_directory))
