"""Tests for vlm_grpo.rewards: parsing edge cases, TRL signature/column plumbing, and metric arithmetic."""

from __future__ import annotations

import importlib.util
import math
import pickle
from typing import Any

import pytest

import vlm_grpo.rewards as R
from vlm_grpo.rewards import (
    anls,
    anls_score,
    answer_accuracy,
    answers_match,
    box_iou,
    completion_text,
    counting,
    extract_answer,
    extract_choice,
    extract_last_number,
    iou,
    iou_threshold,
    levenshtein,
    make_iou_reward,
    multiple_choice,
    parse_box,
    parse_number,
    think_answer_format,
)

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def conv(text: str) -> list[dict[str, Any]]:
    """A conversational completion as TRL passes it."""
    return [{"role": "assistant", "content": text}]


# Extra kwargs TRL always passes; every reward must accept and ignore them.
TRL_KWARGS: dict[str, Any] = {"trainer_state": object(), "log_metric": lambda name, value: None}


# ---------------------------------------------------------------------------------------------------------------------
# completion_text
# ---------------------------------------------------------------------------------------------------------------------


def test_completion_text_formats() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text(conv("hello")) == "hello"
    blocks = [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}],
        }
    ]
    assert completion_text(blocks) == "ab"
    assert completion_text({"role": "assistant", "content": "single"}) == "single"
    assert completion_text([{"content": "no role"}]) == "no role"


def test_completion_text_multi_turn_skips_tool_output() -> None:
    turns = [
        {"role": "assistant", "content": None, "tool_calls": [{"name": "zoom"}]},
        {"role": "tool", "content": "<answer>999</answer>"},
        {"role": "assistant", "content": "<answer>7</answer>"},
    ]
    text = completion_text(turns)
    assert "999" not in text
    assert extract_answer(text) == "7"


def test_completion_text_rejects_unknown_type() -> None:
    with pytest.raises(TypeError):
        completion_text(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------------
# think_answer_format
# ---------------------------------------------------------------------------------------------------------------------


def test_think_answer_format() -> None:
    completions = [
        "<think>step 1\nstep 2</think>\n<answer>42</answer>",  # multi-line body (DOTALL)
        "  \n<think>x</think><answer>y</answer>\n ",  # surrounding whitespace allowed
        "<think>x</think>",  # no answer
        "<answer>y</answer>",  # no think
        "<think>x</think><answer>y</answer> trailing text",
        "Sure! <think>x</think><answer>y</answer>",
        "<think>x</think><answer>y</answer><answer>z</answer>",  # two answers
        "<think>a<think>b</think><answer>y</answer>",  # nested think
        "<answer>y</answer><think>x</think>",  # wrong order
    ]
    assert think_answer_format(None, completions, **TRL_KWARGS) == [1.0, 1.0] + [0.0] * 7
    assert think_answer_format(None, [conv("<think>a</think> <answer>b</answer>")]) == [1.0]


# ---------------------------------------------------------------------------------------------------------------------
# extract_answer / numbers
# ---------------------------------------------------------------------------------------------------------------------


def test_extract_answer_last_tag_wins() -> None:
    assert extract_answer("<answer>1</answer> hmm, no: <answer> 2 </answer>") == "2"
    assert extract_answer("<answer>a<answer>b</answer>") == "b"


def test_extract_answer_boxed_nested_braces() -> None:
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{1} then \boxed{\sqrt{\frac{a}{b}}}") == r"\sqrt{\frac{a}{b}}"
    # A truncated last box is ignored in favour of the previous complete one.
    assert extract_answer(r"\boxed{3} and finally \boxed{\frac{1}{") == "3"


def test_extract_answer_tag_precedence_and_boxed_inside_tag() -> None:
    assert extract_answer(r"\boxed{9} <answer>8</answer>") == "8"
    assert extract_answer(r"<answer>The answer is \boxed{5}.</answer>") == "5"
    assert extract_answer(r"<answer>unclosed \boxed{4}") == "4"
    assert extract_answer("no answer here") is None


def test_extract_last_number() -> None:
    assert extract_last_number("paid $1,000 then -2.5") == "-2.5"
    assert extract_last_number("5-3") == "3"  # a binary minus is not a sign
    assert extract_last_number("x = -7.") == "-7"
    assert extract_last_number("ratio 3/4 today") == "3/4"
    assert extract_last_number("up 15%") == "15%"
    assert extract_last_number("H2O and abc") is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,000", 1000.0),
        ("-3.0", -3.0),
        ("1/2", 0.5),
        (r"\frac{1}{2}", 0.5),
        (r"-\dfrac{3}{4}", -0.75),
        (r"\frac12", 0.5),
        ("$5", 5.0),
        ("42.", 42.0),
        ("1e-3", 0.001),
        ("−4", -4.0),
        ("12%", 12.0),
        (r"1{,}000", 1000.0),
    ],
)
def test_parse_number_accepts(text: str, value: float) -> None:
    parsed = parse_number(text)
    assert parsed is not None and math.isclose(parsed, value)


