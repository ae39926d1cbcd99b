"""Which prompts leave the model inside its reasoning, told to the rewards as a column.

Some chat templates open the thinking in the generation prompt: Qwen3.5's thinking variant, Qwen3-VL-Thinking and
DeepSeek-R1's distills end it with ``<think>``, so the model's completion starts inside its reasoning and carries only
the closing ``</think>``. The rewards read the answer in the conclusion, after ``</think>``
(`vlm_grpo.rewards.parsing.conclusion`); a completion with no tag at all reads as one with no reasoning. Under such a
template a completion cut off while reasoning has no tag, so it was graded on its whole text, and a number named while
thinking was paid for; `think_answer_format` paid nothing for any completion, since the opening tag is in the prompt.

The prompt the model was given decides it: the tail of each row's prompt ids, decoded as the tokenizer writes them
(special tokens kept), ends with ``<think>`` or not. The trainer reads them from the rollout's prompt ids (every
generation path returns them: the fast engine's, TRL's, vLLM's) and `evaluate` from its own. Each row then carries
`THINKING_COLUMN`, which the package's rewards read (`vlm_grpo.rewards.adaptor.completion_texts`) and any other reward
function may.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..rewards.adaptor import THINKING_COLUMN
from ..rewards.parsing import opens_thinking

__all__ = ["THINKING_COLUMN", "mark_thinking", "prompts_open_thinking"]

# Enough tokens to hold a generation prompt's end ("<|im_start|>assistant\n<think>\n" is 4-5 tokens).
_TAIL_TOKENS = 16


def prompts_open_thinking(processing_class: Any, prompt_ids: Sequence[Any]) -> list[bool]:
    """For each prompt (a list or tensor of token ids, left padding allowed), whether it ends with an opened
    ``<think>`` (`rewards.parsing.opens_thinking`). Each distinct prompt end is decoded once."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    tails = [
        tuple(int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)[-_TAIL_TOKENS:]) for ids in prompt_ids
    ]
    distinct = list(dict.fromkeys(tails))
    texts = tokenizer.batch_decode([list(tail) for tail in distinct], skip_special_tokens=False)
    opened = {tail: opens_thinking(text) for tail, text in zip(distinct, texts, strict=True)}
    return [opened[tail] for tail in tails]


def mark_thinking(rows: list[dict[str, Any]], opened: Sequence[bool]) -> list[dict[str, Any]]:
    """Copies of `rows`, each with `THINKING_COLUMN` set to its prompt's flag (one per row, as rewards get them)."""
    if len(opened) != len(rows):
        raise RuntimeError(f"{len(rows)} rows reached the rewards but {len(opened)} prompts were generated from; they "
                           "must align (a vlm_grpo bug: please report it).")  # fmt: skip
    return [{**row, THINKING_COLUMN: bool(flag)} for row, flag in zip(rows, opened, strict=True)]
