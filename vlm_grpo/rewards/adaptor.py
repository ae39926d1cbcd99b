"""One adaptor from per-sample scorers to TRL batch reward functions.

A scorer scores one completion: ``scorer(text, gold, /, **row) -> float | None``, where ``text`` is the generated text,
``gold`` the row's value of the gold column and ``row`` the row's other columns (``prompt``, ``image_size``, ...).
:func:`batch_reward` turns it into TRL's ``fn(prompts, completions, **columns) -> list[float | None]`` and owns
everything around the scorer: the loop, completion-text extraction (string or chat completions), the column checks,
``None`` golds (-> ``None``, which TRL leaves out of that reward), the ``<think>`` a chat template opened in the prompt
(the trainer's ``prompt_opens_thinking`` column) and the parsed predictions shown in TRL's completions table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .parsing import with_opened_thinking

__all__ = ["THINKING_COLUMN", "BatchReward", "Completion", "RewardFunc", "Scorer", "batch_reward", "completion_text",
           "completion_texts"]  # fmt: skip

#: The column `VLMGRPOTrainer` (and `evaluate`) add to every row: True where the rendered prompt ended with an opened
#: ``<think>`` (`parsing.opens_thinking`), so the completion starts inside the model's reasoning.
THINKING_COLUMN = "prompt_opens_thinking"

#: One completion as TRL passes it: a plain string, or a list of chat messages.
Completion = str | Sequence[Mapping[str, Any]]
#: A TRL-compatible reward function.
RewardFunc = Callable[..., list[float | None]]
#: A per-sample scorer ``(completion_text, gold, **row) -> float | None``.
Scorer = Callable[..., float | None]


def _content_text(content: Any) -> str:
    """Text of one message's ``content``: a string, ``None`` or a list of typed blocks (images are skipped)."""
    if content is None:  # e.g. an assistant turn that only carries tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, Mapping) and block.get("type", "text") == "text":
                parts.append(str(block.get("text") or ""))
        return "".join(parts)
    raise TypeError(f"Unsupported message content type: {type(content).__name__}")


def completion_text(completion: Completion | Mapping[str, Any]) -> str:
    """Return the generated text of one completion, whatever format TRL passed it in.

    Args:
        completion: A string; a single message dict; or a list of message dicts (conversational format) whose
            ``content`` is a string, ``None``, or a list of ``{"type": "text", "text": ...}`` blocks.

    Returns:
        The text. For a message list, the assistant messages (a message without ``role`` counts as assistant)
        joined with newlines, so a multi-turn tool-use completion is scored on what the model wrote, not on tool
        outputs.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        return "\n".join(
            _content_text(message.get("content"))
            for message in completion
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant"
        )
    raise TypeError(f"Unsupported completion type: {type(completion).__name__}")


def completion_texts(completions: Sequence[Completion], columns: Mapping[str, Any]) -> list[str]:
    """Each completion's text (:func:`completion_text`), with the ``<think>`` its prompt opened in front where the
    `THINKING_COLUMN` column says so: a completion cut off while reasoning then reads as one (no conclusion), and a
    ``reasoning</think><answer>…`` one has its think block whole."""
    texts = [completion_text(c) for c in completions]
    opened = columns.get(THINKING_COLUMN)
    if opened is None:
        return texts
    opened = _aligned(THINKING_COLUMN, opened, len(texts))
    return [with_opened_thinking(t) if o else t for t, o in zip(texts, opened, strict=True)]


def _aligned(name: str, values: Any, n: int) -> list[Any]:
    """A column as a list, checked to hold one value per completion (else rewards pair with the wrong golds)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        # ValueError, like every other malformed-column error: the fix is in the dataset, not in the code.
        raise ValueError(f"Column `{name}` must be a list with one value per completion, got {type(values).__name__}.")  # noqa: TRY004
    if len(values) != n:
        raise ValueError(f"Column `{name}` has {len(values)} values but there are {n} completions; they must align.")
    return list(values)


