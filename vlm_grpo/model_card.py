"""The model card TRL writes to `output_dir/README.md`, completed for a vision-language model.

TRL names the base model only when it is a Hub id: a model loaded from a local folder (a tiny model built in code, a
checkpoint of one's own) gave "a fine-tuned version of [None](https://huggingface.co/None)". Its quick-start snippet
uses the text-generation pipeline and, without `hub_model_id`, `model="None"`. This names the local base model, the
image-text-to-text pipeline and the output folder instead; a Hub base model's line is TRL's, untouched.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["complete_model_card"]

_NO_BASE = "[None](https://huggingface.co/None)"


def complete_model_card(trainer: Any) -> None:
    """Rewrite the card TRL's `create_model_card` just wrote for `trainer` (main process only; nothing if absent)."""
    if not trainer.is_world_process_zero():
        return
    path = os.path.join(trainer.args.output_dir, "README.md")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as file:
        card = file.read()
    base = getattr(getattr(trainer.model, "config", None), "_name_or_path", "") or ""
    card = card.replace(_NO_BASE, f"`{base}` (a local model)" if base else "a model built in code")
    card = card.replace('pipeline("text-generation"', 'pipeline("image-text-to-text"')
    if trainer.hub_model_id is None:
        card = card.replace('model="None"', f'model="{trainer.args.output_dir}"')
    with open(path, "w", encoding="utf-8") as file:
        file.write(card)
