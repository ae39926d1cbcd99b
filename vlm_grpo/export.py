"""Merged 16-bit export of a (possibly quantised) LoRA model, written atomically.

Kept apart from `model.py` because it walks PEFT and bitsandbytes internals: the one place to
update when those libraries change their layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

__all__ = ["atomic_directory", "merged_state_dict", "write_checkpoint"]


def _dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The full-precision weight of a Linear, undoing bitsandbytes 4-bit / 8-bit quantisation."""
    weight = layer.weight
    cls = type(weight).__name__
    if cls == "Params4bit":
        import bitsandbytes.functional as F

        return F.dequantize_4bit(weight.data, weight.quant_state).reshape(layer.out_features, layer.in_features)
    if cls == "Int8Params":
        scale = getattr(weight, "SCB", None)
        if scale is None:  # not `or`: a tensor has no truth value
            scale = layer.state.SCB
        return weight.data.float() * scale.float().unsqueeze(1) / 127.0
    return weight.data


def merged_state_dict(model: nn.Module, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """State dict of the base model with every active LoRA delta added to its weight, cast to `dtype`.

    Does not modify `model` (unlike `merge_and_unload`), so training can continue after an export.
    Tied weights are stored once (the first name wins, as transformers re-ties them on load).
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def put(name: str, tensor: torch.Tensor, shared: bool = True) -> None:
        # Tied parameters are the same object under two names; ids are only compared for live parameters
        # (`shared`), never for temporaries, whose ids Python reuses once they are freed.
        if shared:
            if id(tensor) in seen:
                return
            seen.add(id(tensor))
        state[name] = tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype)

    skip_prefixes: list[str] = []
    with torch.no_grad():
        for name, module in base.named_modules():
            if any(name.startswith(p) for p in skip_prefixes):
                continue
            prefix = f"{name}." if name else ""
            if isinstance(module, LoraLayer):
                layer = module.get_base_layer()
                weight = _dequantized_weight(layer).float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).float().to(weight.device)
                seen.add(id(layer.weight))
                put(prefix + "weight", weight, shared=False)
                if getattr(layer, "bias", None) is not None:
                    put(prefix + "bias", layer.bias)
                skip_prefixes.append(prefix)
                continue
            if isinstance(module, ModulesToSaveWrapper):
                trained = module.modules_to_save[module.active_adapter]
                for pname, param in trained.state_dict().items():
                    put(prefix + pname, param)
                skip_prefixes.append(prefix)
                continue
            for pname, param in module.named_parameters(recurse=False):
                if type(param).__name__ in ("Params4bit", "Int8Params"):
                    seen.add(id(param))
                    put(prefix + pname, _dequantized_weight(module), shared=False)
                else:
                    put(prefix + pname, param)
            for bname, buffer in module.named_buffers(recurse=False):
                if bname not in module._non_persistent_buffers_set and buffer is not None:
                    put(prefix + bname, buffer)
    return state


def _follow_umask(root: str) -> None:
    """Give `root` and everything in it the modes a plain `mkdir` / `open` would have under the current umask.

    `tempfile.mkdtemp` makes the directory 0700 and safetensors writes weights 0600; renamed into place as they
    are, checkpoints would be private whatever the user's umask says.
    """
    umask = os.umask(0)
    os.umask(umask)
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o777 & ~umask)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~umask)


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
        _follow_umask(self.tmp)
        os.replace(self.tmp, self.path)
        if old:
            shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(
    model: nn.Module, processor: Any, state_dict: dict[str, torch.Tensor], save_directory: str | os.PathLike,
    dtype: torch.dtype,
) -> str:
    """Write `state_dict` as a plain transformers checkpoint (sharded safetensors, config, processor)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from peft import PeftModel
    from safetensors.torch import save_file

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    with atomic_directory(save_directory) as tmp:
        shards = split_torch_state_dict_into_shards(state_dict, max_shard_size="5GB")
        for filename, names in shards.filename_to_tensors.items():
            save_file({n: state_dict[n].contiguous() for n in names}, os.path.join(tmp, filename), metadata={"format": "pt"})
        if shards.is_sharded:
            index = {"metadata": shards.metadata, "weight_map": shards.tensor_to_filename}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config = base.config.to_dict()
        config.pop("quantization_config", None)  # the merged weights are plain 16-bit
        config["dtype"] = str(dtype).removeprefix("torch.")
        config["architectures"] = [type(base).__name__]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
    return os.path.abspath(os.fspath(save_directory))
