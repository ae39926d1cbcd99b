"""Verifiable reward functions for GRPO training of vision-language models.

Every reward function follows TRL's reward signature::

    fn(prompts, completions, **columns) -> list[float | None]

``completions`` is either a list of strings (standard format) or a list of message lists (conversational format,
``[{"role": "assistant", "content": ...}]``, where ``content`` may also be a list of ``{"type": "text", ...}``
blocks). Dataset columns arrive as keyword lists aligned with ``completions``; TRL also passes ``completion_ids``,
``trainer_state``, ``log_extra``, ``log_metric`` and every other dataset column, so each function accepts and ignores
unknown keyword arguments. A function returns ``None`` for a row it does not apply to (its gold column is ``None``):
TRL turns ``None`` into NaN and leaves that row out of that reward.

The functions are pure Python and cheap (regexes plus a small Levenshtein DP) so they can run on every rollout. The
only optional dependency is ``math_verify``: when it is importable, :func:`answer_accuracy` also uses it to compare
symbolic answers; without it the comparison falls back to numeric and normalised-string equality.

Helpers from ``trl.rewards`` are re-exported rather than rewritten: ``get_soft_overlong_punishment`` and
``get_repetition_penalty_reward`` (both score ``completion_ids``), ``think_format_reward`` (conversational
completions only), and ``accuracy_reward`` / ``reasoning_accuracy_reward`` / ``get_cosine_scaled_reward`` (these
three raise ``ImportError`` at call time unless ``math_verify`` is installed).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any, Literal

from trl.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

__all__ = [
    "Completion",
    "RewardFunc",
    "accuracy_reward",
    "anls",
    "anls_score",
    "answer_accuracy",
    "answers_match",
    "box_iou",
    "completion_text",
    "counting",
    "extract_answer",
    "extract_choice",
    "extract_last_number",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "iou",
    "iou_threshold",
    "levenshtein",
    "make_choice_reward",
    "make_iou_reward",
    "multiple_choice",
    "parse_box",
    "parse_number",
    "reasoning_accuracy_reward",
    "think_answer_format",
    "think_format_reward",
]

#: One completion as TRL passes it: a plain string, or a list of chat messages.
Completion = str | Sequence[Mapping[str, Any]]
#: A TRL-compatible reward function.
RewardFunc = Callable[..., list[float | None]]

# Default numeric tolerance: tight enough that 0.333 != 1/3, loose enough to absorb float round-off from parsing
# "0.1" or evaluating "1/3".
DEFAULT_REL_TOL = 1e-6
DEFAULT_ABS_TOL = 1e-9


# ---------------------------------------------------------------------------------------------------------------------
# Completion / column plumbing
# ---------------------------------------------------------------------------------------------------------------------


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
            ``content`` is a string, ``None``, or a list of ``{"type": "text", "text": ...}`` blocks (non-text blocks
            such as images are ignored).

    Returns:
        The text. For a message list, the text of the assistant messages (messages without a ``role`` count as
        assistant) joined with newlines, so a multi-turn tool-use completion is scored on what the model wrote, not
        on tool outputs.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        texts = [
            _content_text(message.get("content"))
            for message in completion
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant"
        ]
        return "\n".join(texts)
    raise TypeError(f"Unsupported completion type: {type(completion).__name__}")


def _column(kwargs: Mapping[str, Any], name: str, n: int) -> list[Any]:
    """Fetch dataset column ``name`` and check it has one value per completion.

    A length mismatch means rewards would silently be paired with the wrong gold answers, so it is an error.
    """
    values = kwargs[name]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"Column `{name}` must be a list with one value per completion, got {type(values).__name__}.")
    if len(values) != n:
        raise ValueError(f"Column `{name}` has {len(values)} values but there are {n} completions; they must align.")
    return list(values)


def _required_column(kwargs: Mapping[str, Any], name: str, fn_name: str, n: int) -> list[Any]:
    """Like :func:`_column`, but raise a ValueError naming the column when the dataset lacks it."""
    if name not in kwargs:
        raise ValueError(f"`{fn_name}` needs a dataset column named `{name}`, but none was passed.")
    return _column(kwargs, name, n)


def _log_extra(kwargs: Mapping[str, Any], column: str, values: list[Any]) -> None:
    """Show parsed predictions in TRL's completions table (``log_extra`` is only passed inside the trainer)."""
    log_extra = kwargs.get("log_extra")
    if callable(log_extra):
        log_extra(column, ["" if v is None else str(v) for v in values])


# ---------------------------------------------------------------------------------------------------------------------
# Format
# ---------------------------------------------------------------------------------------------------------------------

# Tempered bodies forbid nested/repeated tags, so "<think>a</think><answer>b</answer><answer>c</answer>" (two answers)
# or a second <think> block cannot sneak through a lazy ".*?".
_THINK_ANSWER_RE = re.compile(
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*",
    re.DOTALL,
)


