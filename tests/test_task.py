"""vlm_grpo.cli.task: the training rows, held-out rows and rewards bundled; each synthetic task scores its own answers."""

import json

import pytest
from PIL import Image

from vlm_grpo.cli.task import SYNTHETIC_REWARDS, Task, dataset_task, default_accuracy, synthetic_task
from vlm_grpo.data import TASKS
from vlm_grpo.data.load import DatasetError
from vlm_grpo.rewards import (
    accuracy_reward,
    answer_accuracy,
    answer_choice,
    counting,
    iou,
    think_answer_format,
    think_format_reward,
)


def test_every_synthetic_task_has_its_own_reward():
    assert set(SYNTHETIC_REWARDS) == set(TASKS)


@pytest.mark.parametrize("name", TASKS)
def test_a_synthetic_task_pays_its_gold_answers_and_not_a_wrong_one(name):
    task = synthetic_task(name, train_size=3, test_size=2, difficulty=2)
    assert task.reward_funcs == [task.accuracy] and task.eval_funcs == [task.accuracy]
    assert task.name == f"synthetic task '{name}'" and len(task.train) == 3 and len(task.test) == 2
    rows = task.train.to_dict()
    columns = {k: v for k, v in rows.items() if k != "prompt"}
    assert task.accuracy(rows["prompt"], rows["answer"], **columns) == [1.0] * 3  # the gold answer, as completion
    assert task.accuracy(rows["prompt"], ["I cannot tell"] * 3, **columns) == [0.0] * 3
    # The tiny model's vocabulary can say every answer.
    assert all(w in task.answer_words for answer in rows["answer"] for w in answer.strip("[]").split(", "))


def test_answer_columns_come_from_what_the_rewards_declare():
    task = synthetic_task("locate", train_size=1, test_size=1).with_reward(think_answer_format, 0.5)
    assert task.accuracy is iou
    assert task.answer_columns == {"iou": ("bbox",)}  # the format reward reads none
    assert synthetic_task("color", train_size=1, test_size=1).answer_columns == {"choice_accuracy": ("answer",)}


def test_a_reward_reading_a_column_the_rows_lack_is_refused_before_training():
    with pytest.raises(DatasetError, match=r"iou reads `bbox`, which the training rows lack \(columns: answer, image"):
        synthetic_task("color", train_size=1, test_size=1, reward_funcs=[iou])
    # A plain TRL function names its columns in its signature: accuracy_reward(completions, solution, ...).
    with pytest.raises(DatasetError, match=r"accuracy_reward reads `solution`"):
        synthetic_task("color", train_size=1, test_size=1, reward_funcs=[accuracy_reward])

    def both(prompts, completions, answer, bbox, **kwargs):  # needs both columns; the colour rows have one
        return [0.0] * len(completions)

    with pytest.raises(DatasetError, match=r"both reads `answer` and `bbox`"):
        synthetic_task("color", train_size=1, test_size=1, reward_funcs=[both])


def test_the_accuracy_reward_is_chosen_not_guessed_from_names():
    # Without a choice: the first reward that reads a gold answer; a format reward reads none.
    assert default_accuracy([think_answer_format, answer_accuracy]) is answer_accuracy
    assert default_accuracy([think_format_reward, accuracy_reward]) is accuracy_reward  # plain TRL functions too
    assert default_accuracy([counting, answer_accuracy]) is counting  # names play no part
    assert default_accuracy([think_answer_format]) is think_answer_format
    # A chosen accuracy reward goes first in evaluation, even one that is not trained on.
    task = synthetic_task("count", train_size=1, test_size=1, reward_funcs=[think_answer_format], accuracy=counting)
    assert task.reward_funcs == [think_answer_format] and task.eval_funcs == [counting, think_answer_format]


def test_with_reward_adds_a_weighted_reward_and_leaves_the_task_as_it_was():
    task = synthetic_task("color", train_size=1, test_size=1)
    graded = task.with_reward(think_answer_format, weight=0.5)
    assert graded.reward_funcs == [task.accuracy, think_answer_format] and graded.reward_weights == [1.0, 0.5]
    assert graded.accuracy is task.accuracy and graded.train is task.train
    assert task.reward_funcs == [task.accuracy] and task.reward_weights is None


def test_a_task_refuses_mismatched_weights_and_no_rewards():
    with pytest.raises(ValueError, match="2 reward weight"):
        Task("t", None, None, [answer_accuracy], answer_accuracy, reward_weights=[1.0, 0.5])
    with pytest.raises(ValueError, match="at least one reward"):
        Task("t", None, None, [], answer_accuracy)


def _jsonl(tmp_path, rows):
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            Image.new("RGB", (16, 16), (40 * i % 256, 0, 0)).save(tmp_path / f"{i}.png")
            f.write(json.dumps({"image": f"{i}.png", **row}) + "\n")
    return str(path)


