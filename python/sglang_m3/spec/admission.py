"""Requests the EAGLE3 chain worker cannot serve faithfully, refused at admission.

Verify accepts drafts against the target's plain sampling distribution
(temperature, top-k, top-p, min-p; ``verify.py``). Constrained decoding (the grammar's
vocabulary mask must advance along the draft chain), penalties, logit biases, minimum
lengths and custom logit processors reshape that distribution per token; applying
them to the verify rows is not implemented, so such requests get a clear error
(HTTP 400 through the server) instead of silently different output.
"""

from __future__ import annotations

from typing import Any, Mapping

# field -> the value that means "not used"
_NEUTRAL = {
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": None,
}


def check_sampling_params(params: Mapping[str, Any] | None, custom_logit_processor: Any = None) -> None:
    """Raise ``ValueError`` naming the first sampling field the chain worker cannot honour."""
    for field, neutral in _NEUTRAL.items():
        value = (params or {}).get(field, neutral)
        if value not in (neutral, None) and value != {}:
            raise ValueError(
                f"sampling_params.{field}={value!r} is not supported with EAGLE3 speculative decoding "
                "in sglang-m3 (serve without --speculative-algorithm for it)"
            )
    if custom_logit_processor:
        raise ValueError("custom_logit_processor is not supported with EAGLE3 speculative decoding in sglang-m3")
