"""TRL's Math-Verify rewards, reading a completion as every other reward here does.

TRL's ``accuracy_reward`` and ``get_cosine_scaled_reward`` read the whole completion with Math-Verify's first match, so
a ``\\boxed{7}`` inside the thinking paid for gold 7, also in a completion cut off while reasoning; and all three take
chat completions only (a plain string raised ``TypeError``). Here each gets the completion's text as one chat message,
with the ``<think>`` a chat template opened in the prompt put back (`adaptor.THINKING_COLUMN`); ``accuracy_reward`` and
the cosine reward get its :func:`~vlm_grpo.rewards.parsing.conclusion` ("" when cut off while thinking), and
``reasoning_accuracy_reward``, which splits at ``</think>`` itself, the whole text. Grading stays TRL's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trl.rewards import accuracy_reward as _trl_accuracy_reward
from trl.rewards import get_cosine_scaled_reward as _trl_get_cosine_scaled_reward
from trl.rewards import reasoning_accuracy_reward as _trl_reasoning_accuracy_reward

from .adaptor import Completion, completion_texts
from .parsing import conclusion

__all__ = ["accuracy_reward", "get_cosine_scaled_reward", "reasoning_accuracy_reward"]


def _as_chat(completions: Sequence[Completion], columns: dict[str, Any], whole: bool = False) -> list[list[dict]]:
    texts = completion_texts(completions, columns)
    return [[{"role": "assistant", "content": text if whole else conclusion(text)}] for text in texts]


def accuracy_reward(completions: Sequence[Completion], solution: Sequence[str], **kwargs: Any) -> list[float | None]:
    """TRL's ``accuracy_reward`` (Math-Verify against column ``solution``; None where the gold does not parse) on the
    completion's conclusion: nothing inside ``<think>…</think>`` is read, and a completion cut off while thinking
    scores 0."""
    return _trl_accuracy_reward(_as_chat(completions, kwargs), solution, **kwargs)


def reasoning_accuracy_reward(
    completions: Sequence[Completion], solution: Sequence[str], **kwargs: Any
) -> list[float | None]:
    """TRL's ``reasoning_accuracy_reward`` (the answer after the last ``</think>``, 0 where the reasoning never closed),
    for plain-string completions too and with the ``<think>`` a prompt opened put back."""
    return _trl_reasoning_accuracy_reward(_as_chat(completions, kwargs, whole=True), solution, **kwargs)


class _CosineScaledReward:
    """TRL's cosine-scaled reward on the completion's conclusion (a class, so that the reward pickles)."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, trl_reward: Any) -> None:
        self.trl_reward = trl_reward

    def __call__(
        self,
        completions: Sequence[Completion],
        solution: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        **kwargs: Any,
    ) -> list[float | None]:
        return self.trl_reward(_as_chat(completions, kwargs), solution, completion_ids, **kwargs)


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> _CosineScaledReward:
    """TRL's ``get_cosine_scaled_reward`` (correctness by Math-Verify, scaled by the completion's length in tokens over
    ``max_len``), whose correctness reads the completion's conclusion as :func:`accuracy_reward` does."""
    trl_reward = _trl_get_cosine_scaled_reward(max_len, min_value_wrong, max_value_wrong, min_value_correct,
                                               max_value_correct)  # fmt: skip
    return _CosineScaledReward(trl_reward)
