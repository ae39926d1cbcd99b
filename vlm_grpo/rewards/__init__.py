"""Verifiable rewards for GRPO on vision-language models, as TRL reward functions.

Every reward is a small per-sample scorer ``(completion_text, gold, /, **row) -> float | None`` in its own module,
made into TRL's ``fn(prompts, completions, **columns) -> list[float | None]`` by :func:`batch_reward`, which owns the
loop, completion-text extraction (string or chat completions), column checks, ``None`` golds and TRL's extra
logging. What each reward pays for is in the README ("Rewards").

TRL's helpers are re-exported rather than rewritten: ``get_soft_overlong_punishment`` and
``get_repetition_penalty_reward`` (they score ``completion_ids``) as they are; ``accuracy_reward`` /
``reasoning_accuracy_reward`` / ``get_cosine_scaled_reward`` (Math-Verify on ``solution``, :mod:`.trl_math`) and
``think_format_reward`` wrapped, so that plain-string completions work and nothing inside the thinking is graded.

Rewards by name (``resolve_reward("answer_accuracy")``, or an import path ``pkg.mod:fn``) and the gold columns each
reads (``reward_columns``) are in :mod:`vlm_grpo.rewards.registry`.
"""

from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

from .adaptor import (
    THINKING_COLUMN,
    BatchReward,
    Completion,
    RewardFunc,
    Scorer,
    batch_reward,
    completion_text,
    completion_texts,
)
from .anls import anls, anls_score
from .answer_choice import answer_choice, closed_vocabulary, make_answer_choice_reward
from .choice import LETTERS, extract_choice, make_choice_reward, multiple_choice
from .counting import counting, extract_count
from .format import think_answer_format, think_format_reward
from .grounding import FRAMES, box_iou, coordinate_frame_for, iou, iou_threshold, make_iou_reward, parse_box
from .math import answer_accuracy, answers_match, parse_number
from .parsing import answer_span, conclusion, extract_answer, final_segment, opens_thinking, with_opened_thinking
from .registry import FromAnswers, resolve_reward, reward_columns, reward_names
from .trl_math import accuracy_reward, get_cosine_scaled_reward, reasoning_accuracy_reward

__all__ = [
    "FRAMES",
    "LETTERS",
    "THINKING_COLUMN",
    "BatchReward",
    "Completion",
    "FromAnswers",
    "RewardFunc",
    "Scorer",
    "accuracy_reward",
    "anls",
    "anls_score",
    "answer_accuracy",
    "answer_choice",
    "answer_span",
    "answers_match",
    "batch_reward",
    "box_iou",
    "closed_vocabulary",
    "completion_text",
    "completion_texts",
    "conclusion",
    "coordinate_frame_for",
    "counting",
    "extract_answer",
    "extract_choice",
    "extract_count",
    "final_segment",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "iou",
    "iou_threshold",
    "make_answer_choice_reward",
    "make_choice_reward",
    "make_iou_reward",
    "multiple_choice",
    "opens_thinking",
    "parse_box",
    "parse_number",
    "reasoning_accuracy_reward",
    "resolve_reward",
    "reward_columns",
    "reward_names",
    "think_answer_format",
    "think_format_reward",
    "with_opened_thinking",
]
