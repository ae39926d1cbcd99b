"""batch_reward: the one adaptor from per-sample scorers to TRL reward functions."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import vlm_grpo.rewards as R
from vlm_grpo.rewards import batch_reward, completion_text, extract_answer


@batch_reward(gold_column="answer", prediction=extract_answer)
def exact(text: str, gold: Any, /, **row: Any) -> float:
    """A ten-line reward: the answer tag equals the gold."""
    return float(extract_answer(text) == str(gold))


def test_completion_text_formats() -> None:
    assert completion_text("plain") == "plain"
    blocks = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, "b"]}]
    assert completion_text(blocks) == "ab"
    assert completion_text({"role": "assistant", "content": "single"}) == "single"
    assert completion_text([{"content": "no role"}]) == "no role"
    turns = [{"role": "assistant", "content": None}, {"role": "tool", "content": "999"},
             {"role": "assistant", "content": "7"}]  # fmt: skip
    assert completion_text(turns) == "\n7"  # tool output is not the model's
    with pytest.raises(TypeError):
        completion_text(42)  # type: ignore[arg-type]


def test_loop_none_golds_and_chat_completions() -> None:
    completions = ["<answer>1</answer>", [{"role": "assistant", "content": "<answer>2</answer>"}], "<answer>3</answer>"]
    assert exact(["p"] * 3, completions, answer=["1", "2", None], trainer_state=object()) == [1.0, 1.0, None]


def test_column_errors_name_the_column() -> None:
    with pytest.raises(ValueError, match="column named `answer`"):
        exact(None, ["1"], label=["1"])
    with pytest.raises(ValueError, match="`answer` has 1 values but there are 2 completions"):
        exact(None, ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="`image_size` has 1 values"):  # a declared optional column must align too
        R.iou(None, ["[0, 0, 1, 1]"] * 2, bbox=[[0, 0, 1, 1]] * 2, image_size=[(10, 10)])


def test_scorer_sees_its_row_even_with_columns_named_text_or_gold() -> None:
    seen = []

    @batch_reward(gold_column="answer")
    def spy(text: str, gold: Any, /, **row: Any) -> float:
        seen.append((text, gold, row))
        return 0.0

    spy(["q"], ["c"], answer=["a"], text=["t"], gold=["g"], completion_ids=[[1]], log_metric=print)
    assert seen == [("c", "a", {"text": "t", "gold": "g", "prompt": "q"})]


def test_thinking_column_reaches_the_text_not_the_scorer() -> None:
    seen = []

    @batch_reward(gold_column="answer")
    def spy(text: str, gold: Any, /, **row: Any) -> float:
        seen.append((text, row))
        return 0.0

    spy(["q", "q"], ["a</think>b", "c"], answer=["1", "1"], **{R.THINKING_COLUMN: [True, False]})
    assert seen == [("<think>a</think>b", {"prompt": "q"}), ("c", {"prompt": "q"})]
    with pytest.raises(ValueError, match=f"`{R.THINKING_COLUMN}` has 1 values"):
        spy(None, ["a", "b"], answer=["1", "1"], **{R.THINKING_COLUMN: [True]})


def test_predictions_are_logged_in_trls_completions_table() -> None:
    logged: dict[str, list[str]] = {}
    exact(None, ["<answer>4</answer>", "none"], answer=["4", "5"],
          log_extra=lambda column, values: logged.setdefault(column, values))  # fmt: skip
    assert logged == {"exact_pred": ["4", ""]}


def test_rewards_pickle_for_trls_async_worker() -> None:
    for reward in (R.answer_accuracy, R.counting, R.anls, R.think_answer_format, R.iou):
        assert pickle.loads(pickle.dumps(reward)) is reward
    assert pickle.loads(pickle.dumps(exact))(None, ["<answer>1</answer>"], answer=["1"]) == [1.0]


def test_every_reward_scores_each_completion_against_its_own_row() -> None:
    # One string and one chat completion; each reward pays exactly one of them, so a value for the wrong row (or a
    # chat completion not read) would show.
    completions = ["<think>t</think><answer>A</answer>", [{"role": "assistant", "content": "[0, 0, 1, 1]"}]]
    columns = {"answer": ["A", "B"], "bbox": [[0, 0, 1, 1]] * 2, "completion_ids": [[1], [2]]}
    for fn in (R.think_answer_format, R.multiple_choice, R.anls, R.answer_accuracy):
        assert fn(["p", "q"], completions, **columns) == [1.0, 0.0], fn.__name__
    for fn in (R.iou, R.iou_threshold):
        assert fn(["p", "q"], completions, **columns) == [0.0, 1.0], fn.__name__
