import pytest

from vlm_grpo.reward_checks import RewardFunctionError, checked_reward_func


def test_valid_rewards_pass_through_with_name_and_signature():
    def my_reward(prompts, completions, answer, **kwargs):
        return [1.0 if c == a else None for c, a in zip(completions, answer)]

    checked = checked_reward_func(my_reward)
    assert checked.__name__ == "my_reward"
    assert checked(prompts=["p", "q"], completions=["x", "y"], answer=["x", "z"]) == [1.0, None]
    assert checked_reward_func(checked) is checked  # idempotent


def test_raise_names_function_and_first_failing_row():
    def picky(prompts, completions, **kwargs):
        return [float(c) for c in completions]

    with pytest.raises(RewardFunctionError, match=r"'picky' raised ValueError.*on row 2 \(completion 'oops'\)"):
        checked_reward_func(picky)(prompts=["a"] * 3, completions=["1", "2", "oops"])


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
