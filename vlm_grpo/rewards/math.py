"""``answer_accuracy``: exact-answer accuracy for maths and short-answer VQA, decided by Math-Verify.

The only hand-written comparison is a numeric fast path for what Math-Verify does not read well in short answers:
an answer that is exactly one number with thousands separators, currency, a percent sign or a plain-word unit
(``1,000``, ``$5``, ``50%``, ``4 apples``). Everything else (fractions, roots, sets, intervals, matrices, equations,
``p - q`` vs ``p-q``) goes to Math-Verify on the *delimited* answer, which reads ``1, 2, 7`` as a set and ``7\\pi`` as
a product, so neither pays for gold 7. A sentence (no tag, box or "Answer:" marker) counts only when it states
exactly one value, one number or one ``$…$`` span: never "the last number", which pays for listing several.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from functools import cache
from typing import Any

from .adaptor import batch_reward
from .parsing import answer_marker, answer_span, extract_answer, strip_latex_text

__all__ = ["answer_accuracy", "answers_match", "parse_number"]

# Tight enough that 0.333 != 1/3, loose enough to absorb round-off from "0.1".
REL_TOL, ABS_TOL = 1e-6, 1e-9

# Thousands separators ("1,000") or a decimal comma where it cannot be one ("1,22", "0,111"), else a plain decimal,
# with an exponent ("2.5e6", and a float gold as Python writes it: 1e-05).
_NUMBER = r"[-+]?(?:0,\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+,\d{1,2}(?![\d,])|(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?)"
# One number, optionally with currency before and %/degrees/unit words after. A unit is one or two plain words.
_SINGLE_NUMBER_RE = re.compile(
    rf"(?:\\?\$|€|£)?\s*(?P<num>{_NUMBER})\s*(?P<pct>\\?%|percent\b)?\s*(?:\^\s*\{{?\\circ\}}?|°)?"
    rf"(?P<unit>\s*[a-zA-Z]{{2,}}(?:\s+[a-zA-Z]{{2,}})?)?\.?"
)
# A standalone number in prose: not glued to letters, other digits, LaTeX or operators ("7x", "2^7" are not numbers).
_NUMBER_IN_PROSE_RE = re.compile(rf"(?<![\w.,\\^{{}}/*+-]){_NUMBER}(?:/\d+)?(?![\w^{{}}/*]|[.,]\d)")
# Standalone letter runs outside LaTeX commands and environment names ("or", "is", "apples"; not "2xy" or "\\pi");
# one that is not a maths word makes prose.
_ENV_RE = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}")
_WORD_RE = re.compile(r"(?<![\\a-zA-Z0-9])[a-zA-Z]{2,}(?![a-zA-Z0-9(])")
_MATH_WORDS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "sqrt", "inf", "infty", "mod", "pi",
                         "root", "squared", "cubed", "times", "over", "plus", "minus", "degrees", "ln", "lg", "gcd", "lcm", "det",
                         "max", "min", "dx", "dy", "dt"})  # fmt: skip


# LaTeX maths spans a sentence may hold: $…$, $$…$$, \(…\), \[…\].
# Inline spans stay on one line (as Math-Verify reads them); an escaped \\$ is a dollar sign, not a delimiter.
_MATH_SPAN_RE = re.compile(
    r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$([^\n]+?)(?<!\\)\$|\\\(([^\n]+?)\\\)|\\\[(.+?)\\\]", re.DOTALL
)
# Units in \text{} ("\text{ cm}"); one holding a digit ("7 \text{or 8}") states a value, so it is not set aside.
_TEXT_BLOCK_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mbox)\s*\{[^{}\d]*\}")
# A value ruled out, bounded or hedged is not that value: "not 7", "isn't 7", "at least 7", "about $7$", "7 or more",
# "7+", and a relation with no left side ("< 7", "\\neq 7"; "x < 7" is an inequality, left to Math-Verify; "<think>"
# is a tag).
_HEDGED_RE = re.compile(
    r"(?:(?i:\b(?:not|never|about|around|approximately|approx|roughly|nearly|almost|maybe|perhaps|possibly|probably"
    r"|at least|at most|more than|less than|fewer than|greater than|under|below|above|up to)\b)|n't)\s*\$?\s*[-+]?\.?\d"
    r"|^\W*?(?:[<>](?![a-zA-Z/])|[≤≥≠≈~]|\\(?:neq?|leq?|geq?|lt|gt|approx|sim)(?![a-zA-Z]))"
    r"|\d\s*\$?\s*(?:\+\W*$|(?i:\bor\s+(?:more|less|fewer|so|above|below)\b))"
    r"|\d\s*\$?\s*\(?(?i:-?ish\b|at (?:least|most)\b|approx|roughly\b|or so\b|give or take\b|(?:below|above|under)\b)"
)

# An operation left undone, where the gold is a number: "3+4", "3 \times 2 + 1" for 7. Math-Verify counts them
# equal, so a policy could copy a question's expression ("What is 3 + 4?", or two numbers an image asks to add) and be
# paid for the value it never computed. Fractions ("\frac{1}{2}", "1/2" for 0.5) are values and stay, as does a
# root ("\sqrt{4}" for 2).
_UNEVALUATED_RE = re.compile(r"[\d}).]\s*(?:[+*×·^-]|\\(?:cdot|times)(?![a-zA-Z]))\s*[-\d({\\]")
# Scientific notation ("1.5 \times 10^{-3}", "2.5 × 10^6") is a value, written as "1.5e-3" before the checks above.
_SCIENTIFIC_RE = re.compile(
    r"(?<![\d.])(\d+(?:\.\d+)?)\s*(?:\\times|\\cdot|×|·|\*)"  # the mantissa, times
    r"\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?"  # ten to a power
)


# Scale words after a number are part of its value.
_SCALES = {"dozen": 12, "hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}


def _words(s: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(_ENV_RE.sub(" ", s))]


def _is_prose(s: str) -> bool:
    """Whether ``s`` is a sentence rather than an expression: an ordinary word of two or more letters outside its
    maths spans and ``\\text{}`` units."""
    outside = _TEXT_BLOCK_RE.sub(" ", _MATH_SPAN_RE.sub(" ", s))
    return any(w not in _MATH_WORDS for w in _words(outside))


def _single_statement(s: str) -> str | None:
    """The one value a sentence states, else None: its only number or maths span, where spans without a digit
    ("the largest $n$ is 34") are names of things whenever a value with a digit is also stated."""
    spans = [next(g for g in m.groups() if g is not None).strip() for m in _MATH_SPAN_RE.finditer(s)]
    outside = _MATH_SPAN_RE.sub(" ", s).replace("−", "-")
    if outside.count("$") > 1:  # unbalanced or multi-line maths: nothing is stated cleanly
        return None
    if any(w in _MATH_WORDS for w in _words(outside)) or re.search(r"[\\^_{}=]", outside):
        return None
    values = {"".join(v.split()): v for v in spans + _NUMBER_IN_PROSE_RE.findall(outside)}
    numeric = {k: v for k, v in values.items() if re.search(r"\d", k)}
    values = numeric or values
    if len(values) != 1:
        return None
    value = next(iter(values.values()))
    if value not in outside:  # a maths span
        return value
    if re.search(re.escape(value) + r"\s*(?:%|percent\b)", outside):
        return value + "%"
    scale = re.search(re.escape(value) + rf"\s+({'|'.join(_SCALES)})\b", outside, re.IGNORECASE)
    return f"{value} {scale.group(1).lower()}" if scale else value


def _clean(s: str) -> str:
    s = strip_latex_text(s).replace("−", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", ",")
    return s.replace("\\$", "$").replace("$", "").strip()


def _number_with_percent(s: str) -> tuple[float, bool] | None:
    """``(value, has_percent)`` when ``s`` is exactly one number (currency, %, degrees, a unit word allowed; a scale
    word multiplies: "5 million" is 5000000, not 5)."""
    m = _SINGLE_NUMBER_RE.fullmatch(_clean(s))
    unit = _words(m.group("unit")) if m and m.group("unit") else []
    if not m or any(w in _MATH_WORDS for w in unit):
        return None
    num = m.group("num")
    num = num.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", num) else num.replace(",", ".")
    return float(num) * (_SCALES.get(unit[0], 1) if unit else 1), bool(m.group("pct"))


def parse_number(s: str) -> float | None:
    """The value of a string that is exactly one number (``"1,000"``, ``"-3.0"``, ``"$5"``, ``"12%"`` -> 12.0,
    ``"4 apples"``), else None (``"1, 2"``, ``"7x"``, ``"\\sqrt{7}"``, ``"1/2"``: fractions are Math-Verify's)."""
    parsed = _number_with_percent(s)
    return parsed[0] if parsed else None


def _numbers_match(a: tuple[float, bool], b: tuple[float, bool]) -> bool:
    """Numeric equality; when exactly one side has a percent sign, ``50%`` equals 50 and 0.5."""
    (va, pa), (vb, pb) = a, b
    xs = [va, va / 100] if pa and not pb else [va]
    ys = [vb, vb / 100] if pb and not pa else [vb]
    return any(math.isclose(x, y, rel_tol=REL_TOL, abs_tol=ABS_TOL) for x in xs for y in ys)


def _normalize(s: str) -> str:
    """Case/whitespace/markup-insensitive form for string equality (``**Blue**`` == ``blue``, ``(1, 2)`` == ``(1,2)``)."""
    s = strip_latex_text(s).strip().strip("$").strip().strip("*_\"'`").strip().rstrip(".").strip().lower()
    return " ".join(s.split()) if _is_prose(s) else "".join(s.split())


@cache
def _math_verify() -> Any:
    import math_verify  # imported lazily: it pulls in sympy, slow to import

    return math_verify


def _verify(gold: str, pred: str) -> bool:
    """Math-Verify's verdict; False on any parser failure or timeout (one odd completion must not end a run)."""
    mv = _math_verify()
    # Its timeouts use signal.alarm, which only works in the main thread (TRL's accuracy reward does the same).
    main = threading.current_thread() is threading.main_thread()
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    timeout = 5 if main else None
    try:
        gold_parsed = mv.parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout)
        # Always a delimited expression: on free text Math-Verify falls back to the last number it sees.
        pred_parsed = mv.parse(f"${pred}$", parsing_timeout=timeout)
        return bool(gold_parsed and pred_parsed and mv.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a checker failure means "not verified"
        return False


def _gold_answer(gold: Any) -> str:
    """A gold value reduced to its answer: after GSM8K's ``####``, a MATH solution's last ``\\boxed{}``, else as is."""
    text = str(gold).strip()
    if "####" in text:
        return text.rpartition("####")[2].strip()
    extracted = extract_answer(text)
    return extracted if extracted is not None else text


def answers_match(completion: str, gold: str) -> bool:
    """Whether a completion's final answer equals ``gold`` (already reduced to a bare answer); see the module doc."""
    candidate, gold = _SCIENTIFIC_RE.sub(r"\1e\2", answer_span(completion)), _SCIENTIFIC_RE.sub(r"\1e\2", gold)
    if _is_prose(candidate):  # "<answer>The answer is 7</answer>": the marked part, else the one value stated
        candidate = answer_marker(candidate) or candidate
    if _HEDGED_RE.search(candidate) and not _HEDGED_RE.search(gold):  # "not 7", "at least 7" do not answer 7
        return _normalize(candidate) == _normalize(gold)
    if _is_prose(candidate):
        single = _single_statement(candidate)
        if single is None:  # a text answer ("New York"), or a sentence naming several values
            return _normalize(candidate) == _normalize(gold)
        candidate = single
    gold_number, number = _number_with_percent(gold), _number_with_percent(candidate)
    if gold_number is not None and number is not None:
        return _numbers_match(number, gold_number)
    if _normalize(candidate) == _normalize(gold):
        return True
    if _is_prose(gold):  # a text gold ("New York"): Math-Verify would multiply the letters
        return False
    if gold_number is not None and _UNEVALUATED_RE.search(candidate):  # "3+4" for 7: the sum asked for, not given
        return False
    return _verify(gold, candidate)


@batch_reward(gold_column=("answer", "solution"), prediction=answer_span)
def answer_accuracy(text: str, gold: Any, /, **row: Any) -> float | None:
    """Exact-answer accuracy: 1.0 when the final answer equals the gold, else 0.0 (None where the gold is None).

    Reads column ``answer``, else ``solution`` (a GSM8K rationale ``… #### 42`` or a MATH solution ending in
    ``\\boxed{…}`` is reduced to its answer). The answer is the answer tag / ``\\boxed{}`` content, else the sentence
    after "Answer:", else the text after ``</think>``. No credit for an answer naming several values (``1, 2, 7``,
    ``8 or 7``), one that merely contains the gold (``7x``, ``\\sqrt{7}``, ``2^{7}``), one that rules it out,
    bounds it or hedges it (``not 7``, ``at least 7``, ``about 7``), or, for a number, an operation left undone
    (``3+4``). A list of golds (VQA's accepted answers, ``["New York", "NYC"]``) pays for any one of them; an empty
    list gives None.
    """
    golds = list(gold) if isinstance(gold, (list, tuple)) else [gold]
    if not golds:
        return None
    return 1.0 if any(answers_match(text, _gold_answer(g)) for g in golds) else 0.0
