"""Dataset rows -> chat prompts: the image columns, the `<image>` placeholder, templates and the system prompt.

Three paths turn rows into prompts: the trainer's row preparation (`vlm_grpo.rows`, any row a user hands
`VLMGRPOTrainer`), loading a user's dataset (`vlm_grpo.data.load`) and the synthetic tasks (`vlm_grpo.task`). They
used to keep their own copies of these rules, and the copies disagreed (which image column wins, whether text around a
placeholder keeps its spaces, where the system prompt goes). The rules live here once:
- a row's images are in `image` (one) or `images` (a list); a dataset with both is refused, as either could be meant;
- `<image>` in a string prompt marks where each image goes (EasyR1 / geometry3k); the text around it is kept as
  written (EasyR1's split); without a placeholder the images go before the text, as TRL places them;
- a template's `{prompt}` is replaced by the question;
- a system prompt is a first `system` message, unless the prompt already has one, in the content style of the other
  messages (a string, or text blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "IMAGE_COLUMNS",
    "IMAGE_PLACEHOLDER",
    "apply_template",
    "image_column",
    "user_content",
    "with_system",
]

IMAGE_COLUMNS = ("image", "images")
IMAGE_PLACEHOLDER = "<image>"


def image_column(columns: Iterable[str]) -> str | None:
    """The column holding a row's images (`image` or `images`), None without one; both present is refused.

    >>> image_column(["prompt", "images", "answer"])
    'images'
    """
    found = [c for c in IMAGE_COLUMNS if c in set(columns)]
    if len(found) > 1:
        raise ValueError(
            "The rows have both an `image` and an `images` column, and either could be the one meant. Keep one "
            "(rename or remove the other)."
        )
    return found[0] if found else None


def user_content(text: str, n_images: int = 0) -> str | list[dict[str, Any]]:
    """A string prompt as a user message's content: image blocks at its `<image>` placeholders and text blocks
    between them, or, without a placeholder, `n_images` image blocks before the text (the string itself when none).

    >>> user_content("Find x. <image> Answer in degrees.")
    [{'type': 'text', 'text': 'Find x. '}, {'type': 'image'}, {'type': 'text', 'text': ' Answer in degrees.'}]
    """
    if IMAGE_PLACEHOLDER not in text:
        if not n_images:
            return text
        return [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    content: list[dict[str, Any]] = []
    for i, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            content.append({"type": "image"})
        if part:
            content.append({"type": "text", "text": part})
    return content


def apply_template(text: str, template: str | None) -> str:
    """`template` with `{prompt}` replaced by `text` (the text itself without a template)."""
    return template.replace("{prompt}", text) if template else text


def with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """`messages` with `system_prompt` as a first system message (unchanged when empty or one is already there)."""
    if not system_prompt or (messages and messages[0].get("role") == "system"):
        return messages
    structured = any(isinstance(m.get("content"), list) for m in messages)
    content = [{"type": "text", "text": system_prompt}] if structured else system_prompt
    return [{"role": "system", "content": content}, *messages]
