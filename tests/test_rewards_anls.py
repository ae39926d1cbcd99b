"""anls: DocVQA's ANLS on the answer tag or the conclusion (edit distance from rapidfuzz)."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import anls, anls_score

# (label, prediction, gold(s), expected ANLS)
SCORES = [
    ("one substitution in three", "abX", "abc", 2 / 3),
    ("NL exactly 0.5 is cut off", "aX", "ab", 0.0),
    ("case and whitespace", "  HeLLo   World ", "hello world", 1.0),
    ("max over golds", "hellp", ["goodbye", "hello"], 0.8),
    ("both empty", "", "", 1.0),
    ("empty prediction", "", "abc", 0.0),
    ("empty gold list", "x", [], 0.0),
    ("transposition costs two", "ab", "ba", 0.0),
    ("kitten/sitting", "kitten", "sitting", 1 - 3 / 7),
    ("insertion", "colour", "color", 1 - 1 / 6),
    ("long ramble", "word " * 2000, "cat", 0.0),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), [c[1:] for c in SCORES], ids=[c[0] for c in SCORES])
def test_anls_score(pred: str, gold, expected: float) -> None:
    assert anls_score(pred, gold) == pytest.approx(expected)


def test_anls_reward_reads_the_answer_and_skips_missing_golds() -> None:
    completions = ["<answer>Hello</answer>", [{"role": "assistant", "content": "hellp"}], "xyz",
                   "<think>it says 'total'</think> <answer>$1,234</answer>", "<think>r</think> Hello", "a", "a"]  # fmt: skip
    golds = [["hello", "hi"], "hello", "abc", ["$1,234", "1234"], "hello", None, []]
    assert anls(None, completions, answer=golds) == [1.0, pytest.approx(0.8), 0.0, 1.0, 1.0, None, None]


def test_anls_reads_the_answer_where_the_other_rewards_do() -> None:
    # It read only the answer tag, else the whole conclusion: "Answer: Paris" scored 0 against "Paris" (the marker's
    # 8 characters put the distance over 0.5), and a boxed answer kept its LaTeX.
    completions = ["Answer: Paris", r"<answer>\boxed{\text{Paris}}</answer>", r"so it is \boxed{Paris}",
                   "<think>a map</think>The answer is St. Louis.", "Paris"]  # fmt: skip
    assert anls(None, completions, answer=["Paris", "Paris", "Paris", "St. Louis", "Paris"]) == [1.0] * 5


def test_anls_reads_numbers_markup_and_a_closing_full_stop() -> None:
    # A numeric gold (JSON / Parquet) raised TypeError; "7." / "**7**" / "$7$" scored 0 against 7 while "Answer: 7."
    # scored 1; a full stop that belongs to the answer ("U.S.") still counts.
    completions = ["7.", "**7**", "$7$", "No.", "<answer>3.5</answer>", "U.S.", "$1,234"]
    golds = [7, "7", ["7"], "no", 3.5, "U.S.", "$1,234"]
    assert anls(None, completions, answer=golds) == [1.0] * 7
    assert anls(None, ["8"], answer=[7]) == [0.0]
