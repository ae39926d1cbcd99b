import pytest

from vlm_grpo.rewards.checks import RewardFunctionError, checked_reward_func


def test_valid_rewards_pass_through_with_name_and_signature():
    def my_reward(prompts, completions, answer, **kwargs):
        return [1.0 if c == a else None for c, a in zip(completions, answer)]

    checked = checked_reward_func(my_reward)
    assert checked.__name__ == "my_reward"
    assert checked(prompts=["p", "q"], completions=["x", "y"], answer=["x", "z"]) == [1.0, None]
    assert checked_reward_func(checked) is checked  # idempotent


def test_raise_names_function_its_line_and_the_first_failing_row_with_its_prompt():
    def picky(prompts, completions, **kwargs):
        return [float(c) for c in completions]

    with pytest.raises(RewardFunctionError) as raised:
        checked_reward_func(picky)(prompts=["a", "b", [{"role": "user", "content": [{"type": "image"},
                                                                                  {"type": "text", "text": "Why?"}]}]],
                                   completions=["1", "2", "oops\nmore"])  # fmt: skip
    line = picky.__code__.co_firstlineno + 1
    assert str(raised.value) == (
        f"Reward function 'picky' raised ValueError: could not convert string to float: 'oops\\nmore' "
        f"(test_reward_checks.py line {line}) on row 2 of the batch (completion 'oops\\nmore'; prompt 'Why?'); fix "
        "the function, or return None for rows it cannot score."
    )
    raised.value.origin = "data.jsonl line 7"  # what the trainer adds for a row read from a file
    assert "(completion 'oops\\nmore'; prompt 'Why?'; data.jsonl line 7); fix" in str(raised.value)


@pytest.mark.parametrize(
    "values, message",
    [([1.0], "returned 1 value for 2 completions"), (None, "returned None for 2"),
     ([1.0, float("nan")], "returned nan for row 1"), ([float("inf"), 0.0], "returned inf for row 0"),
     (["high", 0.0], "returned 'high' for row 0")],
)  # fmt: skip
def test_bad_return_values_are_named(values, message):
    def bad(prompts, completions, **kwargs):
        return values

    with pytest.raises(RewardFunctionError, match=message):
        checked_reward_func(bad)(prompts=["a", "b"], completions=["x", "y"])


def test_async_functions_are_left_to_trl():
    async def later(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    assert checked_reward_func(later) is later
