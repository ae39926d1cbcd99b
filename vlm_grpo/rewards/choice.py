"""Choice rewards: one option letter (``multiple_choice``) or one word from a closed vocabulary (``make_choice_reward``).

Both pay only for an answer that names exactly one candidate, the right one: ``A and C``, ``A or B`` and
``red or blue`` name two and score 0, so listing options can never be rewarded. ``ChoiceScorer(first=True)`` reads
the first candidate named instead, for ``answer_choice`` (:mod:`.answer_choice`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .adaptor import BatchReward, RewardFunc, batch_reward
from .parsing import answer_span, strip_latex_text

__all__ = ["LETTERS", "extract_choice", "make_choice_reward", "multiple_choice"]

#: Option letters understood everywhere (golds and predictions): A to J, as in MMMU / MMLU-Pro style benchmarks.
LETTERS = "ABCDEFGHIJ"
_L = f"[{LETTERS}]"
_GOLD_RE = re.compile(rf"\s*[(\[]?\s*({_L})\s*[)\].:]?(?:\s.*)?", re.IGNORECASE | re.DOTALL)
_LONE_RE = re.compile(rf"[\W_]*({_L})[\W_]*", re.IGNORECASE)
# "B. cat", "(B) cat", "B) cat", "B: cat" at the start of the answer: the rest is the option's text.
_LEADING_RE = re.compile(rf"\s*[*_]*[(\[]?({_L})(?:[)\]]|[.:](?:\s|$))", re.IGNORECASE)
# Letters named anywhere in the answer: bracketed in any case, "option b", or a standalone capital.
_NAMED_RES = (
    re.compile(rf"[(\[]({_L})[)\]]", re.IGNORECASE),
    re.compile(rf"(?i:option|choice)\s+({_L})(?![\w'])", re.IGNORECASE),
    re.compile(rf"(?<![\w'’(\[])({_L})(?![\w'’])"),
)
# "A" and "I" are also an article and a pronoun: "A cat is ...", "I think ...". Followed by a lowercase word they are
# words, unless that word joins options or says which one is right ("A and C", "A is correct").
# A letter ruled out: "not B", "isn't (b)", "not option c". A bare letter is a capital ("not a cat" rules out nothing).
_RULED_OUT_RE = re.compile(
    rf"(?:\b(?i:not|never|nor|neither)|n't)\s+"
    rf"(?:(?i:option|choice)\s+(?i:({_L}))\b|[(\[](?i:({_L}))[)\]]|({_L})(?![\w'’]))"
)
_WORD_AFTER_RE = re.compile(r"\s+(?!(?:and|or|nor|not|vs|is|was|fits|seems|looks)\b)[a-z]")
# After a leading "B. cat", another option in its own shape: bracketed anywhere, or "C) dog" / "C: dog" / "C. dog"
# after a separator. "D. Both A and B" and "C. Vitamin D." are option text (a bare letter, or a dotted one at the end).
_OTHER_OPTION_RES = (
    re.compile(rf"[(\[]({_L})[)\]]", re.IGNORECASE),
    re.compile(rf"(?:^|[,;/&\n]|\b(?:or|and|nor|vs)\b)\s*[*_]*(?:({_L})[):]|(?-i:({_L}))\.\s+\S)", re.IGNORECASE),
)
# After only a space, the next letter's capital in that shape: an option list copied out ("A. 5 B. 6 C. 7") names
# them all, while "C. Plan A: go" keeps its option text.
_SPACED_OPTION_RE = re.compile(rf"\s[*_]*({_L})(?:[):]|\.\s+\S)")
# A span that is only letters and joining words ("B or c", "B, c", "C.") names them all, in any case.
_LIST_WORDS = frozenset({"or", "and", "nor", "vs", "option", "options", "choice", "choices"})
_ABBREVIATION_RE = re.compile(r"\b(?:i\.\s?e|e\.\s?g)\b\.?", re.IGNORECASE)


def _named_letters(span: str) -> set[str]:
    letters = set()
    for pattern in _NAMED_RES:
        for m in pattern.finditer(span):
            letter = m.group(1).upper()
            if m.group(0) == m.group(1) and letter in "AI" and _WORD_AFTER_RE.match(span, m.end()):
                continue
            letters.add(letter)
    return letters


def _listed_letters(span: str) -> set[str]:
    """The letters of a span made only of option letters and joining words ("B or c" -> {B, C}), else empty."""
    words = [w for w in re.findall(r"[^\W_]+", _ABBREVIATION_RE.sub(" ", span)) if w.lower() not in _LIST_WORDS]
    return {w.upper() for w in words} if words and all(w.upper() in LETTERS and len(w) == 1 for w in words) else set()


def _other_options(rest: str, letter: str) -> set[str]:
    """Letters after a leading `letter` ("B.") that read as further options, not as the option's text."""
    following = chr(ord(letter) + 1)
    spaced = {m.group(1) for m in _SPACED_OPTION_RE.finditer(rest)} & {following}
    return (
        spaced
        | _listed_letters(rest)
        | {found.upper() for p in _OTHER_OPTION_RES for m in p.finditer(rest) for found in m.groups() if found}
    )


