"""Format rewards: think_answer_format, and TRL's think_format_reward on string completions too."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import THINKING_COLUMN, think_answer_format, think_format_reward

CASES = [
    ("multi-line body", "<think>step 1\nstep 2</think>\n<answer>42</answer>", 1.0),
    ("surrounding whitespace", "  \n<think>x</think><answer>y</answer>\n ", 1.0),
    ("no answer", "<think>x</think>", 0.0),
    ("no think", "<answer>y</answer>", 0.0),
    ("trailing text", "<think>x</think><answer>y</answer> trailing text", 0.0),
    ("leading text", "Sure! <think>x</think><answer>y</answer>", 0.0),
    ("two answers", "<think>x</think><answer>y</answer><answer>z</answer>", 0.0),
    ("nested think", "<think>a<think>b</think><answer>y</answer>", 0.0),
    ("wrong order", "<answer>y</answer><think>x</think>", 0.0),
    ("unclosed answer", "<think>x</think><answer>y", 0.0),
    ("an answer inside the thinking", "<think>x<answer>7</answer></think><answer>7</answer>", 0.0),
    ("empty answer", "<think>x</think><answer> \n</answer>", 0.0),  # the layout paid for saying nothing
    ("empty thinking", "<think></think><answer>y</answer>", 1.0),  # as TRL's think_format_reward allows
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_think_answer_format(text: str, expected: float) -> None:
    assert think_answer_format(None, [text]) == [expected]
    assert think_answer_format(None, [[{"role": "assistant", "content": text}]]) == [expected]


def test_think_format_reward_accepts_strings_and_chat() -> None:
    # TRL's own raises TypeError on a plain string (it indexes completion[0]["content"]).
    strings = ["<think>r</think> a", "no think"]
    assert think_format_reward(strings) == [1.0, 0.0]
    assert think_format_reward(completions=[[{"role": "assistant", "content": s}] for s in strings], prompts=None) == [
        1.0,
        0.0,
    ]


def test_format_rewards_read_the_think_the_prompt_opened() -> None:
    # Under a template that ends the prompt with `<think>`, a well-formed completion has only the closing tag.
    texts = ["x</think><answer>7</answer>", "<answer>7</answer>", "<think>x</think><answer>7</answer>"]
    opened = {THINKING_COLUMN: [True] * 3}
    assert think_answer_format(None, texts) == [0.0, 0.0, 1.0]
    assert think_answer_format(None, texts, **opened) == [1.0, 0.0, 1.0]
    assert think_format_reward(texts, **opened) == [1.0, 0.0, 1.0]
