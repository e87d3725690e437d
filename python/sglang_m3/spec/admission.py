"""Requests the EAGLE3 chain worker cannot serve faithfully, refused at admission.

Verify shapes every row the way SGLang's sampler shapes one token (penalties and
``min_new_tokens`` in ``rows.py``, grammar masks and logit bias in ``worker.py``), so those
requests are served.
Refused, each with a message naming the field and the value:

* a custom logit processor: arbitrary code over one row's logits and the request's state;
  running it per verify row with a state that includes unaccepted drafts is not
  implemented;
* ``sampling_seed`` without ``--enable-deterministic-inference``: SGLang only seeds its
  sampler in that mode and otherwise ignores the seed silently; under EAGLE3 the request
  is refused instead. In that mode verify takes its coins from the seed
  (``rows.seeded_coins``).
"""

from __future__ import annotations

from typing import Any, Mapping


def check_sampling_params(
    params: Mapping[str, Any] | None, custom_logit_processor: Any = None, deterministic: bool = False
) -> None:
    """Raise ``ValueError`` naming what the chain worker cannot honour."""
    if custom_logit_processor:
        raise ValueError(
            f"custom_logit_processor={str(custom_logit_processor)[:80]!r} is not supported with EAGLE3 speculative "
            "decoding in sglang-m3 (serve without --speculative-algorithm for it)"
        )
    seed = (params or {}).get("sampling_seed")
    if seed is not None and not deterministic:
        raise ValueError(
            f"sampling_params.sampling_seed={seed!r} needs --enable-deterministic-inference (SGLang seeds its "
            "sampler only in that mode); sglang-m3 refuses it under EAGLE3 rather than ignore it"
        )
