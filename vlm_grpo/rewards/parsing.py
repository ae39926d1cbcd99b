"""Where the final answer is in a completion: answer tags, ``\\boxed{}``, an explicit "Answer:" marker, the conclusion.

Every reward reads its prediction through these few functions, so they agree on what "the answer" is: the content of
the last ``<answer>…</answer>`` tag (or the ``\\boxed{}`` inside it); else the last balanced ``\\boxed{…}``; else the
text after the last ``</think>``. All of it is read in the conclusion (:func:`conclusion`), never in the reasoning: a
value boxed or tagged while thinking is not the answer, and a completion cut off while thinking, with nothing after
``</think>``, or cut off inside an ``<answer>`` tag has none (each of these was graded on the whole text, so a number
named while reasoning was paid for). A chat template that opens the thinking in the prompt (Qwen3.5's thinking
variant, Qwen3-VL-Thinking, DeepSeek-R1's distills end the generation prompt with ``<think>``) leaves the completion
without its opening tag; :func:`with_opened_thinking` gives it back, so such a completion cut off while reasoning has
no conclusion either (it was graded on its whole text).
"""

from __future__ import annotations

import re

__all__ = ["answer_marker", "answer_span", "conclusion", "extract_answer", "final_segment", "last_answer_tag",
           "last_boxed", "opens_thinking", "strip_latex_text", "with_opened_thinking"]  # fmt: skip

# The body may not contain another "<answer>", so for "<answer>a<answer>b</answer>" we get "b", not "a<answer>b".
_ANSWER_TAG_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED_START_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: 3", "the answer is (C)", "**Final answer:** 7", "Answer = 12".
_MARKER_RE = re.compile(r"(?i:answer)\**\s*(?:(?i:is)\b|[:=])[\s:*]*")
# A sentence ends at ".", "!", "?" or ";" followed by whitespace (so "1.5" and "$1.5$" survive) or at a line break.
_SENTENCE_END_RE = re.compile(r"[.!?;](?=\s)|\n")
_THINK_OPEN_RE = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE_RE = re.compile(r"</think>", re.IGNORECASE)
_ANSWER_OPEN_RE = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE_RE = re.compile(r"</answer>", re.IGNORECASE)
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def last_answer_tag(text: str) -> str | None:
    """Stripped content of the last complete ``<answer>…</answer>`` tag, or None."""
    matches = _ANSWER_TAG_RE.findall(text)
    return matches[-1].strip() if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{…}`` (nested braces allowed), or None.

    Braces are counted because a regex cannot match ``\\boxed{\\frac{1}{2}}``; an unbalanced (truncated) last box is
    skipped in favour of an earlier complete one.
    """
    for start in reversed([m.end() for m in _BOXED_START_RE.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def conclusion(text: str) -> str:
    """The part of a completion after its reasoning: the text after the last ``</think>`` (in any case); the whole text
    when it has no ``<think>`` tag (no reasoning, or a chat template that opened the thinking in the prompt); "" when a
    ``<think>`` is left open at the end (cut off while reasoning: there is no conclusion yet)."""
    closes = list(_THINK_CLOSE_RE.finditer(text))
    tail = text[closes[-1].end() :] if closes else text
    return "" if _THINK_OPEN_RE.search(tail) else tail


def opens_thinking(prompt: str) -> bool:
    """True when a rendered prompt ends with an opened ``<think>`` (whitespace after it allowed): the chat template
    started the model's reasoning, so its completion begins inside it. A ``<think>`` in the user's own text is never
    at the end (the template's assistant marker follows it)."""
    return prompt.rstrip().lower().endswith("<think>")


def with_opened_thinking(text: str) -> str:
    """A completion whose prompt opened the thinking (:func:`opens_thinking`), with that ``<think>`` in front: the text
    the model's reasoning and answer read as, for :func:`conclusion` and the format rewards. Unchanged when it opens
    one itself."""
    return text if _THINK_OPEN_RE.match(text.lstrip()) else "<think>" + text


def extract_answer(text: str) -> str | None:
    """The explicitly delimited final answer of a completion, read in its :func:`conclusion`.

    Returns:
        The content of the last ``<answer>`` tag (its ``\\boxed{}`` part if it has one, so
        ``<answer>\\boxed{5}</answer>`` gives ``"5"``); else the content of the last balanced ``\\boxed{…}``; else
        None (also for a tag or box inside the thinking only).
    """
    text = conclusion(text)
    tagged = last_answer_tag(text)
    if tagged is not None:
        boxed = last_boxed(tagged)
        return boxed if boxed is not None else tagged
    return last_boxed(text)


def final_segment(text: str) -> str:
    """The :func:`conclusion`, or "" when it ends inside an ``<answer>`` tag never closed: cut off while answering,
    ``<answer>7`` may have been going to say 75."""
    text = conclusion(text)
    opened = [m.start() for m in _ANSWER_OPEN_RE.finditer(text)]
    closed = [m.start() for m in _ANSWER_CLOSE_RE.finditer(text)]
    if opened and (not closed or opened[-1] > closed[-1]):
        return ""
    return text


def answer_marker(text: str, sentence: bool = True) -> str | None:
    """The sentence after the last explicit answer marker ("Answer: 3.", "the answer is C"), stripped, or None.

    An explicit marker is a commitment: in "Answer: 3. There are 2 big ones and 1 small one." it is what counts.
    `sentence=False`: the rest of the marker's line instead, less a final ".", "!" or "?" (free text such as
    "Answer: St. Louis." keeps its inner full stops).
    """
    matches = list(_MARKER_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    end = _SENTENCE_END_RE.search(rest) if sentence else re.search(r"\n", rest)
    found = (rest[: end.start()] if end else rest).strip().strip("*").strip()
    return (found if sentence else found.rstrip(".!?").strip()) or None


def answer_span(text: str) -> str:
    """The part of a completion that holds its answer: :func:`extract_answer`, else the marked sentence, else the
    stripped conclusion (:func:`final_segment`)."""
    extracted = extract_answer(text)
    if extracted is not None:
        return extracted
    segment = final_segment(text)
    marked = answer_marker(segment)
    return marked if marked is not None else segment.strip()


def strip_latex_text(s: str) -> str:
    """``\\text{B}`` -> ``B``, ``\\mathrm{cm}`` -> ``cm``: LaTeX text wrappers removed, their content kept."""
    return _TEXT_WRAPPER_RE.sub(r"\1", s)