@pytest.mark.parametrize("text", ["5 apples", "1,2", "x", "1/0", "", "12,34"])
def test_parse_number_rejects(text: str) -> None:
    assert parse_number(text) is None


# ---------------------------------------------------------------------------------------------------------------------
# answer_accuracy
# ---------------------------------------------------------------------------------------------------------------------


def test_answer_accuracy_numeric_forms() -> None:
    completions = [
        "The total is 1,000.",  # last number with thousands separator
        "<answer>1000</answer>",
        "<answer>3.0</answer>",
        r"\boxed{\frac{1}{2}}",
        "<answer>1/2</answer>",
        "<answer>7</answer>",  # sign matters
        "<answer>0.333</answer>",  # outside tolerance
        "41 + 1 = 42",  # last number fallback
        "<answer>-2.50 dollars</answer>",  # number inside a wordy answer
        "<answer>0.1</answer>",  # percent gold vs fraction
        "<answer>50%</answer>",  # percent prediction vs fraction gold
        "<answer>50%</answer>",
        "<answer>0.5%</answer>",
    ]
    golds = ["1000", "1,000", 3, "0.5", "0.5", "-7", r"\frac{1}{3}", "42", "-2.5", "10%", "0.5", "50", "50"]
    assert answer_accuracy(None, completions, answer=golds) == [1.0] * 5 + [0.0, 0.0] + [1.0] * 5 + [0.0]


def test_answer_accuracy_multiple_tags_last_wins() -> None:
    c = "<answer>41</answer> wait, recount <answer>42</answer>"
    assert answer_accuracy(None, [c, c], answer=["42", "41"]) == [1.0, 0.0]


def test_answer_accuracy_tag_beats_later_numbers() -> None:
    # With an explicit answer, numbers written after it are not used.
    assert answer_accuracy(None, ["<answer>5</answer> (checked with 6 steps)"], answer=["5"]) == [1.0]


def test_answer_accuracy_text_answers() -> None:
    completions = [
        conv("<answer>  new   YORK. </answer>"),
        conv("<think>It is the capital.</think> Paris."),  # no tag: text after </think>
        "Lyon",
        "<answer>**Blue**</answer>",
        "<answer>(1, 2)</answer>",
    ]
    assert answer_accuracy(["p"] * 5, completions, answer=["New York", "paris", "Paris", "blue", "(1,2)"]) == [
        1.0,
        1.0,
        0.0,
        1.0,
        1.0,
    ]


def test_answer_accuracy_solution_column_and_gold_reduction() -> None:
    completions = ["<answer>18</answer>", r"\boxed{\frac{1}{4}}", "<answer>19</answer>"]
    solutions = [
        "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18",  # GSM8K rationale
        r"Multiply to get $\boxed{\dfrac{1}{4}}$.",  # MATH solution
        "#### 18",
    ]
    assert answer_accuracy(None, completions, solution=solutions) == [1.0, 1.0, 0.0]


