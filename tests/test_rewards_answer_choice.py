"""answer_choice: the first of the answer column's values a completion names; when an answer column is a closed
vocabulary; the name that is built once the data is loaded."""

from __future__ import annotations

import doctest
import importlib
import pickle

import pytest

from vlm_grpo.rewards import (
    FromAnswers,
    answer_choice,
    closed_vocabulary,
    make_answer_choice_reward,
    make_choice_reward,
    resolve_reward,
    reward_columns,
    reward_names,
)

SHAPES = ["circle", "square", "triangle"]

# (label, completion, gold, expected)
CASES = [
    ("bare", "circle", "circle", 1.0),
    ("babble after the word", "circle system! [", "circle", 1.0),  # answer_accuracy pays 0 for this (issue 40)
    ("case and punctuation", "It is a CIRCLE.", "circle", 1.0),
    ("the first word named decides", "square circle", "circle", 0.0),
    ("listing every value is the first one", "circle, square, triangle", "square", 0.0),
    ("no value named", "a round thing", "circle", 0.0),
    ("part of a longer word is not the word", "circles", "circle", 0.0),
    ("answer tag over words before it", "<think>a square?</think><answer>triangle</answer>", "triangle", 1.0),
    ("answer marker", "Hmm, a square? Answer: circle", "circle", 1.0),
    ("chat completion", [{"role": "assistant", "content": "triangle [ ["}], "triangle", 1.0),
    ("a value ruled out is not the answer", "not a circle", "circle", 0.0),
    ("the value ruled out first is not the answer", "It is not a circle, it is a square", "circle", 0.0),
    ("the value after the one ruled out is", "It is not a circle, it is a square", "square", 1.0),
]


@pytest.mark.parametrize(("text", "gold", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_first_value_named_is_the_answer(text, gold, expected):
    reward = make_answer_choice_reward(SHAPES * 5)  # an answer column: repeats are fine
    assert reward(None, [text], answer=[gold]) == [expected]


def test_phrases_are_read_whole_longest_first():
    reward = make_answer_choice_reward(["traffic light", "light", "Car", "car"])
    golds = ["traffic light", "light", "car", "light"]
    texts = ["a traffic light", "a traffic light", "the car.", "light traffic"]
    assert reward(None, texts, answer=golds) == [1.0, 0.0, 1.0, 1.0]
    # make_choice_reward (exactly one candidate named) reads phrases the same way.
    assert make_choice_reward(["traffic light", "car"])(None, ["a traffic light"], answer=["traffic light"]) == [1.0]


def test_name_golds_outside_the_vocabulary_lists_and_pickling():
    reward = make_answer_choice_reward(SHAPES)
    assert reward.__name__ == "answer_choice" and reward_columns(reward) == ("answer",)
    with pytest.raises(ValueError, match="not one of the choices"):
        reward(None, ["circle"], answer=["hexagon"])
    with pytest.raises(ValueError, match="reads one answer per row, got \\['a', 'b'\\].*answer_accuracy or anls"):
        make_answer_choice_reward(["circle", ["a", "b"]])
    with pytest.raises(ValueError, match="non-empty"):
        make_answer_choice_reward([None])
    assert pickle.loads(pickle.dumps(reward))(None, ["square"], answer=["square"]) == [1.0]


@pytest.mark.parametrize(
    ("answers", "numbers", "values"),
    [
        (SHAPES * 2, True, SHAPES),
        (["Circle", "circle.", "Square", "square", None], True, ["circle", "square"]),  # as read; None is no row
        (["traffic light", "car"] * 2, True, ["car", "traffic light"]),
        ([str(i % 3) for i in range(9)], True, ["0", "1", "2"]),  # small counts: a closed set too (chance 1/3)
        ([str(i % 3) for i in range(9)], False, None),  # ... but compared by value, not as words
        (["1.5", "2.5", "yes"] * 2, False, ["1 5", "2 5", "yes"]),  # not all numbers
        ([f"class{i % 21}" for i in range(84)], True, None),  # 21 values: more than MAX_CHOICES
        (["a b c d", "e"] * 3, True, None),  # a 4-word answer is a sentence, not a label
        (SHAPES, True, None),  # every answer once: one answer per question, not classes
        (["left"] * 6, True, None),  # one value is no choice
        ([["circle", "round"], "square"] * 2, True, None),  # lists of accepted answers
    ],
)
def test_closed_vocabulary(answers, numbers, values):
    assert closed_vocabulary(answers, numbers=numbers) == values


def test_by_name_it_is_built_from_the_data_and_refuses_to_score_before():
    assert "answer_choice" in reward_names()
    assert resolve_reward("answer_choice") is answer_choice and isinstance(answer_choice, FromAnswers)
    built = answer_choice.build(SHAPES)
    assert built.__name__ == "answer_choice" and built(None, ["square ["], answer=["square"]) == [1.0]
    with pytest.raises(ValueError, match=r"made from your data's answers: use make_answer_choice_reward\(answers\)"):
        answer_choice(None, ["circle"], answer=["circle"])


def test_the_module_example_runs():
    module = importlib.import_module("vlm_grpo.rewards.answer_choice")  # the attribute of the package is the reward
    assert doctest.testmod(module).failed == 0


def test_candidates_offered_as_alternatives_answer_nothing():
    # "yes or no" paid for gold yes (the first value named); a run joined by "or" offers them all.
    reward = make_answer_choice_reward(["yes", "no", "yes", "no"])
    texts = ["yes or no", "I cannot say yes or no", "either yes or no", "yes", "yes, not no", "yes no"]
    assert reward(None, texts, answer=["yes"] * 6) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    shapes = make_answer_choice_reward(["circle", "square", "triangle", "square"])
    texts = ["circle, square, or triangle", "square, circle", "circle. Or maybe a square"]
    assert shapes(None, texts, answer=["circle", "square", "circle"]) == [0.0, 1.0, 1.0]
