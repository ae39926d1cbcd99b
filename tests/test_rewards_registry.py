"""vlm_grpo.rewards.registry: rewards by name or import path, and the gold columns each reads."""

import doctest
import sys

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


def test_an_import_path_finds_a_module_in_the_current_directory_as_a_script_would(tmp_path, monkeypatch):
    # `--reward_funcs my_rewards:shape_choice` from the folder holding my_rewards.py, no PYTHONPATH (issue 40).
    monkeypatch.setattr(sys, "path", list(sys.path))  # resolve_reward puts the working directory on it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_rewards_ok.py").write_text("def shape_choice(prompts, completions, **kw):\n    return [1.0]\n")
    func = resolve_reward("cwd_rewards_ok:shape_choice")
    assert func.__name__ == "shape_choice" and func(None, ["x"]) == [1.0]
    assert str(tmp_path) in sys.path


def test_an_import_failing_inside_your_module_is_named_not_hidden(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_rewards_broken.py").write_text('"""Mine."""\nimport no_such_dependency_xyz\n')
    with pytest.raises(ValueError) as error:
        resolve_reward("cwd_rewards_broken:score")
    assert str(error.value) == (
        "reward 'cwd_rewards_broken:score': importing cwd_rewards_broken failed: ModuleNotFoundError: No module named "
        f"'no_such_dependency_xyz' ({tmp_path / 'cwd_rewards_broken.py'} line 2)."
    )
    with pytest.raises(ValueError, match=f"no module 'cwd_rewards_absent' in the current directory {tmp_path} nor"):
        resolve_reward("cwd_rewards_absent:score")
    with pytest.raises(ValueError, match="module 'vlm_grpo.rewards' has no attribute 'no_such_reward'"):
        resolve_reward("vlm_grpo.rewards:no_such_reward")