def test_answer_accuracy_prefers_answer_over_solution() -> None:
    assert answer_accuracy(None, ["<answer>1</answer>"], answer=["1"], solution=["2"]) == [1.0]


def test_answer_accuracy_none_gold_is_none() -> None:
    assert answer_accuracy(None, ["<answer>1</answer>", "x"], answer=[None, "1"]) == [None, 0.0]


def test_answer_accuracy_missing_column_names_both() -> None:
    with pytest.raises(ValueError, match="answer") as info:
        answer_accuracy(None, ["1"], gold=["1"])
    assert "solution" in str(info.value)


def test_answer_accuracy_misaligned_column() -> None:
    with pytest.raises(ValueError, match="`answer`.*2 values.*3 completions"):
        answer_accuracy(None, ["1", "2", "3"], answer=["1", "2"])


def test_answer_accuracy_symbolic_needs_math_verify() -> None:
    # Numerically parseable forms never need math_verify; sqrt does. Asserts the right behaviour either way.
    assert answers_match(r"<answer>\sqrt{4}</answer>", "2") is HAS_MATH_VERIFY
    assert answers_match(r"<answer>x^2 + 1</answer>", "x^2+1") is True  # string normalisation suffices
    assert answers_match(r"<answer>1 + x^2</answer>", "x^2+1") is HAS_MATH_VERIFY
    assert answers_match(r"<answer>x^2 + 2</answer>", "x^2+1") is False


def test_answer_accuracy_logs_extracted_answers() -> None:
    logged: dict[str, list[Any]] = {}
    answer_accuracy(
        None,
        ["<answer>4</answer>", "none"],
        answer=["4", "5"],
        completion_ids=[[1], [2]],
        log_extra=lambda column, values: logged.setdefault(column, []).extend(values),
        **TRL_KWARGS,
    )
    assert logged == {"answer_accuracy_pred": ["4", ""]}


# ---------------------------------------------------------------------------------------------------------------------
# multiple_choice
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("A cat is sitting on the mat.", None),  # article, not a choice
        ("the answer is a cat", None),
        ("The answer is (C).", "C"),
        ("**Answer:** E", "E"),
        ("the correct answer is option B because (A) is too small", "B"),  # explicit beats later cue
        ("I think C) fits best", "C"),
        ("d", "D"),
        ("(b)", "B"),
        ("<answer>b</answer>", "B"),
        ("<answer>(D) a red car</answer>", "D"),
        ("<answer>B. cat</answer>", "B"),
        ("<answer>I am sure the answer is C</answer>", "C"),  # letter cue inside the tag
        (r"\boxed{C}", "C"),
        ("<think>(A) seems wrong, (B) maybe</think>\nC", "C"),  # look after </think>
        ("Option (B) looks good. <answer>the cat</answer>", None),  # committed answer has no letter
        ("Looking at it, I'd pick B.", "B"),
        ("A. The dog", "A"),
    ],
)
def test_extract_choice(text: str, letter: str | None) -> None:
    assert extract_choice(text) == letter


def test_multiple_choice_reward() -> None:
    completions = ["A cat is on the mat.", conv("The answer is (B)."), "<answer>c</answer>", "B", "x"]
    golds = ["A", "(B)", "C.", "b", None]
    assert multiple_choice(None, completions, answer=golds, **TRL_KWARGS) == [0.0, 1.0, 1.0, 1.0, None]


def test_multiple_choice_bad_gold_and_missing_column() -> None:
    with pytest.raises(ValueError, match="letter A-E"):
        multiple_choice(None, ["A"], answer=["F"])
    with pytest.raises(ValueError, match="`answer`"):
        multiple_choice(None, ["A"], label=["A"])
    with pytest.raises(ValueError, match="`answer`"):
        multiple_choice(None, ["A", "B"], answer=["A"])


