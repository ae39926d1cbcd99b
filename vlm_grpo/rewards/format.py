"""Format rewards: pay for the output layout, not for the answer."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from trl.rewards import think_format_reward as _trl_think_format_reward

from .adaptor import Completion, batch_reward, completion_texts

__all__ = ["think_answer_format", "think_format_reward"]

# Tempered bodies forbid nested/repeated tags, so "<think>a</think><answer>b</answer><answer>c</answer>" (two answers),
# a second <think> block or an <answer> inside the thinking cannot sneak through a lazy ".*?"; an empty answer is no
# answer (the layout alone would be paid for saying nothing), empty thinking is allowed (as TRL's format reward does).
_THINK_ANSWER_RE = re.compile(
    r"\s*<think>(?:(?!</?(?:think|answer)>).)*</think>\s*<answer>(?!\s*</answer>)(?:(?!</?answer>).)*</answer>\s*",
    re.DOTALL,
)


@batch_reward(gold_column=None)
def think_answer_format(text: str, gold: None = None, /, **row: Any) -> float:
    """1.0 when the whole completion (surrounding whitespace allowed) is exactly one ``<think>…</think>`` block
    followed by exactly one non-empty ``<answer>…</answer>`` block, else 0.0. Reads no dataset column."""
    return 1.0 if _THINK_ANSWER_RE.fullmatch(text) else 0.0


def think_format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float]:
    """TRL's ``think_format_reward`` (1.0 when the completion starts with one ``<think>…</think>`` block), for string
    completions as well as chat ones: TRL's own indexes ``completion[0]["content"]`` and raises ``TypeError`` on a
    plain string; and a completion whose prompt opened the ``<think>`` (`adaptor.THINKING_COLUMN`) read with it."""
    as_chat = [[{"role": "assistant", "content": text}] for text in completion_texts(completions, kwargs)]
    return _trl_think_format_reward(as_chat, **kwargs)
