"""Answer extraction from free-form chat model outputs.

Chat models do not answer in a fixed format: they reason first, restate the
options, change their mind, wrap the answer in markdown or LaTeX.  Scoring is
only meaningful if extraction picks the *final* answer, so every extractor
below tries explicit answer markers first (most reliable, last occurrence
wins because models restate and correct themselves) and falls back to weaker
heuristics only when no marker exists.  All functions are pure and
dependency-free so they can be unit-tested on recorded outputs.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number, optionally signed, with optional thousands separators and decimals.
# The sign only counts when not glued to a preceding word/number, so "16-3"
# yields 16 and 3 rather than 16 and -3.
_NUMBER = r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|(?<![\w.,])-?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_PHRASE_RE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|=|:)?\s*[:\s]*(?:\*\*)?\s*\$?\s*(" + _NUMBER + ")",
    re.IGNORECASE,
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*([1-9]\d*)\s*\}")
_THINK_BLOCK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_thinking(text: str | None) -> str:
    """Remove reasoning so that numbers/letters inside it are never scored.

    Handles complete ``<think>...</think>`` blocks, a bare ``</think>`` (chat
    templates that open the block inside the prompt), and an unclosed
    ``<think>`` (generation truncated while reasoning: there is no answer).
    """
    if not text:
        return ""
    text = _THINK_BLOCK_RE.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.strip()


def _boxed_contents(text: str) -> list[str]:
    r"""Contents of every ``\boxed{...}`` / ``\fbox{...}``, with nested braces."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def normalize_number(text: str | None) -> str | None:
    """Canonical decimal string ("1,000.00" -> "1000", "-0.50" -> "-0.5")."""
    if text is None:
        return None
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def _first_number(text: str) -> str | None:
    m = _NUMBER_RE.search(text)
    return normalize_number(m.group(0)) if m else None


def _fraction(m: re.Match) -> str:
    return format(Decimal(m.group(1)) / Decimal(m.group(2)), "f")


def _clean_latex(text: str) -> str:
    r"""Plain-number forms of LaTeX: ``1{,}000`` / ``1\,000`` -> 1,000, ``\frac{3}{4}`` -> 0.75."""
    text = text.replace("{,}", ",").replace("\\,", ",").replace("\\!", "").replace("\\$", "$")
    return _FRAC_RE.sub(_fraction, text)


def _last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_gsm8k_answer(text: str | None) -> str | None:
    r"""The model's final numeric answer, normalized, or None.

    Priority: the last ``#### n`` (the GSM8K format the few-shot examples
    teach), the last ``\boxed{n}`` (what reasoning models emit), the last
    "the answer is n" phrase, then the last number in the text.  Commas,
    currency signs and trailing units are dropped by the number pattern.
    """
    text = _clean_latex(strip_thinking(text))
    for payload in reversed(_HASHES_RE.findall(text)):
        number = _first_number(payload)
        if number is not None:
            return number
    for payload in reversed(_boxed_contents(text)):
        number = _first_number(payload)
        if number is not None:
            return number
    phrases = _ANSWER_PHRASE_RE.findall(text)
    if phrases:
        return normalize_number(phrases[-1])
    return _last_number(text)


def gsm8k_gold(answer_field: str) -> str:
    """Gold label of a GSM8K record: the normalized number after ``####``."""
    number = normalize_number(answer_field.rsplit("####", 1)[-1].strip())
    if number is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_field[-80:]!r}")
    return number


def answers_equal(pred: str | None, gold: str) -> bool:
    """Numeric equality of two normalized answers (None never matches)."""
    return pred is not None and Decimal(pred) == Decimal(gold)


_L = r"\(?\**\s*([A-D])\s*\**\)?"
_LETTER_MARKERS = [
    # \boxed{B}, \boxed{\text{B}}, \boxed{(B)}
    re.compile(r"\\boxed\s*\{\s*(?:\\text(?:bf)?\s*\{)?\s*\(?([A-D])\)?"),
    # "answer is (B)", "Answer: B", "correct option is **C**", "answer would be D"
    # (keywords case-insensitive, the letter not: "the answer is a bit unclear" names no option)
    re.compile(
        r"(?i:answer|option|choice)\s*(?i:is|would be|should be|:|=)\s*(?i:option|choice)?\s*[:\s]*" + _L + r"(?![\w'])"
    ),
]
# The whole reply is a letter, e.g. "B", "(B)", "**B**", "B.", "B) Paris", "B: Paris".
_LETTER_ONLY_RE = re.compile(r"^\s*[\(\*\[]*\s*([A-D])\s*[\)\*\]]*\s*(?:[.):]|$)(?:\s|$)")
# Fallback: a standalone capital letter.
_LETTER_ANY_RE = re.compile(r"(?<![\w'])(\(?)([A-D])\)?(?![\w'])")
_ARTICLE_RE = re.compile(r"\s+[a-z]")


def extract_choice(text: str | None, options: list[str] | None = None) -> str | None:
    """The chosen option letter A-D, or None.

    Priority: ``\\boxed{X}``; the last explicit "answer is X" marker (so "A is
    tempting, but the answer is C" gives C); a reply that starts with a
    letter; a reply that is exactly one option's text; the last standalone
    capital letter.
    """
    text = strip_thinking(text)
    for pattern in _LETTER_MARKERS:
        found = pattern.findall(text)
        if found:
            return found[-1]
    m = _LETTER_ONLY_RE.match(text)
    if m:
        return m.group(1)
    if options:
        cleaned = text.strip().strip("*.").strip().lower()
        for letter, option in zip("ABCD", options):
            if cleaned and cleaned == option.strip().strip(".").lower():
                return letter
    found = [
        m.group(2)
        for m in _LETTER_ANY_RE.finditer(text)
        # "A" before a lowercase word is the English article, not option A.
        if not (m.group(2) == "A" and not m.group(1) and _ARTICLE_RE.match(text, m.end()))
    ]
    return found[-1] if found else None