def think_answer_format(
    prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any
) -> list[float | None]:
    """Reward the ``<think>…</think> <answer>…</answer>`` output format.

    Reads no dataset column.

    Returns:
        Per completion, 1.0 if the whole completion (surrounding whitespace allowed) is exactly one think block
        followed by exactly one answer block, else 0.0.
    """
    return [1.0 if _THINK_ANSWER_RE.fullmatch(completion_text(c)) else 0.0 for c in completions]


# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------------------------

# The body may not contain another "<answer>", so for "<answer>a<answer>b</answer>" we get "b", not "a<answer>b".
_ANSWER_TAG_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED_START_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last_answer_tag(text: str) -> str | None:
    """Stripped content of the last complete ``<answer>…</answer>`` tag, or None."""
    matches = _ANSWER_TAG_RE.findall(text)
    return matches[-1].strip() if matches else None


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{…}`` (nested braces allowed), or None.

    Braces are matched by counting because a regex cannot handle ``\\boxed{\\frac{1}{2}}``. An unbalanced (e.g.
    truncated) last box is skipped in favour of an earlier complete one.
    """
    for start in reversed([m.end() for m in _BOXED_START_RE.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a completion's text.

    Args:
        text: The completion text.

    Returns:
        The stripped content of the last ``<answer>…</answer>`` tag (if that content itself contains ``\\boxed{…}``,
        the boxed part, so ``<answer>\\boxed{5}</answer>`` gives ``"5"``); otherwise the content of the last balanced
        ``\\boxed{…}``; otherwise None. Use :func:`extract_last_number` as the numeric fallback.
    """
    tagged = _last_answer_tag(text)
    if tagged is not None:
        boxed = _last_boxed(tagged)
        return boxed if boxed is not None else tagged
    return _last_boxed(text)


def _final_segment(text: str) -> str:
    """Text after the last ``</think>`` when that is non-blank, else the whole text.

    Fallback parsers (last number, loose letter patterns) should look at the conclusion, not at numbers or options
    mentioned while reasoning.
    """
    head, sep, tail = text.rpartition("</think>")
    return tail if sep and tail.strip() else text


# ---------------------------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------------------------

# A number in free text: optional sign (only when not glued to a preceding word/number, so "5-3" yields "3"),
# integer with optional thousands separators, optional decimals, optional "/denominator" and "%". The trailing
# lookahead stops "12,3456" from being read as "12,345" + "6".
_NUMBER_IN_TEXT_RE = re.compile(
    r"(?<![\w.])[-−+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?!\d)(?:/\d+(?:\.\d+)?(?!\d))?%?"
)
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SIMPLE_FRACTION_RE = re.compile(r"([-+]?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)")
_LATEX_FRACTION_RE = re.compile(r"([-+]?)\\frac(?:\{([-+]?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}|(\d)(\d))")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


def _clean_number_string(s: str) -> tuple[str, bool]:
    """Strip LaTeX/currency/percent decoration from a would-be number; return (cleaned, had_percent)."""
    s = s.strip().replace("−", "-")
    s = _TEXT_WRAPPER_RE.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "{,}", "\\$", "$", "€", "£"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.strip().rstrip(".").strip()
    percent = False
    for suffix in ("\\%", "%"):
        if s.endswith(suffix):
            s, percent = s[: -len(suffix)].strip(), True
            break
    return s, percent


def _parse_number_ex(s: str) -> tuple[float, bool] | None:
    """Parse a string that is exactly one number; return (value, had_percent_sign) or None."""
    s, percent = _clean_number_string(s)
    s = s.replace(" ", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _PLAIN_NUMBER_RE.fullmatch(s):
            return float(s), percent
        m = _SIMPLE_FRACTION_RE.fullmatch(s)
        if m:
            value = float(m.group(2)) / float(m.group(3))
            return (-value if m.group(1) == "-" else value), percent
        m = _LATEX_FRACTION_RE.fullmatch(s)
        if m:
            num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
            value = float(num) / float(den)
            return (-value if m.group(1) == "-" else value), percent
    except (ZeroDivisionError, OverflowError, ValueError):
        return None
    return None


def parse_number(s: str) -> float | None:
    """Parse a string that is exactly one number.

    Args:
        s: E.g. ``"1,000"``, ``"-3.0"``, ``"1/2"``, ``"\\frac{1}{2}"``, ``"$5"``, ``"12%"`` (percent returns 12.0; see
            :func:`answers_match` for how percentages are compared), ``"1e-3"``, ``"42."``.

    Returns:
        The value, or None when ``s`` is not a single number (``"5 apples"``, ``"1,2"``, ``"x"``, ``"1/0"``).
    """
    parsed = _parse_number_ex(s)
    return parsed[0] if parsed is not None else None


def extract_last_number(text: str) -> str | None:
    """Return the last number written in free text, as a string (``"1,000"``, ``"-2.5"``, ``"3/4"``, ``"15%"``).

    Args:
        text: Any text.

    Returns:
        The last match, or None if the text contains no number. A minus sign is kept only when it is not glued to
        a preceding word or number, so ``"5-3"`` gives ``"3"``.
    """
    matches = _NUMBER_IN_TEXT_RE.findall(text)
    return matches[-1] if matches else None


def _numbers_match(a: tuple[float, bool], b: tuple[float, bool], rel_tol: float, abs_tol: float) -> bool:
    """Compare parsed numbers; when exactly one side has a percent sign, accept ``50%`` as 50 or as 0.5."""
    (va, pa), (vb, pb) = a, b
    candidates_a = [va, va / 100] if pa and not pb else [va]
    candidates_b = [vb, vb / 100] if pb and not pa else [vb]
    return any(math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol) for x in candidates_a for y in candidates_b)


