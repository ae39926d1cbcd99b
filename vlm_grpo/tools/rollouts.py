"""What `VLMGRPOTrainer` fixes on TRL's tool-calling path.

TRL 1.16's `_tokenize_prompts` renders prompts with `apply_chat_template(tokenize=True)` and no `return_tensors`, so a
processor hands back numpy arrays (`pixel_values`, `image_grid_thw`); with an `environment_factory` each prompt is
rendered alone and those arrays are flattened into Python lists of rows. Single-turn generation copes
(`torch.tensor(np.array(v))`), but as soon as a completion calls a tool, `_tool_call_loop` splits the image fields per
row with `split_pixel_values_by_grid`, which takes tensors: `TypeError: 'int' object is not callable` (numpy's `.size`)
or `AttributeError: 'list' object has no attribute 'prod'`. Any tool, text-only ones included, with image prompts:
plain TRL crashes too. `fields_as_tensors` turns them into the tensors TRL's batched call would give (per-token fields,
lists of id lists, stay lists: the loop pads those itself).

A tool call that does not parse (broken JSON inside `<tool_call>`) is not a call to TRL: `parse_response` falls back to
plain text, nothing runs, nothing is returned to the model, and neither `tools/call_frequency` nor
`tools/failure_frequency` counts it, so a model writing broken calls looks like one that never calls. `log_malformed_calls`
logs them as `tools/malformed_frequency`: assistant turns that open a tool call (the response parser's opening tag) but
hold no parsed call, per rollout.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

__all__ = ["MALFORMED_METRIC", "fields_as_tensors", "log_malformed_calls", "tool_call_opening"]

logger = logging.getLogger(__name__)

MALFORMED_METRIC = "tools/malformed_frequency"
# The literal start of a regular expression: the text before its first special character.
_LITERAL_START = re.compile(r"[^\\\[\](){}.*+?|^$]+")


def fields_as_tensors(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (a processor's outputs beside the input ids) with numpy arrays, and lists of numpy rows, as tensors.

    >>> out = fields_as_tensors({"pixel_values": [np.zeros(3), np.ones(3)], "mm_token_type_ids": [[0, 1]]})
    >>> out["pixel_values"].shape, out["mm_token_type_ids"]
    (torch.Size([2, 3]), [[0, 1]])
    """
    out = {}
    for key, value in fields.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        elif isinstance(value, list) and value and all(isinstance(row, np.ndarray) for row in value):
            value = torch.from_numpy(np.stack(value))
        out[key] = value
    return out


def tool_call_opening(tokenizer: Any) -> str | None:
    """The text that opens a tool call (`<tool_call>` for Qwen), from the tokenizer's response template (its
    `tool_calls` field's `open`, or the literal start of its `open_pattern`); None where it has none (a legacy
    `response_schema`, or no parser).

    >>> from trl.chat_template_utils import qwen3_5_template
    >>> tool_call_opening(type("Tokenizer", (), {"response_template": qwen3_5_template})())
    '<tool_call>'
    """
    template = getattr(tokenizer, "response_template", None)
    field = template.get("fields", {}).get("tool_calls") if isinstance(template, dict) else None
    if not isinstance(field, dict):
        return None
    if field.get("open"):
        return field["open"]
    start = _LITERAL_START.match(field.get("open_pattern") or "")
    return start.group(0) if start else None


def log_malformed_calls(trainer: Any, completions: list[Any]) -> None:
    """Log `MALFORMED_METRIC` for a batch of tool-calling rollouts (`completions`: TRL's message lists): assistant turns
    whose text opens a tool call that did not parse, per rollout, gathered over processes as TRL's tool metrics are."""
    opening = tool_call_opening(trainer._tokenizer)
    if opening is None:
        if not getattr(trainer, "_malformed_calls_unread", False):
            trainer._malformed_calls_unread = True
            logger.warning("%s is not logged: the tokenizer's response parser names no tool-call opening.",
                           MALFORMED_METRIC)  # fmt: skip
        return
    malformed = sum(
        1
        for messages in completions
        if isinstance(messages, list)
        for m in messages
        if m.get("role") == "assistant" and not m.get("tool_calls") and opening in str(m.get("content") or "")
    )
    device = trainer.accelerator.device
    counts = trainer.accelerator.gather(torch.tensor([malformed, len(completions)], device=device)).view(-1, 2).sum(0)
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][MALFORMED_METRIC].append((counts[0] / counts[1].clamp(min=1)).item())