def test_dataset_task_scores_answers_by_default_and_holds_rows_out(tmp_path):
    path = _jsonl(tmp_path, [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)])
    task = dataset_task(path, test_size=2)
    assert task.name == "train.jsonl" and len(task.train) == 8 and len(task.test) == 2
    assert task.reward_funcs == [answer_accuracy] and task.accuracy is answer_accuracy
    graded = dataset_task(path, reward_funcs=[think_answer_format, counting], reward_weights=[0.5, 1.0], test_size=0)
    assert graded.test is None and graded.accuracy is counting and graded.reward_weights == [0.5, 1.0]


def test_dataset_task_words_are_every_word_of_the_prompts_and_answers_held_out_too(tmp_path):
    # What an offline tiny model needs to read your data and say its answers (build_tiny_vlm(words=...)); the
    # <image> placeholder is where the image goes, not words.
    rows = [
        {"question": "<image>What colour is it?", "answer": ["dark-red", "red"]},
        {"question": "Shape?", "answer": 7},
    ]
    task = dataset_task(_jsonl(tmp_path, rows), test_size=1, system_prompt="Be brief.", prompt_template="{prompt} Go!")
    assert task.answer_words == sorted(
        {"What", "colour", "is", "it", "?", "dark", "-", "red", "Shape", "7", "Be", "brief", ".",
         "Go", "!"}
    )  # fmt: skip


def test_dataset_task_without_answers_names_the_fix(tmp_path):
    path = _jsonl(tmp_path, [{"question": "What colour?", "label": "red"} for _ in range(4)])
    with pytest.raises(DatasetError, match="no answer column .* --answer_column, or give --reward_funcs"):
        dataset_task(path, test_size=0)
    with pytest.raises(DatasetError, match="counting reads `answer`, .*; name yours with --answer_column"):
        dataset_task(path, test_size=0, reward_funcs=[counting])
    assert dataset_task(path, test_size=0, answer_column="label").accuracy is answer_accuracy
    assert dataset_task(path, test_size=0, reward_funcs=[think_answer_format]).answer_columns == {}


def test_a_closed_vocabulary_of_answers_is_scored_by_answer_choice_with_its_chance(tmp_path):
    # A few words, repeated: the first of them a completion names is its answer (issue 40: answer_accuracy paid
    # nothing for `circle system! [`); chance is one in the number of values.
    shapes = ["circle", "square", "triangle"]
    path = _jsonl(tmp_path, [{"question": "What shape?", "answer": shapes[i % 3]} for i in range(12)])
    task = dataset_task(path, test_size=3)
    [reward] = task.reward_funcs
    assert reward.__name__ == "answer_choice" and task.accuracy is reward
    assert task.answer_values == shapes and task.chance == pytest.approx(1 / 3)
    assert reward(None, ["circle system! [", "square circle"], answer=["circle", "circle"]) == [1.0, 0.0]
    # Named, it is built from the answers here, once for training and accuracy.
    named = dataset_task(path, test_size=0, reward_funcs=[think_answer_format, answer_choice], accuracy=answer_choice)
    assert named.reward_funcs[1] is named.accuracy and named.accuracy(None, ["triangle"], answer=["triangle"]) == [1.0]
    with pytest.raises(DatasetError, match="answer_choice is made from the answer column, which the rows lack"):
        dataset_task(_jsonl(tmp_path, [{"question": "q", "label": "a"}] * 4), test_size=0, reward_funcs=[answer_choice])


def test_numbers_and_open_answers_keep_answer_accuracy(tmp_path):
    counts = dataset_task(_jsonl(tmp_path, [{"question": "How many?", "answer": str(i % 3)} for i in range(9)]))
    assert counts.reward_funcs == [answer_accuracy] and counts.chance == pytest.approx(1 / 3)  # compared by value
    words = dataset_task(_jsonl(tmp_path, [{"question": "Who?", "answer": f"person {i}"} for i in range(8)]))
    assert words.reward_funcs == [answer_accuracy] and words.chance is None  # one answer per question


def test_a_synthetic_task_knows_its_chance():
    assert synthetic_task("color", difficulty=1, train_size=32, test_size=8).chance == pytest.approx(1 / 4)
    assert synthetic_task("locate", train_size=8, test_size=2).chance is None  # boxes
    built = synthetic_task("color", difficulty=1, train_size=8, test_size=2, reward_funcs=[answer_choice])
    assert built.accuracy.__name__ == "answer_choice" and built.accuracy is built.reward_funcs[0]


@pytest.mark.parametrize("name", ["count", "arithmetic"])
def test_counts_and_sums_pay_one_committed_number_in_digits_or_words(name):
    # They were closed-vocabulary choices over the digit strings: "three" and "none" scored 0, "about 3" and "3+" 1.
    task = synthetic_task(name, train_size=1, test_size=1, difficulty=2)
    prompts, golds = [[{"role": "user", "content": "?"}]] * 2, [3, 0]
    said = {"3": 1.0, "three": 1.0, "There are 3.": 1.0, "about 3": 0.0, "3+": 0.0, "3 or 4": 0.0}
    for text, expected in said.items():
        assert task.accuracy(prompts[:1], [text], answer=golds[:1]) == [expected], text
    assert task.accuracy(prompts[1:], ["none"], answer=golds[1:]) == [1.0]
