"""counting: pays for one committed count, never for ranges, hedges or a second number."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import counting

# (label, completion, gold, expected)
CASES = [
    # issue 15
    ("or-hedge", "2 or 3", 3, 0.0),
    ("dash range", "2-3", 3, 0.0),
    ("between", "between 2 and 4", 3, 0.0),
    ("marker wins over later numbers", "Answer: 3. There are 2 big ones and 1 small one.", 3, 1.0),
    ("none", "none", 0, 1.0),
    ("no dogs", "no dogs", 0, 1.0),
    ("compound number word", "twenty-one", 21, 1.0),
    ("compound is not twenty", "twenty-one", 20, 0.0),
    ("compound is not one", "twenty-one", 1, 0.0),
    # own spellings
    ("digit", "3", 3, 1.0),
    ("number word", "I count three.", 3, 1.0),
    ("tagged word", "<answer>Three.</answer>", "3", 1.0),
    ("boxed", r"\boxed{7}", "7", 1.0),
    ("unit noun", "<answer>4 apples</answer>", 4, 1.0),
    ("pronoun one", "There are 3 cats, one of them black", 3, 1.0),
    ("chat with tag", "<answer>12</answer>", "12", 1.0),
    ("trailing zero", "<answer>3.0</answer>", 3, 1.0),
    ("word gold", "3", "three", 1.0),
    ("spaced compound", "twenty one", 21, 1.0),
    ("there are no", "There are no dogs here.", 0, 1.0),
    ("zero word", "zero", 0, 1.0),
    ("after think", "<think>maybe 4 or 5</think> 5", 5, 1.0),
    ("non-integer", "maybe 3.5", 3, 0.0),
    ("no number", "no idea", 3, 0.0),
    ("two counts", "3 dogs and 2 cats", 3, 0.0),
    ("to-range", "3 to 4", 3, 0.0),
    ("word range", "two or three", 3, 0.0),
    ("about", "about 3", 3, 0.0),
    ("approximately", "approximately 3", 3, 0.0),
    ("at least", "at least 3", 3, 0.0),
    ("plus", "3+", 3, 0.0),
    ("or more", "3 or more", 3, 0.0),
    ("slash", "3/4", 3, 0.0),
    ("en dash", "2–3", 3, 0.0),
    ("maybe", "maybe 3", 3, 0.0),
    ("list", "1, 2, 3", 3, 0.0),
    ("not-this-but-that", "not 2 but 3", 3, 0.0),
    ("none then a number", "none, 3", 3, 0.0),
    ("tag hedge", "<answer>3 or 4</answer>", 3, 0.0),
    ("wrong", "<answer>4</answer>", 3, 0.0),
    ("seventeen is not seven", "seventeen", 7, 0.0),
    ("last tag wins", "<answer>2</answer> recount: <answer>3</answer>", 3, 1.0),
    # a count ruled out, signed or bounded is not that count
    ("ruled out", "<answer>not 3</answer>", 3, 0.0),
    ("ruled out in a sentence", "There aren't 3 dogs.", 3, 0.0),
    ("negative", "<answer>-3</answer>", 3, 0.0),
    ("greater than sign", "<answer>>3</answer>", 3, 0.0),
    ("at least sign", "<answer>≥ 3</answer>", 3, 0.0),
    ("less than sign", "<answer><3</answer>", 3, 0.0),
    ("ish", "<answer>3-ish</answer>", 3, 0.0),
    ("not elsewhere in the sentence", "Not sure, but I count 3 dogs.", 3, 1.0),
    # thousands separators are part of the number (read as 1 and 000 they named two)
    ("thousands separator", "<answer>1,000</answer>", 1000, 1.0),
    ("thousands separator in a sentence", "There are 1,200 people", 1200, 1.0),
    ("separated numbers stay a list", "1,2", 12, 0.0),
    # "no other", "nothing else" say there is no more, not a count of zero
    ("no other", "3. No other dogs are visible.", 3, 1.0),
    ("nothing else", "3, nothing else", 3, 1.0),
]


@pytest.mark.parametrize(("text", "gold", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_counting_table(text: str, gold, expected: float) -> None:
    assert counting(None, [text], answer=[gold]) == [expected]


@pytest.mark.parametrize(
    ("prompt", "text", "expected"),
    [
        ("How many dogs are in the picture?", "There are 3 dogs and 2 cats", 1.0),  # issue 15
        ("How many cats are there?", "There are 3 dogs and 2 cats", 0.0),
        ("How many red circles are there?", "I see 3 red circles and 2 blue squares.", 1.0),
        ("How many dogs are in the picture?", "There are 3 dogs and 5 dogs", 0.0),  # two counts of the object
        ("How many dogs are there?", "3 dogs, no cats", 1.0),  # the zero names another object
        ("How many dogs are there?", "No dogs, but 3 cats", 0.0),  # the zero names the object
        ("How many dogs are there?", "3. No other dogs are visible.", 1.0),
    ],
)
def test_counting_reads_the_object_asked_about(prompt: str, text: str, expected: float) -> None:
    chat = [{"role": "user", "content": prompt}]
    assert counting([chat], [text], answer=[3]) == [expected]
    assert counting(None, [text], answer=[3], object=[prompt.split()[2]]) == [expected]


def test_counting_bad_gold() -> None:
    for bad in ("3.5", True, "many"):
        with pytest.raises(ValueError, match="integer"):
            counting(None, ["3"], answer=[bad])
    assert counting(None, ["3"], answer=[None]) == [None]
