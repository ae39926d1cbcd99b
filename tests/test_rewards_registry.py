"""vlm_grpo.rewards.registry: rewards by name or import path, and the gold columns each reads."""

import doctest

import pytest

import vlm_grpo.rewards as R
from vlm_grpo.rewards import registry, resolve_reward, reward_columns, reward_names


def test_names_are_the_trl_signature_rewards_only():
    names = reward_names()
    assert {"answer_accuracy", "think_answer_format", "iou", "counting", "anls", "accuracy_reward"} <= set(names)
    # Factories, helpers and the registry itself take no `completions`: they are not rewards.
    assert not {"make_choice_reward", "batch_reward", "resolve_reward", "reward_columns", "BatchReward"} & set(names)
    assert names == sorted(names)


def test_a_reward_resolves_by_name_and_by_import_path_to_the_same_function():
    assert resolve_reward("anls") is R.anls
    assert resolve_reward("vlm_grpo.rewards:anls") is R.anls
    assert resolve_reward("vlm_grpo.rewards.anls") is R.anls
    assert resolve_reward("test_rewards_adaptor:exact").__name__ == "exact"  # a user's own, by path


def test_unknown_or_unimportable_rewards_say_what_to_give():
    with pytest.raises(ValueError, match="unknown reward 'nope'; choose from .*answer_accuracy.* pkg.mod:fn"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="reward 'no_such_pkg.mod:fn': cannot import it"):
        resolve_reward("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="cannot import it"):
        resolve_reward("vlm_grpo.rewards:no_such_reward")


def test_gold_columns_are_declared_or_named_in_the_signature():
    assert reward_columns(R.answer_accuracy) == ("answer", "solution")  # BatchReward.gold_columns
    assert reward_columns(R.make_choice_reward(["a", "b"])) == ("answer",)
    assert reward_columns(R.think_answer_format) == ()
    assert reward_columns(R.accuracy_reward) == ("solution",)  # TRL's: (completions, solution, log_extra=None, ...)
    assert reward_columns(R.think_format_reward) == ()

    def mine(prompts, completions, answer, *, bbox, hint=None, trainer_state=None, **kwargs):
        return [0.0] * len(completions)

    assert reward_columns(mine) == ("answer", "bbox")  # defaults, **kwargs and TRL's keywords are not columns


def test_the_module_example_runs():
    assert doctest.testmod(registry).failed == 0
