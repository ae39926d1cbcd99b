"""The model card TRL writes to `output_dir/README.md`, completed for a vision-language model.

TRL names the base model only when it is a Hub id: a model loaded from a local folder (a tiny model built in code, a
checkpoint of one's own) gave "a fine-tuned version of [None](https://huggingface.co/None)". Its quick-start snippet
asks a text-generation pipeline an unrelated question ("If you had a time machine...") of `model="None"` without
`hub_model_id`. This names the local base model, and writes a quick start for the image-text-to-text pipeline that asks
a question of the kind the model was trained on (the first training prompt's) about an image, of the folder that holds
the model: `model_dir` (the `vlm-grpo` command's `final/`), else the checkpoint being saved; a Hub base model's line is
TRL's, untouched.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["complete_model_card"]

_NO_BASE = "[None](https://huggingface.co/None)"
_QUICK_START = re.compile(r"(## Quick start\n\n```python\n).*?(```)", re.DOTALL)
_SNIPPET = """from transformers import pipeline

question = {question!r}
generator = pipeline("image-text-to-text", model="{model}", device_map="auto")
image = "path/or/url/of/an/image.png"  # an image like those it was trained on
messages = [{{"role": "user", "content": [{{"type": "image", "url": image}}, {{"type": "text", "text": question}}]}}]
output = generator(text=messages, max_new_tokens=128, return_full_text=False)[0]
print(output["generated_text"])
"""


def _first_question(trainer: Any) -> str:
    """The text of the first training prompt (its last user message), or a generic question without one."""
    dataset = getattr(trainer, "train_dataset", None)
    try:
        prompt = dataset.select_columns(["prompt"])[0]["prompt"]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # no dataset, or one without prompts
        return "Describe the image."
    if isinstance(prompt, list):  # chat messages: the last user message's text
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"] or [{}]
        content = users[-1].get("content") or ""
        prompt = content if isinstance(content, str) else " ".join(b.get("text") or "" for b in content)
    return " ".join(str(prompt).replace("<image>", " ").split()) or "Describe the image."


def complete_model_card(trainer: Any, model_dir: str | None = None) -> None:
    """Rewrite the card TRL's `create_model_card` just wrote for `trainer` (main process only; nothing if absent);
    its quick start loads `model_dir`, else the checkpoint being saved (`output_dir/checkpoint-<step>`)."""
    if not trainer.is_world_process_zero():
        return
    path = os.path.join(trainer.args.output_dir, "README.md")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as file:
        card = file.read()
    base = getattr(getattr(trainer.model, "config", None), "_name_or_path", "") or ""
    card = card.replace(_NO_BASE, f"`{base}` (a local model)" if base else "a model built in code")
    if trainer.hub_model_id is not None:
        model = trainer.hub_model_id
    else:  # TRL writes the card just before the checkpoint it describes
        model = model_dir or os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")
    snippet = _SNIPPET.format(question=_first_question(trainer), model=model)
    card = _QUICK_START.sub(lambda match: match[1] + snippet + match[2], card, count=1)
    with open(path, "w", encoding="utf-8") as file:
        file.write(card)