# ---------------------------------------------------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------------------------------------------------


def test_counting() -> None:
    completions = [
        "I count three.",  # number word
        "<answer>Three.</answer>",
        "maybe 3.5",  # non-integer is wrong
        r"\boxed{7}",
        "<answer>4 apples</answer>",
        "There are 3 cats, one of them black",  # digits beat pronoun-like "one"
        "twenty-one",  # neither "twenty"...
        "twenty-one",  # ...nor "one"
        conv("<answer>12</answer>"),
        "<answer>3.0</answer>",
        "no idea",
        "x",
    ]
    golds = [3, "3", 3, "7", 4, 3, 20, 1, "12", 3, 0, None]
    expected = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, None]
    assert counting(None, completions, answer=golds, **TRL_KWARGS) == expected


def test_counting_bad_gold() -> None:
    with pytest.raises(ValueError, match="integer"):
        counting(None, ["3"], answer=["3.5"])
    with pytest.raises(ValueError, match="integer"):
        counting(None, ["1"], answer=[True])
    with pytest.raises(ValueError, match="`answer`"):
        counting(None, ["3"], answer=[3, 4])


# ---------------------------------------------------------------------------------------------------------------------
# parse_box / box_iou
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "box"),
    [
        ("[10, 20, 30, 40]", [10, 20, 30, 40]),
        ("box: (10,20,30,40)", [10, 20, 30, 40]),
        ("10, 20, 30, 40", [10, 20, 30, 40]),
        ('```json\n[{"bbox_2d": [12, 34, 56, 78], "label": "dog"}]\n```', [12, 34, 56, 78]),
        ("<|box_start|>(100,200),(300,400)<|box_end|>", [100, 200, 300, 400]),
        ("[30, 40, 10, 20]", [10, 20, 30, 40]),  # reversed corners reordered
        ("[0.5, 0.1, 0.2, 0.9]", [0.2, 0.1, 0.5, 0.9]),
        ("first [1, 2, 3, 4] then [5, 6, 7, 8]", [5, 6, 7, 8]),  # last box
        ("<answer>[1, 2, 3, 4]</answer> later [5, 6, 7, 8]", [1, 2, 3, 4]),  # tag first
        ("<answer>the red one</answer> at [5, 6, 7, 8]", [5, 6, 7, 8]),  # tag without box: anywhere
        ("[1, 2, 3]", None),
        ("[1, 2, 3, 4, 5]", None),  # not a box, and not "2, 3, 4, 5"
        ("[a, b, c, d]", None),
        ("", None),
    ],
)
def test_parse_box(text: str, box: list[float] | None) -> None:
    assert parse_box(text) == box


def test_box_iou() -> None:
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert box_iou([0, 0, 2, 2], [1, 0, 3, 2]) == pytest.approx(1 / 3)
    assert box_iou([2, 2, 0, 0], [1, 0, 3, 2]) == pytest.approx(1 / 3)  # corners in either order
    assert box_iou([0, 0, 1, 1], [1, 0, 2, 1]) == 0.0  # touching edges
    assert box_iou([1, 1, 1, 1], [1, 1, 1, 1]) == 0.0  # no area


# ---------------------------------------------------------------------------------------------------------------------
# iou rewards
# ---------------------------------------------------------------------------------------------------------------------


def test_iou_pixels_and_normalised_with_image_size() -> None:
    completions = [
        "[0, 0, 2, 2]",  # pixels vs pixels
        "<answer>[0.1, 0.1, 0.5, 0.5]</answer>",  # normalised pred, pixel gold
        "[10, 10, 50, 50]",  # pixel pred, normalised gold
        "[0.1, 0.1, 0.5, 0.5]",  # both normalised: no image size needed
        "I can't find it",  # unparseable
        "[0, 0, 1, 1]",
    ]
    rewards = iou(
        None,
        completions,
        bbox=[[1, 0, 3, 2], [10, 10, 50, 50], [0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.5, 0.5], [1, 2, 3, 4], None],
        image_size=[None, (100, 100), [100, 100], None, None, None],
        **TRL_KWARGS,
    )
    assert rewards[0] == pytest.approx(1 / 3)
    assert rewards[1:] == [pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0), 0.0, None]