class BatchReward:
    """A TRL reward function made from a per-sample scorer (see :func:`batch_reward`).

    A class rather than a closure because TRL's async rollout worker pickles reward functions.
    """

    def __init__(
        self,
        scorer: Scorer,
        gold_column: str | Sequence[str] | None = "answer",
        *,
        name: str | None = None,
        columns: Sequence[str] = (),
        prediction: Callable[..., Any] | None = None,
    ) -> None:
        self.scorer = scorer
        self.gold_columns = (gold_column,) if isinstance(gold_column, str) else tuple(gold_column or ())
        self.columns = tuple(columns)
        self.prediction = prediction
        self.__name__ = self.__qualname__ = name or getattr(scorer, "__name__", type(scorer).__name__)
        self.__module__ = getattr(scorer, "__module__", __name__)
        self.__doc__ = getattr(scorer, "__doc__", None)

    def __repr__(self) -> str:
        return f"<reward {self.__name__} (gold column {'/'.join(self.gold_columns) or 'none'})>"

    def __reduce__(self) -> str | tuple:
        # A decorated module-level scorer is pickled by reference (its name now points at this object).
        if getattr(sys.modules.get(self.__module__), self.__qualname__, None) is self:
            return self.__qualname__
        return (_rebuild, (self.scorer, self.gold_columns, self.__name__, self.columns, self.prediction))

    def _gold_column(self, columns: Mapping[str, Any]) -> str | None:
        if not self.gold_columns:
            return None
        for name in self.gold_columns:
            if name in columns:
                return name
        wanted = " or ".join(f"`{c}`" for c in self.gold_columns)
        raise ValueError(
            f"`{self.__name__}` needs a dataset column named {wanted}, but none was passed "
            f"(columns: {sorted(k for k in columns if k not in _TRL_EXTRAS)})."
        )

    def __call__(
        self, prompts: Sequence[Any] | None, completions: Sequence[Completion], **columns: Any
    ) -> list[float | None]:
        n = len(completions)
        gold_name = self._gold_column(columns)
        golds = _aligned(gold_name, columns[gold_name], n) if gold_name else [None] * n
        for name in self.columns:  # declared optional columns must align when present
            if name in columns:
                _aligned(name, columns[name], n)
        # Every other per-row column reaches the scorer; scalars (trainer_state) and callables (log_extra) do not.
        per_row = {
            k: list(v)
            for k, v in columns.items()
            if k != gold_name
            and k not in _TRL_EXTRAS
            and isinstance(v, Sequence)
            and not isinstance(v, str)
            and len(v) == n
        }
        if prompts is not None and len(prompts) == n:
            per_row["prompt"] = list(prompts)
        texts = completion_texts(completions, columns)
        rewards: list[float | None] = []
        for i, (text, gold) in enumerate(zip(texts, golds, strict=True)):
            row = {k: v[i] for k, v in per_row.items()}
            if gold_name is not None and gold is None:
                rewards.append(None)  # the reward does not apply to this row
                continue
            value = self.scorer(text, gold, **row)
            rewards.append(None if value is None else float(value))
        log_extra = columns.get("log_extra")
        if callable(log_extra) and self.prediction is not None:
            preds = [self.prediction(t) for t in texts]
            log_extra(f"{self.__name__}_pred", ["" if p is None else str(p) for p in preds])
        return rewards


# Keyword arguments TRL passes besides dataset columns; never handed to scorers.
# (And the trainer's `THINKING_COLUMN`, read by `completion_texts`.)
_TRL_EXTRAS = frozenset({"trainer_state", "log_extra", "log_metric", "completion_ids", "environments", THINKING_COLUMN})


def _rebuild(scorer: Scorer, gold_columns: tuple[str, ...], name: str, columns: tuple[str, ...], prediction: Any):
    return BatchReward(scorer, gold_columns, name=name, columns=columns, prediction=prediction)


def batch_reward(
    gold_column: str | Sequence[str] | None = "answer",
    *,
    name: str | None = None,
    columns: Sequence[str] = (),
    prediction: Callable[..., Any] | None = None,
) -> Callable[[Scorer], BatchReward]:
    """Decorator: turn a per-sample scorer into a TRL reward function.

    Args:
        gold_column: The dataset column holding the gold answer (a tuple: the first one present), or None for a
            reward that reads no gold (format rewards; the scorer then gets ``gold=None``). A missing column raises
            ``ValueError`` naming it; a row whose gold is ``None`` scores ``None`` without calling the scorer.
        name: The reward's name in TRL's logs (default: the scorer's ``__name__``).
        columns: Optional columns the scorer reads; when present they must hold one value per completion.
        prediction: ``(text) -> Any``, the parsed prediction shown as ``<name>_pred`` in TRL's completions
            table (only computed inside the trainer, where TRL passes ``log_extra``).

    Example::

        @batch_reward(gold_column="answer", prediction=extract_answer)
        def exact_match(text: str, gold: str, /, **row) -> float:
            return float(extract_answer(text) == gold)
    """

    def wrap(scorer: Scorer) -> BatchReward:
        return BatchReward(scorer, gold_column, name=name, columns=columns, prediction=prediction)

    return wrap
