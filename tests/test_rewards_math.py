"""answer_accuracy: a table of labelled answers, Math-Verify agreement on its own style of cases, column plumbing."""

from __future__ import annotations

import pytest
from math_verify import parse, verify

from vlm_grpo.rewards import answer_accuracy, parse_number


def score(completion: str, gold) -> float:
    return answer_accuracy(None, [completion], answer=[gold])[0]


# (label, completion, gold, expected reward)
CASES = [
    # issue 15: near misses that contain the gold number must not pay
    ("sqrt of gold", r"<answer>\sqrt{7}</answer>", "7", 0.0),
    ("gold times pi", r"<answer>7\pi</answer>", "7", 0.0),
    ("power with gold exponent", r"<answer>2^{7}</answer>", "7", 0.0),
    ("gold times variable", "<answer>7x</answer>", "7", 0.0),
    ("fraction with gold denominator", r"<answer>-\frac{\pi}{7}</answer>", "7", 0.0),
    ("list holding gold", "<answer>1, 2, 7</answer>", "7", 0.0),
    ("either-or hedge", "<answer>8 or 7</answer>", "7", 0.0),
    ("golden-ratio-like fraction", r"\boxed{\frac{1+\sqrt5}{7}}", "7", 0.0),
    ("untagged list", "1, 2, 7", "7", 0.0),
    ("untagged either-or", "It is 8 or 7.", "7", 0.0),
    # issue 15: right answers the old code missed
    ("latex fraction vs slash gold, no tag", r"\frac{10}{9}", "10/9", 1.0),
    (
        "matrix gold",
        r"<answer>\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}</answer>",
        r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
        1.0,
    ),
    ("spaces around minus", "<answer>p - q</answer>", "p-q", 1.0),
    # own spellings of right answers
    ("plain tag", "<answer>7</answer>", "7", 1.0),
    ("boxed", r"so \boxed{7}", "7", 1.0),
    ("trailing zero", "<answer>7.0</answer>", "7", 1.0),
    ("thousands separator", "The total is 1,000.", "1000", 1.0),
    ("latex thousands", r"<answer>1{,}000</answer>", "1000", 1.0),
    ("currency", r"<answer>\$5</answer>", "5", 1.0),
    ("unit word", "<answer>4 apples</answer>", "4", 1.0),
    ("latex unit", r"<answer>12 \text{ cm}</answer>", "12", 1.0),
    ("percent vs fraction", "<answer>50%</answer>", "0.5", 1.0),
    ("fraction vs percent gold", "<answer>0.1</answer>", "10%", 1.0),
    ("answer marker", "I added them. Answer: 42", "42", 1.0),
    ("answer-is marker", "So the answer is 42.", "42", 1.0),
    ("one number in a sentence", "There are 12 eggs left.", "12", 1.0),
    ("negative", "<answer>-3</answer>", "-3", 1.0),
    ("decimal", "<answer>0.25</answer>", "1/4", 1.0),
    ("sqrt simplification", r"<answer>\sqrt{4}</answer>", "2", 1.0),
    ("commuted sum", "<answer>1 + x^2</answer>", "x^2+1", 1.0),
    ("equation form", "<answer>x = 7</answer>", "7", 1.0),
    ("interval", "<answer>[0, 1)</answer>", "[0,1)", 1.0),
    ("set order", r"<answer>\{3, 1, 2\}</answer>", r"\{1,2,3\}", 1.0),
    ("gsm8k rationale gold", "<answer>18</answer>", "16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18", 1.0),
    ("math solution gold", r"\boxed{\frac{1}{4}}", r"Multiply: $\boxed{\dfrac{1}{4}}$.", 1.0),
    ("text answer", "<answer>  new   YORK. </answer>", "New York", 1.0),
    ("text after think", "<think>It is the capital.</think> Paris.", "paris", 1.0),
    ("markdown emphasis", "<answer>**Blue**</answer>", "blue", 1.0),
    ("last tag wins", "<answer>41</answer> wait, <answer>42</answer>", "42", 1.0),
    ("tag beats later numbers", "<answer>5</answer> (checked with 6 steps)", "5", 1.0),
    # own spellings of wrong answers and hedges
    ("wrong number", "<answer>8</answer>", "7", 0.0),
    ("sign matters", "<answer>7</answer>", "-7", 0.0),
    ("outside tolerance", "<answer>0.333</answer>", r"\frac{1}{3}", 0.0),
    ("two numbers in prose", "There are 7 apples and 8 pears.", "7", 0.0),
    ("range", "<answer>6 to 8</answer>", "7", 0.0),
    ("and-list", "<answer>7 and 8</answer>", "7", 0.0),
    ("between", "It is between 6 and 8.", "7", 0.0),
    ("not-this-but-that", "Not 7, it is 8.", "7", 0.0),
    ("gold as digit of bigger number", "<answer>17</answer>", "7", 0.0),
    ("last number of an equation in prose", "41 + 1 = 42 so 43", "43", 0.0),
    ("set containing gold", r"<answer>\{7, 8\}</answer>", "7", 0.0),
    ("tuple containing gold", "<answer>(7, 8)</answer>", "7", 0.0),
    ("gold in exponent of e", "<answer>e^7</answer>", "7", 0.0),
    ("factorial", "<answer>7!</answer>", "7", 0.0),
    ("log of gold", r"<answer>\log 7</answer>", "7", 0.0),
    ("plus-minus", r"<answer>\pm 7</answer>", "7", 0.0),
    ("committed answer has no number", "<answer>I am not sure</answer> 7", "7", 0.0),
    ("wrong text", "Lyon", "Paris", 0.0),
    ("text gold, letters permuted", "<answer>Work yen</answer>", "New York", 0.0),
    ("wrong polynomial", "<answer>x^2 + 2</answer>", "x^2+1", 0.0),
    ("several percentages", "<answer>50% or 60%</answer>", "0.5", 0.0),
    ("empty", "", "7", 0.0),
    # a value ruled out, bounded or hedged is not that value
    ("ruled out", "<answer>not 7</answer>", "7", 0.0),
    ("ruled out in a sentence", "<answer>It isn't 7.</answer>", "7", 0.0),
    ("upper bound in words", "<answer>less than 7</answer>", "7", 0.0),
    ("lower bound in words", "<answer>at least 7</answer>", "7", 0.0),
    ("about", "<answer>about 7</answer>", "7", 0.0),
    ("approximately in maths", "<answer>approximately $7$</answer>", "7", 0.0),
    ("or more", "<answer>7 or more</answer>", "7", 0.0),
    ("trailing plus", "<answer>7+</answer>", "7", 0.0),
    ("bound sign without a variable", "<answer>< 7</answer>", "7", 0.0),
    ("neq without a variable", r"<answer>\neq 7</answer>", "7", 0.0),
    ("bound gold", r"<answer>\neq 7</answer>", r"\neq 7", 1.0),
    ("not about the value", "Not sure, but the total is 7.", "7", 1.0),
    ("relation with a variable", "<answer>x < 7</answer>", "x<7", 1.0),
    # a second value inside \text{} is still a second value; a unit there is not
    ("second value in a text block", r"<answer>7 \text{or 8}</answer>", "7", 0.0),
    ("number in a text block", r"<answer>\text{7}</answer>", "7", 1.0),
    # "percent" is a percent sign
    ("percent word in a sentence", "<answer>It is 50 percent</answer>", "0.5", 1.0),
    # scientific notation is a value, not an operation left undone; a float gold reads as Python writes it
    ("times ten to a power", r"\boxed{1.5 \times 10^{-3}}", "0.0015", 1.0),
    ("times ten to a positive power", r"\boxed{2.5 \times 10^{6}}", "2500000", 1.0),
    ("e notation", "<answer>2.5e6</answer>", "2500000", 1.0),
    ("float gold in e notation", "<answer>0.00001</answer>", 1e-05, 1.0),
    ("large float gold", "<answer>10000000000000000</answer>", 1e16, 1.0),
    # a scale word is part of the value; a hedge after the number hedges it
    ("scale word", "<answer>5 million</answer>", "5", 0.0),
    ("scale word in a sentence", "There are 5 thousand of them.", "5", 0.0),
    ("dozen", "<answer>5 dozen</answer>", "5", 0.0),
    ("scale word as the value", "<answer>5 million</answer>", "5000000", 1.0),
    ("dozens counted", "The answer is 3 dozen.", "36", 1.0),
    ("ish", "<answer>5ish</answer>", "5", 0.0),
    ("at least after", "<answer>5 at least</answer>", "5", 0.0),
    ("approximately after", "<answer>7 (approximately)</answer>", "7", 0.0),
    ("below after", "<answer>5 below zero</answer>", "5", 0.0),
    ("a unit after is no hedge", "<answer>7 meters</answer>", "7", 1.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_answer_accuracy_table(completion: str, gold: str, expected: float) -> None:
    assert score(completion, gold) == expected


# Math-Verify's own style of cases: (gold, prediction, Math-Verify's label). Written for this project after the cases in
# Math-Verify's test suite (notations, sets, intervals, fractions, units, percent, relations, matrices, answers stated
# in a sentence); the prediction is the completion as a model would write it.
MATH_VERIFY_STYLE = [
    ("$9$", r"Answer \[ 9 \]", 1),
    ("$9$", "Answer $ 9 $", 1),
    ("$9$", r"Answer \( 9 \)", 1),
    ("$10$", r"Answer \( (9+1) \)", 1),
    ("$9$", "Answer $ \n 9 \n $", 0),
    ("$1/3$", r"$\frac13 $", 1),
    ("$1$", r"$\frac3{3} $", 1),
    (r"$\sqrt{3}$", r"$\sqrt3 $", 1),
    ("$1/3$", r"$\dfrac{1}{3}$", 1),
    ("$1/3$", "$ 1/3 $", 1),
    ("$1/3$", r"$\left( \frac{1}{3} \right)$", 1),
    ("$1/3$", r"$\boxed{\frac{1}{3}}$", 1),
    ("$1/3$", r"$\frac{1}{3} \text{meters}$", 1),
    ("$1/3$", r"$k = \frac{1}{3}$", 1),
    ("-5", "-5", 1),
    ("7425000", "7,425,000", 1),
    ("1000", "1000.0", 1),
    ("0.4", ".4", 1),
    ("1000.99", "$1,000.99", 1),
    ("2", "AZYUK2A", 0),
    ("10/9", r"\frac{10}{9}", 1),
    ("-10/9", r"-\frac{10}{9}", 1),
    ("$[0,1)$", "$[0,1)$", 1),
    ("$[0,9)$", "$[0,1)$", 0),
    ("$(0,9)$", "$[0,9)$", 0),
    ("$1$", "$-[0,1)$", 0),
    (r"$28\%$", "28 %", 1),
    ("$0.28$", "28", 0),
    ("$28$", "28/100", 0),
    (r"$\frac{28}{100}$", "28", 0),
    ("$2-2p$", r"Thus $x-p=\boxed{2-2p}$.", 1),
    (r"$\frac{14}{3}$", r"$2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$", 1),
    (r"$\text{Evelyn}$", r"$\boxed{\text{Evelyn}}$", 1),
    ("$x >= 5$", r"Therefore $x \geq 5$ is the solution.", 1),
    ("$x < 3$", r"We find that $x \lt 3$.", 1),
    (r"$x \neq 5$", "The solution is $x != 5$", 1),
    (
        r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
        r"The identity matrix is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.",
        1,
    ),
    ("$(3, 4)$", r"The point is $\boxed{(3, 4)}$.", 1),
    ("$(3, 4)$", r"The point is $\boxed{(4, 3)}$.", 0),
    (r"$\{1, 2\}$", r"$\boxed{\{2, 1\}}$", 1),
    ("$3$", r"$\boxed{3.0}$", 1),
    ("$3$", r"$\boxed{3.01}$", 0),
    (r"$\frac{\sqrt{2}}{2}$", r"$\boxed{\frac{1}{\sqrt{2}}}$", 1),
    ("$2x+1$", r"$\boxed{1+2x}$", 1),
    ("$2x+1$", r"$\boxed{2x-1}$", 0),
    (r"$90^\circ$", r"$\boxed{90^\circ}$", 1),
    ("$5$", r"$\boxed{5}$ apples", 1),
    ("$125$ miles", r"The distance is $\boxed{125\textnormal{ miles}}.$", 1),
    ("$0.5$", r"$\boxed{\frac{1}{2}}$", 1),
    (r"$\pi$", r"$\boxed{3.14}$", 0),
    ("$12$", "Final Answer: The final answer is $12$. I hope it is correct.", 1),
    ("$34$", "Final Answer: The largest $n$ is 34.", 1),
    ("$e^2$", r"$\boxed{e^{2}}$", 1),
    ("$6$", r"$\boxed{3!}$", 1),
    (r"$\infty$", r"$\boxed{\infty}$", 1),
    ("$(-1, 2]$", r"$\boxed{(-1,2]}$", 1),
    ("$(-1, 2]$", r"$\boxed{[-1,2]}$", 0),
    ("$y = 2x$", r"$\boxed{y=2x}$", 1),
    ("$1000$", "1 000", 1),
    ("$4$", r"$\boxed{2^2}$", 1),
    ("$4$", r"$\boxed{2, 4}$", 0),
    (r"$\frac{3}{2}$", r"$\boxed{1.5}$", 1),
    ("$-2$", r"$\boxed{-2.0}$", 1),
]


def test_agreement_with_math_verify_labels_is_within_two_points_of_math_verify() -> None:
    ours = mv = 0
    for gold, pred, label in MATH_VERIFY_STYLE:
        ours += score(pred, gold) == label
        mv += int(verify(parse(gold), parse(pred))) == label
    n = len(MATH_VERIFY_STYLE)
    assert n >= 60
    assert ours / n >= mv / n - 0.02, f"answer_accuracy agrees on {ours}/{n}, Math-Verify on {mv}/{n}"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1,000", 1000.0), ("-3.0", -3.0), ("$5", 5.0), ("12%", 12.0), ("4 apples", 4.0), ("1,22", 1.22),
     ("7x", None), (r"\sqrt{7}", None), ("1, 2", None), ("1/2", None), ("7 pi", None), ("", None)],
)  # fmt: skip
def test_parse_number_is_exactly_one_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


