"""Dataset rows -> chat prompts: the `<image>` / `<video>` placeholders, where media go, templates and the system
prompt (which column holds a row's media: `vlm_grpo.media.columns`).

Three paths turn rows into prompts: the trainer's row preparation (`vlm_grpo.data.rows`, any row a user hands
`VLMGRPOTrainer`), loading a user's dataset (`vlm_grpo.data.load`) and the synthetic tasks (`vlm_grpo.cli.task`). They
used to keep their own copies of these rules, and the copies disagreed (which image column wins, whether text around a
placeholder keeps its spaces, where the system prompt goes). The rules live here once:
- `<image>` / `<video>` in a string prompt mark where each image / clip goes (EasyR1 / geometry3k); the text around
  them is kept as written (EasyR1's split); without placeholders the images, then the clips, go before the text, as
  TRL places images;
- a template's `{prompt}` is replaced by the question;
- a system prompt is a first `system` message, unless the prompt already has one, in the content style of the other
  messages (a string, or text blocks).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "apply_template",
    "count_blocks",
    "count_placeholders",
    "place_media",
    "place_placeholders",
    "user_content",
    "with_system",
]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video"}
_SPLIT = re.compile(f"({'|'.join(map(re.escape, _PLACEHOLDERS))})")


def count_placeholders(text: str) -> tuple[int, int]:
    """`(images, videos)`: how many `<image>` and `<video>` placeholders a string prompt has."""
    return text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER)


def user_content(text: str, n_images: int = 0, n_videos: int = 0) -> str | list[dict[str, Any]]:
    """A string prompt as a user message's content: image / video blocks at its `<image>` / `<video>` placeholders
    and text blocks between them, or, without placeholders, `n_images` image blocks then `n_videos` video blocks before
    the text (the string itself when there are none).

    >>> user_content("Find x. <image> Answer in degrees.")
    [{'type': 'text', 'text': 'Find x. '}, {'type': 'image'}, {'type': 'text', 'text': ' Answer in degrees.'}]
    >>> user_content("Which way does it move?", n_videos=1)
    [{'type': 'video'}, {'type': 'text', 'text': 'Which way does it move?'}]
    """
    if not _SPLIT.search(text):
        if not n_images and not n_videos:
            return text
        return [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": text}]
    content: list[dict[str, Any]] = []
    for part in _SPLIT.split(text):
        if part in _PLACEHOLDERS:
            content.append({"type": _PLACEHOLDERS[part]})
        elif part:
            content.append({"type": "text", "text": part})
    return content


def place_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with the `<image>` / `<video>` placeholders written in their string contents turned into blocks
    there (`user_content`), as a string prompt's are; messages without placeholders are returned as they are.

    LLaVA-style conversations mark an image's place with `<image>` in a message's text. Left as text, TRL would put the
    images before the first user message and the model would read a literal `<image>` (and a processor whose image
    token is `<image>` would find one image token too many).

    >>> place_placeholders([{"role": "user", "content": "<image> What is it?"}])
    [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': ' What is it?'}]}]
    """
    return [
        {**m, "content": user_content(m["content"])}
        if isinstance(m, dict) and isinstance(m.get("content"), str) and _SPLIT.search(m["content"])
        else m
        for m in messages
    ]


def count_blocks(messages: Any, kind: str) -> int:
    """How many `{"type": kind}` content blocks (`"image"` or `"video"`) chat messages hold (0 for a string)."""
    if not isinstance(messages, list):
        return 0
    return sum(
        1
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == kind
    )


def place_media(messages: list[dict[str, Any]], images: list[Any], clips: list[Any]) -> list[dict[str, Any]]:
    """`messages` with their image and video blocks filled in order (`{"type": "image", "image": ...}`,
    `{"type": "video", "video": ...}`). Messages whose contents are all strings get the images, then the clips,
    before the first user message's text, as TRL places images. Refuses counts that differ from the blocks'.

    >>> place_media([{"role": "user", "content": "Which way?"}], [], ["clip"])
    [{'role': 'user', 'content': [{'type': 'video', 'video': 'clip'}, {'type': 'text', 'text': 'Which way?'}]}]
    """
    if all(isinstance(m.get("content"), str) for m in messages):
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first is None and (images or clips):
            raise ValueError("the prompt has no user message to put its images / clips in")
        messages = [
            {**m, "content": user_content(m["content"], len(images), len(clips))} if i == first else m
            for i, m in enumerate(messages)
        ]
    for kind, media in (("image", images), ("video", clips)):
        if count_blocks(messages, kind) != len(media):
            raise ValueError(
                f"the prompt has {count_blocks(messages, kind)} {kind} block(s) for {len(media)} {kind}(s)"
            )
    queues = {"image": iter(images), "video": iter(clips)}
    filled = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": part["type"], part["type"]: next(queues[part["type"]])}
                if isinstance(part, dict) and part.get("type") in queues
                else part
                for part in content
            ]
        filled.append({**message, "content": content})
    return filled


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