# ---------------------------------------------------------------------------------------------------------------------
# Answer accuracy
# ---------------------------------------------------------------------------------------------------------------------

_LATEX_HINT_RE = re.compile(r"[\\^_{}]")
_MATHY_RE = re.compile(r"[\\^_{}=+*/<>()\[\]]|\d")
# Letter runs outside LaTeX commands; a gold with ordinary words ("2 apples") is text, not maths, and handing it to a
# symbolic checker invites false positives.
_WORD_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}")
_MATH_WORDS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "sqrt", "inf", "infty", "mod"})


def _looks_mathy(gold: str) -> bool:
    """Whether a non-numeric gold answer is a mathematical expression worth a symbolic check."""
    return bool(_MATHY_RE.search(gold)) and all(w.lower() in _MATH_WORDS for w in _WORD_RE.findall(gold))


def _normalize_text(s: str) -> str:
    """Case/whitespace-insensitive form of an answer for string equality.

    Lowercases, drops surrounding ``$``, quotes and markdown emphasis, a trailing period, and collapses whitespace.
    Maths-looking strings additionally lose all whitespace and ``\\left``/``\\right`` so "x + 1" equals "x+1" and
    "(1, 2)" equals "(1,2)".
    """
    s = _TEXT_WRAPPER_RE.sub(r"\1", s.strip())
    s = s.strip().strip("$").strip().strip("*_\"'`").strip().rstrip(".").strip()
    if _LATEX_HINT_RE.search(s) or _looks_mathy(s):
        s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ "):
            s = s.replace(token, "")
        s = "".join(s.split())
    return " ".join(s.lower().split())