def test_answer_accuracy_columns() -> None:
    assert answer_accuracy(None, ["<answer>18</answer>"], solution=["#### 18"]) == [1.0]
    assert answer_accuracy(None, ["<answer>1</answer>"], answer=["1"], solution=["2"]) == [1.0]  # answer wins
    assert answer_accuracy(None, ["<answer>1</answer>", "x"], answer=[None, "1"]) == [None, 0.0]
    with pytest.raises(ValueError, match="`answer` or `solution`"):
        answer_accuracy(None, ["1"], gold=["1"])


def test_a_list_of_accepted_answers_pays_for_any_of_them() -> None:
    # VQA's accepted answers: each gold was compared as the text "['yes', 'yeah']", so every answer scored 0.
    golds = [["yes", "yeah"], ["New York", "NYC"], ["7"], []]
    assert answer_accuracy(None, ["<answer>yes</answer>", "NYC", "8", "x"], answer=golds) == [1.0, 1.0, 0.0, None]


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [("<answer>3+4</answer>", "7", 0.0), (r"\boxed{3 \times 2 + 1}", "7", 0.0), ("<answer>2^3</answer>", "8", 0.0),
     ("<answer>7</answer>", "7", 1.0), (r"\frac{1}{2}", "0.5", 1.0), ("$-3$", "-3", 1.0),
     (r"\sqrt{8}", r"2\sqrt{2}", 1.0), ("x^{2} + 1", "x^2+1", 1.0)],
)  # fmt: skip
def test_an_operation_left_undone_does_not_answer_a_number(completion: str, gold: str, expected: float) -> None:
    # Math-Verify counts "3+4" equal to 7: on the arithmetic task's image (two digits to add) a policy copying the
    # digits was paid for a sum it never computed. Where the gold is an expression, equivalent forms still pay.
    assert answer_accuracy(None, [completion], answer=[gold]) == [expected]