def test_iou_non_square_image_scales_each_axis() -> None:
    # 0.5 of width 200 = 100, 0.5 of height 100 = 50.
    assert iou(None, ["[0, 0, 0.5, 0.5]"], bbox=[[0, 0, 100, 50]], image_size=[{"width": 200, "height": 100}]) == [
        pytest.approx(1.0)
    ]


def test_iou_scale_mismatch_without_image_size_raises() -> None:
    with pytest.raises(ValueError, match="image_size"):
        iou(None, ["[0.1, 0.1, 0.5, 0.5]"], bbox=[[10, 10, 50, 50]])
    with pytest.raises(ValueError, match="image_size"):  # column present, but None for this row
        iou(None, ["[0.1, 0.1, 0.5, 0.5]"], bbox=[[10, 10, 50, 50]], image_size=[None])


def test_iou_threshold_reward() -> None:
    completions = ["[0, 0, 2, 2]", "[0, 0, 2, 2]", "[0, 0, 2, 2]"]
    golds = [[1, 0, 3, 2], [0, 0, 2, 1], [0, 0, 2, 2]]  # IoU 1/3, exactly 0.5, 1.0
    assert iou_threshold(None, completions, bbox=golds) == [0.0, 1.0, 1.0]


def test_iou_gold_as_string_or_dict() -> None:
    assert iou(None, ["[0, 0, 2, 2]", "[0, 0, 2, 2]"], bbox=["[0, 0, 2, 2]", {"bbox_2d": [0, 0, 2, 2]}]) == [1.0, 1.0]