@cache
def _math_verify() -> Any | None:
    """Import ``math_verify`` once, lazily (it pulls in sympy, which is slow to import); None if unavailable."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _math_verify_equal(gold: str, pred: str, pred_is_extracted: bool) -> bool:
    """Symbolic equality through ``math_verify``; False when it is missing, fails, or times out.

    Errors never propagate: a parser bug on one odd completion must not crash a training step.
    """
    mv = _math_verify()
    if mv is None:
        return False
    # math_verify implements timeouts with signal.alarm, which only works in the main thread (TRL does the same).
    in_main_thread = threading.current_thread() is threading.main_thread()
    parse_timeout = 5 if in_main_thread else None
    verify_timeout = 5 if in_main_thread else None
    if not in_main_thread:
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence "timeout disabled" warnings
    try:
        gold_parsed = mv.parse(gold if "$" in gold else f"${gold}$", parsing_timeout=parse_timeout)
        # An extracted answer is a bare expression, so delimit it; free text is handed over for math_verify's own
        # extraction.
        pred_in = f"${pred}$" if pred_is_extracted and "$" not in pred else pred
        pred_parsed = mv.parse(pred_in, parsing_timeout=parse_timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
    except Exception:  # noqa: BLE001 - any failure in the optional checker means "not verified"
        return False


def _gold_answer(gold: Any) -> str:
    """Reduce a gold column value to the bare answer.

    GSM8K-style "rationale #### 42" keeps what follows the last ``####``; a full MATH-style solution keeps its last
    ``\\boxed{…}`` (or answer tag); anything else is used as is.
    """
    text = str(gold).strip()
    if "####" in text:
        return text.rpartition("####")[2].strip()
    extracted = extract_answer(text)
    return extracted if extracted is not None else text


def answers_match(
    completion: str,
    gold: str,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    abs_tol: float = DEFAULT_ABS_TOL,
) -> bool:
    """Decide whether a predicted completion answers ``gold`` correctly.

    Args:
        completion: The full completion text (the answer is extracted from it).
        gold: The gold answer (already reduced, e.g. by ``#### ``/``\\boxed`` stripping).
        rel_tol: Relative tolerance for numeric answers.
        abs_tol: Absolute tolerance for numeric answers.

    Returns:
        For a numeric gold: whether the prediction's number (answer tag / ``\\boxed`` content, or the last number in
        it; without tag or box, the last number in the text) is within tolerance, accepting ``"1,000"``, ``"3.0"``,
        ``"1/2"``, ``"\\frac{1}{2}"`` and a percent sign on one side only; if that fails and ``math_verify`` is
        installed, whether it verifies the extracted answer symbolically. For a non-numeric gold: whether the
        normalised strings are equal (case, whitespace, trailing period, ``$`` ignored) or, for math-looking golds
        with ``math_verify`` installed, whether it verifies them equal. Without tag or box, a non-numeric gold is
        compared with the whole stripped text after ``</think>``.
    """
    extracted = extract_answer(completion)
    gold_number = _parse_number_ex(gold)

    if gold_number is not None:
        if extracted is not None:
            candidate = _parse_number_ex(extracted)
            if candidate is None:
                last = extract_last_number(extracted)
                candidate = _parse_number_ex(last) if last is not None else None
        else:
            last = extract_last_number(_final_segment(completion))
            candidate = _parse_number_ex(last) if last is not None else None
        if candidate is not None and _numbers_match(candidate, gold_number, rel_tol, abs_tol):
            return True
        # e.g. gold "2" vs "\sqrt{4}": only a symbolic checker can tell, and only for an explicit answer.
        return extracted is not None and _math_verify_equal(gold, extracted, pred_is_extracted=True)

    answer = extracted if extracted is not None else _final_segment(completion).strip()
    if _normalize_text(answer) == _normalize_text(gold):
        return True
    if _looks_mathy(gold):
        return _math_verify_equal(gold, answer, pred_is_extracted=extracted is not None)
    return False


def answer_accuracy(
    prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any
) -> list[float | None]:
    """Exact-answer accuracy for math/short-answer VQA.

    Reads column ``answer``, or ``solution`` when there is no ``answer`` column. Gold values may be strings or
    numbers; a GSM8K rationale (``… #### 42``) or a MATH solution ending in ``\\boxed{…}`` is reduced to its final
    answer. See :func:`answers_match` for extraction and comparison.

    Returns:
        Per completion, 1.0 if correct, 0.0 if not, None where the gold value is None.

    Raises:
        ValueError: If neither an ``answer`` nor a ``solution`` column is passed, or a column does not align with
            ``completions``.
    """
    if "answer" in kwargs:
        golds = _column(kwargs, "answer", len(completions))
    elif "solution" in kwargs:
        golds = _column(kwargs, "solution", len(completions))
    else:
        raise ValueError(
            "`answer_accuracy` needs a dataset column named `answer` or `solution`, but neither was passed."
        )
    rewards: list[float | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        if gold is None:
            rewards.append(None)
            continue
        rewards.append(1.0 if answers_match(completion_text(completion), _gold_answer(gold)) else 0.0)
    _log_extra(kwargs, "answer_accuracy_pred", [extract_answer(completion_text(c)) for c in completions])
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------------------------------------------------

_CHOICES = "A-E"
_GOLD_CHOICE_RE = re.compile(rf"\s*[(\[]?\s*([{_CHOICES}])\s*[)\].:]?(?:\s.*)?", re.IGNORECASE | re.DOTALL)
_LONE_LETTER_RE = re.compile(rf"[\W_]*([{_CHOICES}])[\W_]*", re.IGNORECASE)
# "B. cat", "(B) cat", "B) cat" at the start of an answer tag.
_LEADING_CHOICE_RE = re.compile(rf"\s*[(\[]?([{_CHOICES}])(?:[)\]]|[.:](?:\s|$))", re.IGNORECASE)
# Explicit statements: "answer is (C)", "Answer: C", "**Answer:** C", "answer is option C". The letter must be
# uppercase unless bracketed, because "the answer is a cat" uses the article.
_ANSWER_IS_RE = re.compile(
    rf"(?i:answer)(?:\s*(?i:is|:|=)|\*\*)*[\s:*]*(?i:option|choice)?\s*"
    rf"(?:[(\[]([{_CHOICES}a-e])[)\]]|([{_CHOICES}])(?![\w']))"
)
# Weaker cues, resolved by position (the last one wins): "(C)", "C)", "option C", a line starting "C.", or the
# completion ending on a standalone capital letter. None of these fires on the article in "A cat is ...".
_WEAK_CHOICE_RES = (
    re.compile(rf"[(\[]([{_CHOICES}])[)\]]"),
    re.compile(rf"(?<![\w(\[])([{_CHOICES}])\)"),
    re.compile(rf"(?i:option|choice)\s+([{_CHOICES}])(?![\w'])"),
    re.compile(rf"^[ \t*]*([{_CHOICES}])\.(?:\s|$)", re.MULTILINE),
    re.compile(rf"(?<![\w'])([{_CHOICES}])[\s.!*)]*$"),
)


def _choice_in_text(text: str) -> str | None:
    """Letter chosen in free text: explicit "answer is X" beats weaker cues; among weaker cues the last wins."""
    explicit = list(_ANSWER_IS_RE.finditer(text))
    if explicit:
        m = explicit[-1]
        return (m.group(1) or m.group(2)).upper()
    lone = _LONE_LETTER_RE.fullmatch(text)
    if lone:
        return lone.group(1).upper()
    best: tuple[int, str] | None = None
    for pattern in _WEAK_CHOICE_RES:
        for m in pattern.finditer(text):
            if best is None or m.start(1) > best[0]:
                best = (m.start(1), m.group(1).upper())
    return best[1] if best else None


def extract_choice(text: str) -> str | None:
    """Extract the chosen option letter (A–E) from a completion's text.

    Args:
        text: The completion text.

    Returns:
        The uppercase letter, or None. If an answer tag (or ``\\boxed``) exists, only its content is read: a lone
        letter, a leading "B." / "(B)" / "B)", or a letter cue inside it; an answer with no letter gives None rather
        than falling back to letters mentioned while reasoning. Otherwise the text after ``</think>`` is read:
        "answer is (C)" / "Answer: C" first, then a lone letter, then the last of "(C)", "C)", "option C", a line
        starting "C.", or a final standalone capital letter. A sentence-initial article ("A cat is ...") is not a
        choice.
    """
    extracted = extract_answer(text)
    if extracted is not None:
        lone = _LONE_LETTER_RE.fullmatch(extracted)
        if lone:
            return lone.group(1).upper()
        leading = _LEADING_CHOICE_RE.match(extracted)
        if leading:
            return leading.group(1).upper()
        return _choice_in_text(extracted)
    return _choice_in_text(_final_segment(text))


def _gold_choice(gold: Any) -> str:
    """Normalise a gold letter given as "b", "(B)", "B." or "B. cat"; a malformed gold is a data bug, so raise."""
    m = _GOLD_CHOICE_RE.fullmatch(str(gold))
    if not m:
        raise ValueError(f"`multiple_choice` expects column `answer` to hold a letter A-E, got {gold!r}.")
    return m.group(1).upper()


def multiple_choice(
    prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any
) -> list[float | None]:
    """Multiple-choice accuracy.

    Reads column ``answer``: the gold letter A–E (case-insensitive; "(B)", "B." and "B. text" are accepted).
    The prediction is parsed by :func:`extract_choice`.

    Returns:
        Per completion, 1.0 if the chosen letter equals the gold letter, else 0.0; None where the gold is None.

    Raises:
        ValueError: If the ``answer`` column is missing, misaligned, or holds something that is not a letter A–E.
    """
    golds = _required_column(kwargs, "answer", "multiple_choice", len(completions))
    rewards: list[float | None] = []
    preds: list[str | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        pred = extract_choice(completion_text(completion))
        preds.append(pred)
        rewards.append(None if gold is None else float(pred is not None and pred == _gold_choice(gold)))
    _log_extra(kwargs, "multiple_choice_pred", preds)
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------------------------------

_NUMBER_WORDS = {
    word: value
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
# Hyphens count as word characters here so "twenty-one" is not read as "twenty".
_NUMBER_WORD_RE = re.compile(rf"(?<![\w-])({'|'.join(_NUMBER_WORDS)})(?![\w-])", re.IGNORECASE)


def _count_value(s: str) -> float | None:
    """Value of a string that is exactly a number or a number word (``"3"``, ``"3.5"``, ``"Three."``), else None."""
    number = parse_number(s)
    if number is not None:
        return number
    word = s.strip().strip("*_\"'`").rstrip(".").strip().lower()
    return float(_NUMBER_WORDS[word]) if word in _NUMBER_WORDS else None


def _last_count_in(text: str) -> float | None:
    """Last number in ``text``; only when there is no digit at all, the last number word.

    Digits win over words because words like "one" also occur as pronouns ("3 cats, one of them black").
    """
    last = extract_last_number(text)
    if last is not None:
        return parse_number(last)
    words = _NUMBER_WORD_RE.findall(text)
    return float(_NUMBER_WORDS[words[-1].lower()]) if words else None


def _predicted_count(text: str) -> float | None:
    """Count in a completion: answer tag / boxed content (whole, else its last number), else the last number."""
    extracted = extract_answer(text)
    if extracted is not None:
        value = _count_value(extracted)
        return value if value is not None else _last_count_in(extracted)
    return _last_count_in(_final_segment(text))


def _gold_count(gold: Any) -> int:
    """Gold count as int from an int, an integral float, or a string like "3", "3.0", "1,000" or "three"."""
    if isinstance(gold, bool):  # bool is an int subclass, but True is not a count
        raise ValueError(f"`counting` expects column `answer` to hold an integer, got {gold!r}.")
    if isinstance(gold, int):
        return gold
    value = float(gold) if isinstance(gold, float) else _count_value(str(gold))
    if value is None or not value.is_integer():
        raise ValueError(f"`counting` expects column `answer` to hold an integer, got {gold!r}.")
    return int(value)


def counting(prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """Object-counting accuracy.

    Reads column ``answer``: the gold count, an int or a string ("3", "three"). The prediction is the answer tag /
    ``\\boxed`` content, else the last number in the text after ``</think>``; number words zero–twenty count, but
    digits take precedence over words. A non-integer prediction such as "3.5" is wrong.

    Returns:
        Per completion, 1.0 if the predicted count equals the gold, else 0.0; None where the gold is None.

    Raises:
        ValueError: If the ``answer`` column is missing, misaligned, or holds a non-integer.
    """
    golds = _required_column(kwargs, "answer", "counting", len(completions))
    rewards: list[float | None] = []
    preds: list[float | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        pred = _predicted_count(completion_text(completion))
        preds.append(pred)
        if gold is None:
            rewards.append(None)
            continue
        target = _gold_count(gold)
        rewards.append(1.0 if pred is not None and pred.is_integer() and int(pred) == target else 0.0)
    _log_extra(kwargs, "counting_pred", preds)
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Bounding boxes
# ---------------------------------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
# Maximal comma-separated runs of numbers; only runs of exactly four are boxes, so "[1, 2, 3, 4, 5]" is rejected
# instead of yielding "2, 3, 4, 5". Covers "[x1, y1, x2, y2]", "(x1,y1,x2,y2)", bare "x1,y1,x2,y2" and JSON
# '{"bbox_2d": [x1, y1, x2, y2]}'.
_NUMBER_RUN_RE = re.compile(rf"(?<![\w.]){_NUM}(?:\s*,\s*{_NUM})*(?![\w.])")
# Qwen2-VL's corner-pair form "(x1,y1),(x2,y2)".
_CORNER_PAIR_RE = re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")


def _ordered(box: Sequence[float]) -> list[float]:
    """Box with corners sorted so that x1 <= x2 and y1 <= y2."""
    x1, y1, x2, y2 = (float(v) for v in box)
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def _find_box(text: str) -> list[float] | None:
    """Last box written anywhere in ``text`` (by position), in any supported notation."""
    best: tuple[int, list[float]] | None = None
    for m in _NUMBER_RUN_RE.finditer(text):
        parts = m.group(0).split(",")
        if len(parts) == 4:
            best = (m.start(), [float(p) for p in parts])
    for m in _CORNER_PAIR_RE.finditer(text):
        if best is None or m.start() > best[0]:
            best = (m.start(), [float(g) for g in m.groups()])
    return _ordered(best[1]) if best else None


def parse_box(text: str) -> list[float] | None:
    """Parse a predicted bounding box ``[x1, y1, x2, y2]`` from a completion's text.

    Args:
        text: The completion text. Accepted notations: ``[x1, y1, x2, y2]``, ``(x1, y1, x2, y2)``, bare
            ``x1,y1,x2,y2``, Qwen2.5-VL JSON ``{"bbox_2d": [x1, y1, x2, y2], ...}`` and Qwen2-VL ``(x1,y1),(x2,y2)``.

    Returns:
        The box from the answer tag if it holds one, else the last box anywhere in the text, with corners reordered
        so that x1 <= x2 and y1 <= y2; None if there is no list of exactly four numbers.
    """
    tagged = _last_answer_tag(text)
    if tagged is not None:
        box = _find_box(tagged)
        if box is not None:
            return box
    return _find_box(text)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (corners may be in either order).

    Args:
        a: First box.
        b: Second box, in the same coordinate space as ``a``.

    Returns:
        IoU in [0, 1]; 0.0 when the union has no area (degenerate boxes).
    """
    ax1, ay1, ax2, ay2 = _ordered(a)
    bx1, by1, bx2, by2 = _ordered(b)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def _gold_box(value: Any) -> list[float]:
    """Gold box from a list/tuple of four numbers, a string holding one, or a ``{"bbox_2d"|"bbox": [...]}`` dict."""
    if isinstance(value, Mapping):
        value = value.get("bbox_2d", value.get("bbox"))
    if isinstance(value, str):
        parsed = parse_box(value)
        if parsed is not None:
            return parsed
    elif isinstance(value, Sequence) and len(value) == 4:
        try:
            return _ordered([float(v) for v in value])
        except (TypeError, ValueError):
            pass
    raise ValueError(f"Column `bbox` must hold boxes [x1, y1, x2, y2], got {value!r}.")


def _image_size(value: Any) -> tuple[float, float]:
    """``(width, height)`` from a 2-sequence or a ``{"width", "height"}`` dict."""
    if isinstance(value, Mapping):
        value = (value.get("width"), value.get("height"))
    try:
        width, height = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"Column `image_size` must hold (width, height), got {value!r}.") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"Column `image_size` must hold positive (width, height), got {value!r}.")
    return width, height


