import pickle

import pytest

from vlm_grpo.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    reasoning_accuracy_reward,
    resolve_reward,
    reward_columns,
)

BOXED_WHILE_THINKING = r"<think>so it is \boxed{7}"  # cut off while reasoning
BOXED_INSIDE_THINKING = r"<think>\boxed{7}</think> I do not know"
CONCLUDED = r"<think>3 + 4</think> The answer is \boxed{7}"


def test_accuracy_reward_grades_the_conclusion_only():
    # TRL's reads the whole text with Math-Verify's first match: both thinking-only completions were paid 1.0.
    completions = [BOXED_WHILE_THINKING, BOXED_INSIDE_THINKING, CONCLUDED, [{"role": "assistant", "content": "7"}]]
    assert accuracy_reward(completions, ["7"] * 4) == [0.0, 0.0, 1.0, 0.0]  # TRL wants LaTeX: a bare 7 is not read
    assert accuracy_reward([r"\boxed{8}"], ["7"]) == [0.0]


def test_a_prompt_that_opened_the_thinking_is_read_with_it():
    completions = [r"so it is \boxed{7}", r"3 + 4 is 7</think> \boxed{7}"]
    opened = {"prompt_opens_thinking": [True, True]}
    assert accuracy_reward(completions, ["7"] * 2, **opened) == [0.0, 1.0]
    assert reasoning_accuracy_reward(completions, ["7"] * 2, **opened) == [0.0, 1.0]
    assert accuracy_reward(completions[:1], ["7"]) == [1.0]  # not opened: a plain answer


def test_the_cosine_reward_grades_the_conclusion_and_pickles():
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward([BOXED_WHILE_THINKING, CONCLUDED], ["7"] * 2, [[1] * 50] * 2) == [-0.75, 0.75]
    assert pickle.loads(pickle.dumps(reward))([CONCLUDED], ["7"], [[1] * 50]) == [0.75]
    assert reward_columns(reward) == ("solution",)


def test_by_name_the_wrapped_rewards_and_not_the_helpers():
    assert resolve_reward("accuracy_reward") is accuracy_reward
    assert reward_columns(accuracy_reward) == ("solution",)
    with pytest.raises(ValueError, match="unknown reward"):  # a helper taking `completions`, not a reward
        resolve_reward("completion_texts")