def extract_choice(text: str) -> str | None:
    """The one option letter (A–J) a completion chooses, or None when it names none or several.

    The answer is read from :func:`~vlm_grpo.rewards.parsing.answer_span` (answer tag / ``\\boxed{}``, else the
    sentence after "Answer:", else the text after ``</think>``): a lone letter in any case (``b``, ``(b)``,
    ``\\text{B}``), a leading ``B.`` / ``(B)`` / ``B)`` followed by the option's text, else every letter it names
    (bracketed, "option C", or a standalone capital; the article in "A cat" is not a choice). Two distinct letters
    (``A and C``, ``A, B, C, D``, "C, not B") give None, as does a letter ruled out ("not B").
    """
    span = strip_latex_text(answer_span(text))
    letter = _chosen_letter(span)
    ruled_out = {x.upper() for m in _RULED_OUT_RE.finditer(span) for x in m.groups() if x}
    return None if letter in ruled_out else letter


def _chosen_letter(span: str) -> str | None:
    lone = _LONE_RE.fullmatch(span)
    if lone:
        return lone.group(1).upper()
    leading = _LEADING_RE.match(span)
    if leading:  # "B. cat": the rest is the option's text, unless it names another option ("B. cat or C. dog")
        letter = leading.group(1).upper()
        return letter if _other_options(span[leading.end() :], letter) <= {letter} else None
    letters = _named_letters(span) | _listed_letters(span)
    return letters.pop() if len(letters) == 1 else None


def _gold_letter(gold: Any) -> str:
    m = _GOLD_RE.fullmatch(str(gold))
    if not m:
        raise ValueError(f"`multiple_choice` expects column `answer` to hold a letter A-J, got {gold!r}.")
    return m.group(1).upper()


@batch_reward(gold_column="answer", prediction=extract_choice)
def multiple_choice(text: str, gold: Any, /, **row: Any) -> float:
    """Multiple-choice accuracy: 1.0 when the completion chooses exactly one letter (see :func:`extract_choice`), the
    gold one; else 0.0. Reads column ``answer`` (``"B"``, ``"b"``, ``"(B)"``, ``"B. cat"``); a gold that is not a
    letter A–J raises ``ValueError`` (a data bug)."""
    gold_letter = _gold_letter(gold)
    return 1.0 if extract_choice(text) == gold_letter else 0.0


_WORD_RE = re.compile(r"[\w-]+")


def _normalize_word(s: str) -> str:
    return " ".join(strip_latex_text(s).strip().strip("$*_\"'`").rstrip(".").lower().split())


def _phrase(s: str) -> str:
    """A candidate or answer as the words it is read as: ``"Traffic light."`` -> ``"traffic light"``."""
    return " ".join(w for w in map(_normalize_word, _WORD_RE.findall(_normalize_word(s))) if w)


_NEGATIONS = frozenset({"not", "never", "nor", "neither"})
# Words that join candidates offered side by side, and those of them that make the candidates alternatives.
_JOINING_WORDS = frozenset({"or", "and", "nor", "vs", "either", "and/or"})
_ALTERNATIVES = frozenset({"or", "nor", "vs"})


def _ruled_out(before: list[str]) -> bool:
    """Whether the words before a candidate end in a negation ("not", "isn't"; articles skipped: "not a red")."""
    words = before[:]
    while words and words[-1] in ("a", "an", "the"):
        words.pop()
    if not words:
        return False
    # "isn't" is read as the words "isn" and "t".
    return words[-1] in _NEGATIONS or (words[-1] == "t" and len(words) > 1 and words[-2].endswith("n"))