def _is_normalized(box: Sequence[float]) -> bool:
    """Heuristic: a box whose coordinates all lie in [0, 1] is normalised (a 1-pixel box at the origin is not)."""
    return all(0.0 <= v <= 1.0 for v in box)


def _scale(box: Sequence[float], size: tuple[float, float]) -> list[float]:
    """Normalised box to pixels."""
    width, height = size
    return [box[0] * width, box[1] * height, box[2] * width, box[3] * height]


_COORD_MODES = ("auto", "pixel", "norm1000")


class _IoUReward:
    """Picklable IoU reward (a class, not a closure, because TRL's async rollout worker pickles reward funcs)."""

    def __init__(self, threshold: float | None, coords: str) -> None:
        self.threshold = threshold
        self.coords = coords
        name = "iou" if threshold is None else "iou_at_" + f"{threshold * 100:g}".replace(".", "_")
        self.__name__ = name if coords == "auto" else f"{name}_{coords}"
        self.__qualname__ = self.__name__
        self.__doc__ = make_iou_reward.__doc__

    def __repr__(self) -> str:
        return f"make_iou_reward(threshold={self.threshold!r}, coords={self.coords!r})"

    def _align(self, pred: list[float], gold: list[float], size: Any) -> tuple[list[float], list[float]]:
        """Bring both boxes into one coordinate space (see :func:`make_iou_reward`)."""
        if self.coords == "pixel":
            return pred, gold
        if self.coords == "norm1000":
            pred = [v / 1000.0 for v in pred]
        pred_norm, gold_norm = _is_normalized(pred), _is_normalized(gold)
        if pred_norm == gold_norm:
            return pred, gold
        if size is None:
            raise ValueError(
                f"`{self.__name__}`: one box is normalised to [0, 1] and the other is in pixels "
                f"(pred={pred}, gold={gold}); pass an `image_size` column of (width, height) to convert."
            )
        wh = _image_size(size)
        return (_scale(pred, wh), gold) if pred_norm else (pred, _scale(gold, wh))

    def __call__(
        self, prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any
    ) -> list[float | None]:
        n = len(completions)
        golds = _required_column(kwargs, "bbox", self.__name__, n)
        sizes = _column(kwargs, "image_size", n) if "image_size" in kwargs else [None] * n
        rewards: list[float | None] = []
        preds: list[list[float] | None] = []
        for completion, gold, size in zip(completions, golds, sizes, strict=True):
            pred = parse_box(completion_text(completion))
            preds.append(pred)
            if gold is None:
                rewards.append(None)
                continue
            gold_box = _gold_box(gold)
            if pred is None:  # unparseable prediction: the model failed to localise
                rewards.append(0.0)
                continue
            value = box_iou(*self._align(pred, gold_box, size))
            rewards.append(value if self.threshold is None else float(value >= self.threshold))
        _log_extra(kwargs, f"{self.__name__}_pred", preds)
        return rewards


