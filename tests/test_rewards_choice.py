"""multiple_choice and make_choice_reward: one candidate named, the right one; labelled spellings and hedges."""

from __future__ import annotations

import pickle

import pytest

from vlm_grpo.rewards import extract_choice, make_choice_reward, multiple_choice

# (label, completion, chosen letter or None)
LETTER_CASES = [
    # issue 15: several letters named -> no choice
    ("and-list", "<answer>A and C</answer>", None),
    ("or-hedge", "<answer>A or B</answer>", None),
    ("every option", "<answer>A, B, C, D</answer>", None),
    ("rejected option named last", "I think it's C, not B", None),
    # issue 15: right answers the old code missed
    ("lowercase after marker", "Answer: b", "B"),
    ("boxed text", r"\boxed{\text{B}}", "B"),
    ("letter beyond E", "<answer>H</answer>", "H"),
    ("lowercase J", "j", "J"),
    # own spellings
    ("article is not a choice", "A cat is sitting on the mat.", None),
    ("lowercase article", "the answer is a cat", None),
    ("answer is bracketed", "The answer is (C).", "C"),
    ("bold marker", "**Answer:** E", "E"),
    ("bracket after letter", "I think C) fits best", "C"),
    ("lone lowercase", "d", "D"),
    ("bracketed lowercase", "(b)", "B"),
    ("tagged lowercase", "<answer>b</answer>", "B"),
    ("leading letter with option text", "<answer>(D) a red car</answer>", "D"),
    ("leading letter with capitals in option text", "<answer>C. Vitamin D</answer>", "C"),
    ("marker inside the tag", "<answer>I am sure the answer is C</answer>", "C"),
    ("boxed letter", r"\boxed{C}", "C"),
    ("reasoning options ignored", "<think>(A) seems wrong, (B) maybe</think>\nC", "C"),
    ("committed answer has no letter", "Option (B) looks good. <answer>the cat</answer>", None),
    ("contraction I'd", "Looking at it, I'd pick B.", "B"),
    ("line start", "A. The dog", "A"),
    ("A is correct", "A is correct", "A"),
    ("option word", "<answer>option G</answer>", "G"),
    ("slash hedge", "<answer>B/C</answer>", None),
    ("both", "<answer>Both A and B</answer>", None),
    ("either", "Either (A) or (D).", None),
    ("explaining a rejected option", "The answer is B because (A) is too small", None),
    ("versus", "<answer>C vs D</answer>", None),
    ("same letter twice", "<answer>B, i.e. (B)</answer>", "B"),
    ("pronoun before choice", "I choose D", "D"),
    ("no letter", "I don't know", None),
    ("letter out of range", "<answer>K</answer>", None),
    ("word containing letters", "<answer>BAD</answer>", None),
    ("last tag wins", "<answer>A</answer> no wait <answer>C</answer>", "C"),
    ("markdown bold letter", "<answer>**D**</answer>", "D"),
    ("text wrapper in tag", r"<answer>\text{(E)}</answer>", "E"),
    # a leading "B." is not a commitment when another option follows it
    ("two options with their text", "<answer>B. cat or C. dog</answer>", None),
    ("two bracketed options", "<answer>(B) or (C)</answer>", None),
    ("bracketed options back to back", "<answer>(B)(C)</answer>", None),
    ("two options after brackets", "<answer>B) cat, C) dog</answer>", None),
    ("two options after colons", "<answer>B: cat; C: dog</answer>", None),
    ("dotted letters", "<answer>B. C.</answer>", None),
    ("dotted letters joined", "<answer>B. or C.</answer>", None),
    ("one option per line", "<answer>B.\nC.</answer>", None),
    ("option text naming options", "<answer>D. Both A and B</answer>", "D"),
    ("option text ending in a capital", "<answer>C. Vitamin D.</answer>", "C"),
    # the option list copied out names every option (it paid the first), while an option's text may name a letter
    ("option list copied out", "A. 5 B. 6 C. 7 D. 8", None),
    ("option list with brackets", "<answer>A) 5 B) 6</answer>", None),
    ("option list with colons", "A: dog B: cat", None),
    ("option list in bold", "**A.** 5 **B.** 6", None),
    ("option text naming a plan", "<answer>C. Plan A: go</answer>", "C"),
    ("option text naming a type", "<answer>B. Type A. Fast</answer>", "B"),
    # a lowercase second letter is still a second option
    ("lowercase second letter", "<answer>B or c</answer>", None),
    ("lowercase list", "<answer>B, c</answer>", None),
    ("letters side by side", "<answer>B c</answer>", None),
    # a letter ruled out is not chosen
    ("negated letter", "<answer>not B</answer>", None),
    ("negated bracketed letter", "It is not (B).", None),
    ("negated option", "<answer>Definitely not option b</answer>", None),
    ("negation elsewhere", "<answer>B, I am not sure about it</answer>", "B"),
]


@pytest.mark.parametrize(("text", "letter"), [c[1:] for c in LETTER_CASES], ids=[c[0] for c in LETTER_CASES])
def test_extract_choice(text: str, letter: str | None) -> None:
    assert extract_choice(text) == letter


def test_multiple_choice_reward_and_golds_a_to_j() -> None:
    completions = ["A cat is on the mat.", [{"role": "assistant", "content": "The answer is (B)."}], "<answer>c</answer>",
                   "<answer>J</answer>", "<answer>A or J</answer>", "x"]  # fmt: skip
    golds = ["A", "(B)", "C.", "j", "J", None]
    assert multiple_choice(None, completions, answer=golds) == [0.0, 1.0, 1.0, 1.0, 0.0, None]
    with pytest.raises(ValueError, match="letter A-J"):
        multiple_choice(None, ["A"], answer=["K"])


# (label, completion, gold, expected)
WORD_CASES = [
    ("bare", "red", "red", 1.0),
    ("in a sentence", "It is RED.", "red", 1.0),
    ("or-hedge", "red or blue", "red", 0.0),
    ("every colour", "<answer>red, green, blue</answer>", "red", 0.0),
    ("tag beats later words", "<answer>blue</answer> red", "blue", 1.0),
    ("wrong", "purple", "red", 0.0),
    ("not-this-but-that", "not red, blue", "blue", 0.0),
    ("marker", "Hmm, green? Answer: red", "red", 1.0),
    ("negated word", "<answer>not red</answer>", "red", 0.0),
    ("negated in a sentence", "It isn't red.", "red", 0.0),
    ("negation of something else", "Not sure, but red", "red", 1.0),
]


@pytest.mark.parametrize(("text", "gold", "expected"), [c[1:] for c in WORD_CASES], ids=[c[0] for c in WORD_CASES])
def test_choice_reward_needs_exactly_the_right_candidate(text: str, gold: str, expected: float) -> None:
    reward = make_choice_reward(["red", "green", "blue"], name="colour")
    assert reward(None, [text], answer=[gold]) == [expected]


def test_choice_reward_name_errors_and_pickling() -> None:
    reward = make_choice_reward(["red", "green", "blue"], name="colour")
    assert reward.__name__ == "colour"
    with pytest.raises(ValueError, match="not one of the choices"):
        reward(None, ["red"], answer=["magenta"])
    with pytest.raises(ValueError, match="non-empty"):
        make_choice_reward([])
    assert pickle.loads(pickle.dumps(reward))(None, ["blue"], answer=["blue"]) == [1.0]
    assert pickle.loads(pickle.dumps(multiple_choice)) is multiple_choice
