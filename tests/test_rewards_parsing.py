"""parsing: every reward reads the answer in the conclusion, never in the reasoning or in an answer cut off."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import (
    THINKING_COLUMN,
    anls,
    answer_accuracy,
    conclusion,
    counting,
    multiple_choice,
    opens_thinking,
    parse_box,
    with_opened_thinking,
)

# (label, completion, paid for 7?)
CASES = [
    ("plain text", "7", True),
    ("after the thinking", "<think>maybe 6</think> 7", True),
    ("tagged after the thinking", "<think>x</think><answer>7</answer>", True),
    ("thinking opened by the chat template", "it is 6... no\n</think>\n\n7", True),
    ("only in the thinking", "<think>It is 7</think>", False),
    ("only in the thinking, blank after", "<think>It is 7</think>\n  ", False),
    ("cut off while thinking", "<think>I count 7 so far and", False),
    ("cut off while thinking again", "<think>a</think> 8 <think>no, 7", False),
    ("cut off inside the answer", "<think>x</think><answer>7", False),
    ("cut off inside the answer, no thinking", "<answer>7", False),
    ("tag only inside the thinking", "<think>x<answer>7</answer></think>", False),
    ("box in the thinking, another conclusion", "<think>\\boxed{7}?</think> The answer is 8", False),
    ("two thinking blocks", "<think>a</think> b <think>c</think> 7", True),
    ("tags in capitals", "<THINK>maybe 6</Think> 7", True),
    ("only in capitalised thinking", "<THINK>It is 7</THINK>", False),
]


@pytest.mark.parametrize("text, paid", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_answer_read_in_the_conclusion(text: str, paid: bool) -> None:
    expected = [1.0 if paid else 0.0]
    assert answer_accuracy(None, [text], answer=["7"]) == expected
    assert counting(None, [text], answer=[7]) == expected
    assert anls(None, [text], answer=["7"]) == expected


def test_choice_and_box_read_in_the_conclusion() -> None:
    assert multiple_choice(None, ["<think>(B)?</think>"], answer=["B"]) == [0.0]
    assert multiple_choice(None, ["<think>(A)?</think> (B)"], answer=["B"]) == [1.0]
    assert parse_box("<think><answer>[1, 2, 3, 4]</answer></think>") is None
    assert parse_box("<think>x</think><answer>[1, 2, 3, 4]</answer>") == [1, 2, 3, 4]
    assert parse_box("<think>x</think><answer>[1, 2, 3, 4") is None


def test_conclusion() -> None:
    assert conclusion("<think>a</think>b") == "b"
    assert conclusion("no tags") == "no tags"
    assert conclusion("<think>a") == ""
    assert conclusion("<think>a</think>\n") == "\n"


# (label, completion of a prompt whose chat template opened `<think>`, paid for 7?)
OPENED_CASES = [
    ("cut off while thinking", "I count 7 so far and", False),  # no tag at all: was graded on its whole text
    ("concluded", "it is 6... no\n</think>\n\n7", True),
    ("concluded otherwise", "maybe 7</think> 8", False),
    ("tagged after the thinking", "x</think><answer>7</answer>", True),
    ("the model opened it again itself", "<think>maybe 6</think> 7", True),
]


@pytest.mark.parametrize("text, paid", [c[1:] for c in OPENED_CASES], ids=[c[0] for c in OPENED_CASES])
def test_answer_read_in_the_conclusion_when_the_prompt_opened_the_thinking(text: str, paid: bool) -> None:
    expected = [1.0 if paid else 0.0]
    opened = {THINKING_COLUMN: [True]}
    assert answer_accuracy(None, [text], answer=["7"], **opened) == expected
    assert counting(None, [text], answer=[7], **opened) == expected
    assert anls(None, [text], answer=["7"], **opened) == expected
    assert multiple_choice(None, [text.replace("7", "(B)")], answer=["B"], **opened) == expected
    # A row whose prompt did not open it reads as before: no tag, no reasoning.
    assert answer_accuracy(None, ["I count 7"], answer=["7"], **{THINKING_COLUMN: [False]}) == [1.0]


def test_opens_thinking_reads_only_the_end_of_the_prompt() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert opens_thinking("Assistant: <THINK>")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not opens_thinking("Reason inside <think> tags.<|im_end|>\n<|im_start|>assistant\n")  # the user's text
    assert with_opened_thinking("a</think>b") == "<think>a</think>b"
    assert with_opened_thinking("\n<think>a</think>b") == "\n<think>a</think>b"  # opened again: left as it is
