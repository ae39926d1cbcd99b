"""Which Linear layers of a vision-language model get LoRA: Unsloth's four `finetune_*` flags.

Light to import (no torch at import time), so the `vlm-grpo` command builds its flags from `LoraSelection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..families import projector_names, vision_tower_names

__all__ = ["LoraSelection", "expert_parameters", "select_lora_modules"]

# Where a module's name says it belongs, matched as substrings of its name's parts: the vision towers and projectors
# of the family records (`vlm_grpo.families`) plus Unsloth's tags, which also catch other VLMs' (`vision_*`,
# `*_projector`).
_VISION_TAGS = (*vision_tower_names(), "vision", "patch_embed")
_PROJECTOR_TAGS = (*projector_names(), "projector")
# Token mixers: attention, linear attention (`linear_attn`) and LFM2's short convolutions (`conv`, Linear in and out).
_ATTENTION_TAGS = ("attn", "attention", "conv")
_MLP_TAGS = ("mlp", "feed_forward", "ffn")
# Modules never given LoRA by the flags: the output head (tied or huge) and the embeddings.
_NEVER = ("lm_head", "embed_tokens", "embed", "wte")


@dataclass(frozen=True)
class LoraSelection:
    """Which Linear layers get LoRA: Unsloth's four `finetune_*` flags, declared once for `get_peft_model`,
    `select_lora_modules` and the `vlm-grpo` command's flags.

    Vision layers are the vision tower's blocks and the projector that maps image features into the
    language model (Qwen's `merger`, Idefics3's `connector`); language layers are the decoder's
    blocks. Attention means the token mixers: q/k/v/o (and fused qkv), linear attention's projections (Qwen3.5) and
    short convolutions' (LFM2); MLP the feed-forward and projector layers (routed experts held in fused 3-D weights:
    `expert_parameters`). The
    output head and embeddings are never selected (use `modules_to_save` for those).
    """

    finetune_vision_layers: bool = field(default=True, metadata={"help": "LoRA on the vision tower and projector."})
    finetune_language_layers: bool = field(default=True, metadata={"help": "LoRA on the language model."})
    finetune_attention_modules: bool = field(default=True, metadata={"help": "LoRA on attention layers (q/k/v/o)."})
    finetune_mlp_modules: bool = field(default=True, metadata={"help": "LoRA on MLP and projector layers."})

    def __post_init__(self) -> None:
        if not (self.finetune_vision_layers or self.finetune_language_layers):
            raise ValueError(
                "finetune_vision_layers and finetune_language_layers are both False, so no layer would train. "
                "Set at least one to True (or pass target_modules)."
            )
        if not (self.finetune_attention_modules or self.finetune_mlp_modules):
            raise ValueError(
                "finetune_attention_modules and finetune_mlp_modules are both False, so no layer would train. "
                "Set at least one to True (or pass target_modules)."
            )

    def modules(self, model: Any) -> list[str]:
        """Names of the Linear layers of `model` this selection covers, in model order."""
        from torch import nn

        selected = []
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):  # bitsandbytes' 4/8-bit layers subclass nn.Linear
                continue
            parts = name.lower().split(".")
            if any(p in _NEVER for p in parts):
                continue
            is_projector = any(tag in p for p in parts for tag in _PROJECTOR_TAGS)
            is_vision = is_projector or any(tag in p for p in parts for tag in _VISION_TAGS)
            is_attention = not is_projector and any(tag in p for p in parts for tag in _ATTENTION_TAGS)
            is_mlp = is_projector or any(tag in p for p in parts for tag in _MLP_TAGS)
            if not (is_attention or is_mlp):
                continue
            if not (self.finetune_vision_layers if is_vision else self.finetune_language_layers):
                continue
            if (is_attention and not self.finetune_attention_modules) or (is_mlp and not self.finetune_mlp_modules):
                continue
            selected.append(name)
        return selected


def expert_parameters(model: Any, selection: LoraSelection) -> list[str]:
    """Names of the language model's fused expert weights the selection covers: mixture-of-experts layers that keep
    every routed expert in one 3-D parameter (Qwen3.5-MoE's `experts.gate_up_proj` / `experts.down_proj`), which
    no Linear layer wraps. They get LoRA through PEFT's `target_parameters` (one adapter per expert)."""
    if not (selection.finetune_language_layers and selection.finetune_mlp_modules):
        return []
    names = []
    for name, param in model.named_parameters():
        parts = name.lower().split(".")
        if param.dim() == 3 and "experts" in parts and not any(tag in p for p in parts for tag in _VISION_TAGS):
            names.append(name)
    return names


def select_lora_modules(model: Any, **flags: bool) -> list[str]:
    """Names of the Linear layers the `finetune_*` flags (`LoraSelection`'s fields, each True by default) select,
    in model order. Raises `ValueError` for a selection that could train nothing."""
    return LoraSelection(**flags).modules(model)
