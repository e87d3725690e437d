"""Answer extraction on realistic and adversarial chat outputs, and the stats helpers."""

import math

import pytest
from sglang_m3.bench.extract import (
    answers_equal,
    extract_choice,
    extract_gsm8k_answer,
    gsm8k_gold,
    normalize_number,
    strip_thinking,
)
from sglang_m3.bench.stats import accuracy_summary, describe, percentile, wilson_interval

QWEN_STYLE = """To find out how much Janet makes, let's break it down:

1. Janet's ducks lay **16 eggs** per day.
2. She eats **3** for breakfast and uses **4** for muffins: 3 + 4 = 7 eggs.
3. Remaining eggs: 16 - 7 = 9 eggs.
4. She sells each egg for $2: 9 × 2 = $18.

#### 18"""

R1_STYLE = """<think>
Okay, so the robe takes 2 bolts of blue fiber. Half of that is 1 bolt of white. Wait, maybe it's 2 + 4 = 6?
No: half of 2 is 1, so 2 + 1 = 3.
</think>

The robe needs 2 bolts of blue fiber and half as much white fiber, i.e. 1 bolt.

Total: 2 + 1 = \\boxed{3}"""

LLAMA_STYLE = """Josh bought the house for $80,000 and put in $50,000 in repairs,
so he spent 80,000 + 50,000 = $130,000.
The house value increased by 150%, so it is now worth 80,000 * 2.5 = $200,000.
His profit is 200,000 - 130,000 = $70,000.

The answer is $70,000."""


@pytest.mark.parametrize(
    "text, expected",
    [
        (QWEN_STYLE, "18"),
        (R1_STYLE, "3"),  # 6 inside the reasoning must not count
        (LLAMA_STYLE, "70000"),  # commas, dollar sign, several numbers
        ("She has 5 apples and buys 3 more.\n#### 8\nI hope this helps! Let me know if you need 2 more examples.", "8"),
        ("#### 1,000,000", "1000000"),
        ("The final answer is 3.50 dollars.", "3.5"),
        ("So the answer is **42** cookies, since 6 x 7 = 42 and 42 / 2 = 21 is wrong.", "42"),
        ("It takes 5 hours, then 30 minutes more: 5.5 hours", "5.5"),
        ("16-3-4 = 9", "9"),  # hyphens between numbers are minus signs, not negative numbers
        ("The temperature ends at -5 degrees.", "-5"),
        ("The price dropped by 25%.", "25"),
        ("\\boxed{\\$1{,}250}", "1250"),
        ("Final answer: \\boxed{12 \\text{ dollars}}", "12"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("First \\boxed{4}, but correcting myself: \\boxed{5}", "5"),
        ("#### 12\n\nWait, let me re-check. #### 14", "14"),
        ("1,2,3 are the first three, the next is 45", "45"),
        ("x = 3.14.", "3.14"),
        ("I cannot determine the answer without more information.", None),
        ("", None),
        (None, None),
        ("<think>It is clearly 42, the answer is 42", None),  # truncated while thinking: no answer
        ("The count is 7.</think>Therefore the answer is 9.", "9"),  # template opened <think> in the prompt
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_gold_and_numeric_equality():
    assert gsm8k_gold("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18") == "18"
    assert gsm8k_gold("...\n#### 1,600") == "1600"
    with pytest.raises(ValueError):
        gsm8k_gold("no final line")
    assert answers_equal("18.0", "18") and answers_equal(normalize_number("18.00"), "18")
    assert not answers_equal(None, "18")
    assert not answers_equal("180", "18")
    assert normalize_number("-0.50") == "-0.5" and normalize_number("abc") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("B", "B"),
        ("(C)", "C"),
        ("**D**", "D"),
        ("B. Paris", "B"),
        ("C) 5", "C"),
        ("Answer: A", "A"),
        ("The answer is (B).", "B"),
        ("I think the correct answer is: **B**", "B"),
        ("\\boxed{\\text{C}}", "C"),
        ("Final answer: $\\boxed{D}$", "D"),
        # a different letter in the reasoning than in the final answer
        ("Option A is tempting because it mentions London, but the answer is C.", "C"),
        ("The answer is B, not A.", "B"),
        ("Let's eliminate: (A) is wrong, (B) is wrong, (D) is irrelevant.\n\nTherefore the correct option is C", "C"),
        ("<think>The answer is A... no wait</think>Answer: D", "D"),
        ("A good choice here is D", "D"),  # the article "A" is not option A
        ("The answer is a tricky one, but I'd go with C.", "C"),  # lowercase "a" is not option A
        ("ANSWER: b... no, ANSWER: D", "D"),
        ("Both A and B are wrong; C is right.", "C"),
        ("Paris", "B"),  # reply is an option's text
        ("None of these options is correct.", None),
        ("", None),
        ("<think>Probably (B) but let me check", None),
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text, ["London", "Paris", "Rome", "Madrid"]) == expected


def test_strip_thinking():
    assert strip_thinking("<think>a 1</think> b <think>c</think>d") == "b d"
    assert strip_thinking("reasoning</think>\n\nfinal") == "final"
    assert strip_thinking("answer <think>unfinished") == "answer"


def test_wilson_interval_known_values():
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(0.7225, abs=1e-4)  # stays in [0, 1], unlike the normal interval
    assert wilson_interval(0, 0) == (0.0, 1.0)
    summary = accuracy_summary(3, 4)
    assert summary["accuracy"] == 0.75 and summary["ci95_low"] < 0.75 < summary["ci95_high"]


def test_percentiles_match_numpy_linear():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    assert percentile(values, 50) == 3.5
    assert percentile(values, 90) == pytest.approx(7.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([], 50) is None
    d = describe([1.0, 2.0, 3.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}
    assert math.isclose(describe([7.0])["p99"], 7.0)