class ChoiceScorer:
    """Scores closed-vocabulary answers (a class, so the reward pickles for TRL's async rollout worker).

    A candidate may be a phrase of several words (``"traffic light"``); at each position of the answer the longest
    candidate is read. ``first``: the first candidate named decides (else the answer must name exactly one).
    """

    def __init__(self, choices: Sequence[str], first: bool = False) -> None:
        self.choices = {_phrase(str(c)) for c in choices}
        if not self.choices or "" in self.choices:
            raise ValueError("choices must be a non-empty list of non-empty answers, e.g. ['red', 'green', 'blue'].")
        self.first = first
        self._longest = max(len(c.split()) for c in self.choices)

    def mentions(self, text: str) -> list[str]:
        """The candidates the answer names, in order (a phrase counted once where it stands, not as its words)."""
        return [phrase for phrase, _ in self._mentions(text)]

    def _mentions(self, text: str) -> list[tuple[str, bool]]:
        """``(candidate, ruled_out)`` in order: ruled out when "not" / "never" / "n't" stands before it ("not red",
        "isn't a circle"), which names the candidate but does not answer it."""
        return [(phrase, ruled_out) for phrase, ruled_out, _ in self._placed(text)]

    def _placed(self, text: str) -> list[tuple[str, bool, list[str]]]:
        """``(candidate, ruled_out, words between it and the one before)`` in order."""
        words = [w for w in map(_normalize_word, _WORD_RE.findall(strip_latex_text(answer_span(text)))) if w]
        found, i, last = [], 0, 0
        while i < len(words):
            for n in range(min(self._longest, len(words) - i), 0, -1):
                if (phrase := " ".join(words[i : i + n])) in self.choices:
                    found.append((phrase, _ruled_out(words[:i]), words[last:i]))
                    i = last = i + n
                    break
            else:
                i += 1
        return found

    def named(self, text: str) -> str:
        """The answer this scorer reads (what TRL's completions table shows): the first candidate named (``first``),
        else every candidate named, space-separated; "" when none."""
        if self.first:
            return self._first(self._placed(text))
        return " ".join(sorted({phrase for phrase, _ in self._mentions(text)}))

    @staticmethod
    def _first(found: list[tuple[str, bool, list[str]]]) -> str:
        """The first candidate not ruled out, unless it heads a run of candidates offered as alternatives ("yes or
        no", "circle, square, or triangle": joined by nothing but "or" / "and" / commas, one "or" among them), which
        answers nothing."""
        start = next((k for k, (_, ruled_out, _) in enumerate(found) if not ruled_out), None)
        if start is None:
            return ""
        offered = False
        for _, _, between in found[start + 1 :]:
            if not set(between) <= _JOINING_WORDS:
                break
            offered |= bool(set(between) & _ALTERNATIVES)
        return "" if offered else found[start][0]

    def __call__(self, text: str, gold: Any, /, **row: Any) -> float:
        gold_word = _phrase(str(gold))
        if gold_word not in self.choices:
            raise ValueError(f"gold answer {gold!r} is not one of the choices {sorted(self.choices)}.")
        if self.first:  # the first candidate not ruled out: "not a circle, a square" answers square
            return 1.0 if self.named(text) == gold_word else 0.0
        # Exactly one candidate named, and not ruled out: "not red" names red but answers something else.
        found = self._mentions(text)
        return 1.0 if {phrase for phrase, _ in found} == {gold_word} and not any(r for _, r in found) else 0.0


def make_choice_reward(choices: Sequence[str], name: str = "choice_accuracy") -> RewardFunc:
    """Accuracy for closed-vocabulary answers: 1.0 when the answer names exactly one of ``choices``, the gold one.

    Reads column ``answer``. Words are compared case-insensitively in the answer tag, else the sentence after
    "Answer:", else the text after ``</think>``; a sentence around the word is fine ("it is red"), naming two
    candidates ("red or blue") scores 0.0; a candidate may be a phrase ("traffic light"). A gold answer that is not
    among the choices raises ``ValueError``. To count the first candidate named instead, see
    :func:`~vlm_grpo.rewards.answer_choice.make_answer_choice_reward`.
    """
    scorer = ChoiceScorer(choices)
    return BatchReward(scorer, "answer", name=name, prediction=scorer.named)
