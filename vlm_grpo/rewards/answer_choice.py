"""``answer_choice``: accuracy for closed-vocabulary answers, the vocabulary being the answer column's own values.

Where the answers are a few words or short phrases (``circle`` / ``square`` / ``triangle``, ``yes`` / ``no``), the
first of them a completion names is its answer: ``circle system! [`` answers ``circle``; naming none scores 0; one
ruled out (``not a circle``) is not an answer, nor are values offered as alternatives (``yes or no``).
``answer_accuracy`` (the exact answer) pays nothing for that completion, so a model that does not yet stop after its
answer (a tiny one from scratch, a pretrained one that explains) gets no learning signal from it. Words are read as
:class:`~vlm_grpo.rewards.choice.ChoiceScorer` reads them: case-insensitively, in the answer tag, else the sentence
after "Answer:", else the text after ``</think>``.

By name (``--reward_funcs answer_choice``) the reward is built from the data once it is loaded (``vlm_grpo.cli.task``
does it); in Python, ``make_answer_choice_reward(answers)``. ``closed_vocabulary`` says when an answer column is one,
which is when ``vlm_grpo.cli.task.dataset_task`` picks this reward by default.

Example::

    >>> reward = make_answer_choice_reward(["circle", "square", "triangle", "square"])
    >>> reward(None, ["circle system! [", "a square, not a circle", "a dog"], answer=["circle"] * 3)
    [1.0, 0.0, 0.0]
    >>> closed_vocabulary(["circle", "Square", "circle", "square."]), closed_vocabulary(["1", "2", "1", "2"])
    (['circle', 'square'], ['1', '2'])
    >>> closed_vocabulary(["1", "2", "1", "2"], numbers=False), closed_vocabulary(["circle", "square"])  # no repeats
    (None, None)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .adaptor import BatchReward, RewardFunc
from .choice import ChoiceScorer, _phrase
from .registry import FromAnswers

__all__ = ["MAX_CHOICES", "MAX_CHOICE_WORDS", "answer_choice", "closed_vocabulary", "make_answer_choice_reward"]

# A closed vocabulary: 2 to 20 distinct answers (chance >= 0.05: class labels, not free text, where a word named in
# passing would be read as the answer), each at most 3 words (a label such as "traffic light", not a sentence),
# repeated (at most half as many distinct values as rows: classes, not one answer per question). `dataset_task` picks
# `answer_choice` for one unless the answers are all numbers: `answer_accuracy` compares those by value (1,000 = 1000,
# 2.0 = 2), and a count missing from the data is still an answer, not a word outside the vocabulary.
MAX_CHOICES, MAX_CHOICE_WORDS = 20, 3


def _values(answers: Iterable[Any]) -> list[str]:
    """The distinct answers as read (``_phrase``), sorted; a list-valued (several accepted answers) row raises."""
    values = set()
    for answer in answers:
        if isinstance(answer, (list, tuple, dict)):  # a data error: ValueError, as for every malformed column
            message = f"answer_choice reads one answer per row, got {answer!r}: for lists of accepted answers use "
            raise ValueError(message + "--reward_funcs answer_accuracy or anls.")  # noqa: TRY004
        if answer is not None:
            values.add(_phrase(str(answer)))
    return sorted(values)


def closed_vocabulary(answers: Iterable[Any], numbers: bool = True) -> list[str] | None:
    """The answer column's distinct values (as read: lowercase words) when they are a closed vocabulary: 2 to
    `MAX_CHOICES` of them, repeated, each at most `MAX_CHOICE_WORDS` words (`numbers=False`: not all numbers); else
    None."""
    answers = list(answers)
    try:
        values = _values(answers)
    except ValueError:
        return None
    rows = sum(a is not None for a in answers)
    if not 2 <= len(values) <= min(MAX_CHOICES, rows // 2) or "" in values:
        return None
    if any(len(v.split()) > MAX_CHOICE_WORDS for v in values):
        return None
    return None if not numbers and all(map(_is_number, values)) else values


def _is_number(value: str) -> bool:
    try:
        float(value.replace(" ", "."))  # "3.5" is read as the words "3 5"
    except ValueError:
        return False
    return True


def make_answer_choice_reward(answers: Iterable[Any], name: str = "answer_choice") -> RewardFunc:
    """Closed-vocabulary accuracy, the vocabulary being `answers` (an answer column; repeats are fine): 1.0 when the
    first of its values the completion names is the gold one (column ``answer``), else 0.0. Raises ``ValueError`` for
    rows holding lists of answers, or no answers at all."""
    scorer = ChoiceScorer(_values(answers), first=True)
    return BatchReward(scorer, "answer", name=name, prediction=scorer.named)


#: ``--reward_funcs answer_choice``: `make_answer_choice_reward` of the data's answers, built by `vlm_grpo.cli.task`.
answer_choice = FromAnswers(make_answer_choice_reward, "answer_choice")
