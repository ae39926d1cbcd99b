"""A saved LoRA adapter loads as a model: `FastVisionModel.from_pretrained("runs/demo/final")` on a folder that
holds `adapter_config.json` (no `config.json`) loads the base model it names, then the adapter on top, trainable, as
Unsloth's `from_pretrained` does. `vlm-grpo --use_peft` writes such a folder as its `final/`.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["adapter_base", "attach_adapter"]


def adapter_base(path: str) -> str | None:
    """The base model a local PEFT adapter folder names (`base_model_name_or_path`), or None when `path` is no
    adapter folder. An adapter that names no base raises ValueError: there is nothing to put it on."""
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")) or not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as file:
        base = json.load(file).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path!r} holds a LoRA adapter that names no base model (base_model_name_or_path); load "
                         "its base with from_pretrained, then peft.PeftModel.from_pretrained(model, path).")  # fmt: skip
    return base


def attach_adapter(model: Any, path: str, use_gradient_checkpointing: bool | str) -> Any:
    """`model` with the adapter saved in `path`, trainable, set up for training as `get_peft_model` sets up a new
    one (checkpointing, the requires-grad hooks)."""
    from peft import PeftModel

    from ..compat import quiet_third_party_checkpointing_deprecations
    from .modes import for_training

    with quiet_third_party_checkpointing_deprecations():
        peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
    if hasattr(model, "_vlm_grpo_processor"):
        object.__setattr__(peft_model, "_vlm_grpo_processor", model._vlm_grpo_processor)
    for_training(peft_model, use_gradient_checkpointing)
    return peft_model
