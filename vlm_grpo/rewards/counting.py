"""``counting``: object-counting accuracy that pays for one committed count, not for ranges or hedges."""

from __future__ import annotations

import re
from typing import Any

from .adaptor import batch_reward
from .parsing import answer_span

__all__ = ["counting", "extract_count"]

_UNITS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
]  # fmt: skip
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_WORD_VALUES = {w: i for i, w in enumerate(_UNITS)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
# "twenty-one" / "twenty one" is one number; longest alternatives first so "seventeen" is not read as "seven".
_WORDS = "|".join(sorted(_WORD_VALUES, key=len, reverse=True))
_NUMBER_WORD_RE = re.compile(rf"(?<![\w-])({'|'.join(_TENS)})(?:[-\s]({'|'.join(_UNITS[1:10])}))?(?![\w-])|"
                             rf"(?<![\w-])({_WORDS})(?![\w-])", re.IGNORECASE)  # fmt: skip
# Thousands separators are part of the number ("1,200 people").
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?)"
# Ranges and hedges: "2 or 3", "2-3", "2 to 3", "between 2 and 4", "about 3", "at least 3", "3+", "3 or more";
# bounds and rulings-out are not that count either: "> 3", "≥ 3", "not 3", "aren't 3", "3-ish" (a tag's ">" in
# "<think>3" is no bound).
_HEDGE_RES = (
    re.compile(rf"{_NUM}\s*(?:-|–|—|/|\bor\b|\bto\b)\s*{_NUM}"),
    re.compile(rf"\bbetween\s+{_NUM}\s+and\s+{_NUM}"),
    re.compile(rf"(?:\b(?:about|around|approximately|approx|roughly|nearly|almost|maybe|perhaps|possibly|probably"
               rf"|at least|at most|more than|less than|fewer than|over|under|up to|or so|not|never)\b"
               rf"|n't|[~≈≤≥]|(?<!\w)[<>])"
               rf"\s*{_NUM}"),
    re.compile(rf"{_NUM}\s*(?:\+|\bor (?:more|fewer|less|so)\b|-?ish\b)"),
)  # fmt: skip
# "none", "no dogs", "there are no ...": a count of zero. Beside a number, where the object asked about is known, only
# where it names that object ("no dogs"); "no other", "nothing else" add nothing ("3. No other dogs are visible.").
_ZERO_RE = re.compile(r"\b(?:none|nothing|no(?=\s+[a-z]))\b|^\s*no\W*$")
_NOTHING_MORE_RE = re.compile(r"\bno\s+(?:other|more|further|additional|extra)\b|\b(?:nothing|none)\s+(?:else|other)\b")
# A minus sign is part of the number ("-3" is no count), so the digits after it are not read as 3.
_DIGITS_RE = re.compile(rf"(?<![\w.\-−]){_NUM}(?!\w|\.\d)")
_ASKED_RE = re.compile(
    r"how many\s+((?:[a-z]+\s+){0,3}?[a-z]+?)(?:s|es)?\b(?=\s+(?:are|is|do|does|can|in|on|there)|\?)"
)


def _words_to_digits(s: str) -> str:
    """Number words -> digits ("twenty-one" -> "21"), except "one" as a pronoun ("one of them", "a small one")."""

    def repl(m: re.Match[str]) -> str:
        if m.group(3):
            word = m.group(3).lower()
            if word == "one" and _is_pronoun(s, m):
                return m.group(0)
            return str(_WORD_VALUES[word])
        return str(_WORD_VALUES[m.group(1).lower()] + (_WORD_VALUES[m.group(2).lower()] if m.group(2) else 0))

    return _NUMBER_WORD_RE.sub(repl, s)


def _is_pronoun(s: str, m: re.Match[str]) -> bool:
    before, after = s[: m.start()].lower(), s[m.end() :].lower()
    return bool(
        re.match(r"\s+of\b", after) or re.search(r"\b(?:a|the|each|any|which|that|this|small|big|large)\s+$", before)
    )


def _asked_object(row: dict[str, Any]) -> str | None:
    """The object the question counts ("How many dogs are there?" -> "dog"), from column ``object`` or the prompt."""
    if isinstance(row.get("object"), str):
        return row["object"].lower().rstrip("s")
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # chat messages: the user turns' text
        prompt = " ".join(str(m.get("content")) for m in prompt if isinstance(m, dict) and m.get("role") == "user")
    m = _ASKED_RE.search(str(prompt or "").lower())
    return m.group(1).split()[-1] if m else None


def extract_count(text: str, obj: str | None = None) -> float | None:
    """The one count a completion commits to, or None.

    Reads :func:`~vlm_grpo.rewards.parsing.answer_span` (answer tag / ``\\boxed{}``, else the sentence after
    "Answer:", else the text after ``</think>``), with number words up to ninety-nine and "none" / "no dogs" as 0.
    A range or hedge (``2 or 3``, ``2-3``, ``between 2 and 4``, ``about 3``) gives None. Several distinct numbers
    give None, unless ``obj`` (the object asked about) picks one: "3 dogs and 2 cats" with ``obj="dog"`` is 3.
    """
    span = _words_to_digits(answer_span(text).lower())
    if any(p.search(span) for p in _HEDGE_RES):
        return None
    values = {_value(v) for v in _DIGITS_RE.findall(span)}
    said = _NOTHING_MORE_RE.sub(" ", span)
    none_of_it = bool(obj) and re.search(rf"\bno\s+(?:[a-z]+\s+){{0,2}}{re.escape(obj or '')}", said) is not None
    if _ZERO_RE.search(said) and (not values or not obj or none_of_it):
        values.add(0.0)
    if len(values) > 1 and obj:
        attached = {_value(m.group(1)) for m in re.finditer(rf"({_NUM})\s+(?:[a-z]+\s+){{0,2}}{re.escape(obj)}", span)}
        attached |= {0.0} if none_of_it else set()
        values = attached if attached else values
    return values.pop() if len(values) == 1 else None


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def _gold_count(gold: Any) -> int:
    if isinstance(gold, bool):  # bool is an int subclass, but True is not a count
        raise ValueError(f"`counting` expects column `answer` to hold an integer, got {gold!r}.")  # noqa: TRY004
    if isinstance(gold, int):
        return gold
    text = _words_to_digits(str(gold).strip().lower().rstrip("."))
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        value = float("nan")
    if not value.is_integer():
        raise ValueError(f"`counting` expects column `answer` to hold an integer, got {gold!r}.")
    return int(value)


@batch_reward(gold_column="answer", prediction=extract_count)
def counting(text: str, gold: Any, /, **row: Any) -> float:
    """Object-counting accuracy: 1.0 when the completion commits to exactly one count (see :func:`extract_count`;
    the object asked about comes from column ``object`` or a "How many X" prompt), the gold one; else 0.0. Reads
    column ``answer`` (an int, ``"3"`` or ``"three"``; a non-integer raises ``ValueError``)."""
    pred = extract_count(text, _asked_object(row))
    return 1.0 if pred is not None and pred == _gold_count(gold) else 0.0