def make_iou_reward(
    threshold: float | None = None, coords: Literal["auto", "pixel", "norm1000"] = "auto"
) -> RewardFunc:
    """Build a grounding reward comparing the predicted box with the gold box.

    The returned function reads column ``bbox`` (gold ``[x1, y1, x2, y2]``, a list, a string, or a ``bbox_2d`` dict)
    and optional column ``image_size`` (``(width, height)`` in pixels). The predicted box comes from
    :func:`parse_box`; an unparseable prediction scores 0.0 and a None gold gives None.

    Args:
        threshold: None for the continuous IoU; otherwise the reward is 1.0 when IoU >= threshold, else 0.0.
        coords: How to reconcile coordinate conventions. ``"auto"``: a box with all coordinates in [0, 1] is
            normalised, anything else is pixels; when exactly one box is normalised it is scaled to pixels by
            ``image_size``. ``"pixel"``: compare the numbers as they are (both sides share one convention, e.g.
            both absolute or both 0–1000). ``"norm1000"``: predictions use Qwen2-VL's 0–1000 grid; they are divided
            by 1000 and then treated as in ``"auto"``.

    Returns:
        A picklable reward function named ``iou`` / ``iou_at_50`` (plus ``_pixel`` / ``_norm1000`` for
        non-default ``coords``).

    Raises:
        ValueError: For a threshold outside (0, 1] or an unknown ``coords``. The returned function raises a
            ValueError naming ``image_size`` when the boxes' conventions differ and no image size is given, and one
            naming ``bbox`` when that column is missing or malformed.
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}.")
    if coords not in _COORD_MODES:
        raise ValueError(f"coords must be one of {_COORD_MODES}, got {coords!r}.")
    return _IoUReward(threshold, coords)


#: Continuous IoU between the predicted and the gold box (see :func:`make_iou_reward`).
iou = make_iou_reward()
#: 1.0 when IoU >= 0.5, else 0.0 (see :func:`make_iou_reward`).
iou_threshold = make_iou_reward(0.5)


# ---------------------------------------------------------------------------------------------------------------------
# ANLS (DocVQA)
# ---------------------------------------------------------------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions) between two strings.

    Args:
        a: First string.
        b: Second string.

    Returns:
        The Levenshtein distance, computed with a two-row DP in O(len(a) * len(b)) time and O(min) memory.
    """
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a  # keep the rows as short as possible
    if not b:
        return len(a)
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls_score(pred: str, gold: str | Sequence[str], threshold: float = 0.5) -> float:
    """ANLS of one prediction against one or several acceptable answers.

    Args:
        pred: Predicted answer.
        gold: Acceptable answer or list of acceptable answers.
        threshold: Normalised distance at or above which a pair scores 0 (0.5 in DocVQA).

    Returns:
        max over golds of ``1 - NL`` if ``NL < threshold`` else 0, with
        ``NL = levenshtein(p, g) / max(len(p), len(g))`` on lowercased, stripped, whitespace-collapsed strings (as the
        official DocVQA evaluation does). Two empty strings score 1.0; an empty gold list scores 0.0.
    """
    golds = [gold] if isinstance(gold, str) else list(gold)
    p = " ".join(pred.lower().split())
    best = 0.0
    for g in golds:
        g = " ".join(str(g).lower().split())
        longest = max(len(p), len(g))
        if longest == 0:
            return 1.0
        # The length difference is a lower bound on the distance: skip the DP when it already rules the pair out
        # (common when the model rambles without an answer tag).
        if abs(len(p) - len(g)) / longest >= threshold:
            continue
        nl = levenshtein(p, g) / longest
        if nl < threshold:
            best = max(best, 1.0 - nl)
    return best