def test_iou_bad_gold_and_missing_column() -> None:
    with pytest.raises(ValueError, match="bbox"):
        iou(None, ["[0, 0, 1, 1]"], bbox=[[1, 2, 3]])
    with pytest.raises(ValueError, match="`bbox`"):
        iou(None, ["[0, 0, 1, 1]"], box=[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="`image_size`"):
        iou(None, ["[0, 0, 1, 1]", "[0, 0, 1, 1]"], bbox=[[0, 0, 1, 1]] * 2, image_size=[(10, 10)])


def test_make_iou_reward_names_modes_and_pickling() -> None:
    assert iou.__name__ == "iou"
    assert iou_threshold.__name__ == "iou_at_50"
    assert make_iou_reward(0.75).__name__ == "iou_at_75"
    assert make_iou_reward(0.755, coords="pixel").__name__.isidentifier()
    qwen2 = make_iou_reward(coords="norm1000")
    assert qwen2.__name__ == "iou_norm1000"
    # Qwen2-VL 0-1000 grid: 100/1000 * 200 px = 20 px.
    assert qwen2(None, ["(100,100),(500,500)"], bbox=[[20, 20, 100, 100]], image_size=[(200, 200)]) == [
        pytest.approx(1.0)
    ]
    raw = make_iou_reward(coords="pixel")  # no conversion: 0-1 vs pixels simply do not overlap
    assert raw(None, ["[0.1, 0.1, 0.5, 0.5]"], bbox=[[10, 10, 50, 50]]) == [0.0]
    clone = pickle.loads(pickle.dumps(iou_threshold))
    assert clone.__name__ == "iou_at_50"
    assert clone(None, ["[0, 0, 2, 2]"], bbox=[[1, 0, 3, 2]]) == [0.0]
    with pytest.raises(ValueError):
        make_iou_reward(1.5)
    with pytest.raises(ValueError):
        make_iou_reward(coords="xywh")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------------
# ANLS
# ---------------------------------------------------------------------------------------------------------------------


def test_levenshtein() -> None:
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("sitting", "kitten") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0
    assert levenshtein("flaw", "lawn") == 2


def test_anls_score_threshold_and_lists() -> None:
    assert anls_score("abX", "abc") == pytest.approx(2 / 3)  # NL = 1/3
    assert anls_score("aX", "ab") == 0.0  # NL = 0.5 exactly: cut off
    assert anls_score("  HeLLo   World ", "hello world") == 1.0  # case and whitespace
    assert anls_score("hellp", ["goodbye", "hello"]) == pytest.approx(0.8)  # max over golds
    assert anls_score("", "") == 1.0
    assert anls_score("", "abc") == 0.0
    assert anls_score("x", []) == 0.0


def test_anls_reward() -> None:
    completions = [
        "<answer>Hello</answer>",
        conv("hellp"),
        "xyz",
        "<think>it says 'total'</think> <answer>$1,234</answer>",
        "anything",
        "anything",
        "word " * 2000,  # long rambling completion: scored quickly as 0
    ]
    golds = [["hello", "hi"], "hello", "abc", ["$1,234", "1234"], None, [], "cat"]
    assert anls(None, completions, answer=golds, **TRL_KWARGS) == [1.0, pytest.approx(0.8), 0.0, 1.0, None, None, 0.0]


def test_anls_missing_or_misaligned_column() -> None:
    with pytest.raises(ValueError, match="`answer`"):
        anls(None, ["a"], answers=["a"])
    with pytest.raises(ValueError, match="`answer`"):
        anls(None, ["a"], answer=["a", "b"])


# ---------------------------------------------------------------------------------------------------------------------
# Module surface
# ---------------------------------------------------------------------------------------------------------------------


def test_trl_helpers_reexported() -> None:
    import trl.rewards

    for name in (
        "get_soft_overlong_punishment",
        "get_repetition_penalty_reward",
        "think_format_reward",
        "accuracy_reward",
    ):
        assert getattr(R, name) is getattr(trl.rewards, name)
        assert name in R.__all__
    overlong = R.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert overlong(completion_ids=[[1] * 50, [1] * 90, [1] * 120]) == [0.0, -0.5, -1.0]
    assert R.think_format_reward([conv("<think>r</think> a"), conv("no think")]) == [1.0, 0.0]


def test_all_names_exist_and_rewards_return_one_value_per_completion() -> None:
    for name in R.__all__:
        assert hasattr(R, name), name
    completions = ["<think>t</think><answer>A</answer>", conv("[0, 0, 1, 1]")]
    columns = {"answer": ["A", "B"], "bbox": [[0, 0, 1, 1], [0, 0, 1, 1]], "completion_ids": [[1], [2]], **TRL_KWARGS}
    for fn in (think_answer_format, multiple_choice, anls, iou, iou_threshold):
        assert len(fn(["p", "q"], completions, **columns)) == 2


def test_choice_reward_needs_exactly_the_right_candidate() -> None:
    from vlm_grpo.rewards import make_choice_reward

    reward = make_choice_reward(["red", "green", "blue"], name="colour")
    completions = ["red", "It is RED.", "red or blue", "<answer>blue</answer> red", conv("green"), "purple", ""]
    golds = ["red", "red", "red", "blue", "green", "red", None]
    assert reward(None, completions, answer=golds) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, None]
    assert reward.__name__ == "colour"
    with pytest.raises(ValueError, match="not one of the choices"):
        reward(None, ["red"], answer=["magenta"])
    with pytest.raises(ValueError, match="answer"):
        reward(None, ["red"])
    with pytest.raises(ValueError, match="non-empty"):
        make_choice_reward([])
    import pickle

    assert pickle.loads(pickle.dumps(reward))(None, ["blue"], answer=["blue"]) == [1.0]
