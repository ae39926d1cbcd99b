"""``anls``: Average Normalized Levenshtein Similarity (DocVQA / InfographicVQA), edit distance from ``rapidfuzz``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rapidfuzz.distance import Levenshtein

from .adaptor import batch_reward
from .parsing import answer_marker, extract_answer, final_segment, strip_latex_text

__all__ = ["anls", "anls_score"]


def anls_score(pred: str, gold: str | Sequence[str], threshold: float = 0.5) -> float:
    """ANLS of one prediction against one or several acceptable answers.

    Returns:
        The max over golds of ``1 - NL`` if ``NL < threshold`` else 0, with ``NL`` the Levenshtein distance divided
        by the longer length, on lowercased, whitespace-collapsed strings (the official DocVQA evaluation). Two empty
        strings score 1.0; an empty gold list scores 0.0.
    """
    golds = [gold] if isinstance(gold, str) else list(gold)  # numbers in a list are compared as their text
    p = " ".join(pred.lower().split())
    best = 0.0
    for g in golds:
        g = " ".join(str(g).lower().split())
        if not p and not g:
            return 1.0
        nl = Levenshtein.normalized_distance(p, g)  # distance / max(len): DocVQA's normalisation
        if nl < threshold:
            best = max(best, 1.0 - nl)
    return best


def _prediction(text: str) -> str:
    """The answer as the other rewards read it: the last answer tag's content (its ``\\boxed{}`` part), else the last
    ``\\boxed{}``, else the line after "Answer:", else the stripped text after ``</think>`` (``\\text{}`` unwrapped)."""
    answer = extract_answer(text)
    if answer is None:
        segment = final_segment(text)
        answer = answer_marker(segment, sentence=False) or segment
    # Markup and maths delimiters are not part of the answer ("**7**", "$7$" read as 7); a currency sign is ("$1,234").
    answer = strip_latex_text(answer).strip().strip("*_").strip()
    return answer[1:-1].strip() if len(answer) > 2 and answer[0] == answer[-1] == "$" else answer


@batch_reward(gold_column="answer", prediction=_prediction)
def anls(text: str, gold: Any, /, **row: Any) -> float | None:
    """ANLS reward (see :func:`anls_score`) of the answer (tag, ``\\boxed{}``, "Answer:" line, else the text after
    ``</think>``) against column ``answer`` (an acceptable answer or a list of them; None or an empty list gives
    None)."""
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):  # a numeric answer read from JSON / Parquet
        gold = str(gold)
    if not isinstance(gold, str) and len(gold) == 0:
        return None
    # A closing full stop may end the sentence ("No." for no) or belong to the answer ("U.S."): the closer reading.
    prediction = _prediction(text)
    return max(anls_score(prediction, gold), anls_score(prediction.rstrip(".!?").strip(), gold))