def anls(prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """Average Normalized Levenshtein Similarity reward (DocVQA / InfographicVQA metric).

    Reads column ``answer``: an acceptable answer string or a list of them. The prediction is the last answer tag's
    content if there is one, else the stripped text after ``</think>``. See :func:`anls_score`.

    Returns:
        Per completion, the ANLS in [0, 1]; None where the gold is None or an empty list.

    Raises:
        ValueError: If the ``answer`` column is missing or misaligned.
    """
    golds = _required_column(kwargs, "answer", "anls", len(completions))
    rewards: list[float | None] = []
    preds: list[str] = []
    for completion, gold in zip(completions, golds, strict=True):
        text = completion_text(completion)
        tagged = _last_answer_tag(text)
        pred = tagged if tagged is not None else _final_segment(text).strip()
        preds.append(pred)
        if gold is None or (not isinstance(gold, str) and len(gold) == 0):
            rewards.append(None)
            continue
        rewards.append(anls_score(pred, gold))
    _log_extra(kwargs, "anls_pred", preds)
    return rewards


# ---------------------------------------------------------------------------------------------------------------------
# Closed-vocabulary answers (colour names, directions, small counts)
# ---------------------------------------------------------------------------------------------------------------------

_CHOICE_WORD_RE = re.compile(r"[\w-]+")


class _ChoiceReward:
    """Picklable closed-vocabulary reward (a class, not a closure: TRL's async rollout worker pickles rewards)."""

    def __init__(self, choices: Sequence[str], name: str) -> None:
        self.choices = {_normalize_text(str(c)) for c in choices}
        if not self.choices or "" in self.choices:
            raise ValueError("choices must be a non-empty list of non-empty answers, e.g. ['red', 'green', 'blue'].")
        self.__name__ = self.__qualname__ = name

    def __repr__(self) -> str:
        return f"make_choice_reward({sorted(self.choices)!r}, name={self.__name__!r})"

    def named(self, text: str) -> set[str]:
        """The candidate answers a completion names (answer tag first, else the text after any </think>)."""
        tagged = extract_answer(text)
        span = tagged if tagged is not None else _final_segment(text)
        return {w for w in (_normalize_text(m) for m in _CHOICE_WORD_RE.findall(span)) if w in self.choices}

    def __call__(self, prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any):
        golds = _required_column(kwargs, "answer", self.__name__, len(completions))
        rewards: list[float | None] = []
        predictions = []
        for completion, gold in zip(completions, golds, strict=True):
            named = self.named(completion_text(completion))
            predictions.append(" ".join(sorted(named)))
            if gold is None:
                rewards.append(None)
                continue
            gold_word = _normalize_text(str(gold))
            if gold_word not in self.choices:
                raise ValueError(f"`{self.__name__}`: gold answer {gold!r} is not one of the choices {sorted(self.choices)}.")
            # Exactly one candidate, the right one: naming every colour must not score.
            rewards.append(1.0 if named == {gold_word} else 0.0)
        _log_extra(kwargs, f"{self.__name__}_pred", predictions)
        return rewards


def make_choice_reward(choices: Sequence[str], name: str = "choice_accuracy") -> RewardFunc:
    """Accuracy for closed-vocabulary answers: 1.0 when the completion names exactly one of `choices`, the gold one.

    Reads column ``answer``. The answer tag is searched first, else the text after any ``</think>``; words are
    compared case-insensitively. Naming two candidates ("red or blue") scores 0.0, so listing every option
    cannot be rewarded. Unlike :func:`answer_accuracy` a short sentence around the word is fine ("it is red").

    Returns:
        A picklable reward function called ``name``. It raises ValueError when ``answer`` is missing or a gold
        answer is not among the choices (a data bug, not a wrong completion).
    """
    return _ChoiceReward(choices, name)
