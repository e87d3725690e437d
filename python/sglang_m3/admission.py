"""Requests no M3 engine can serve, refused at admission (``plugin._admit``), naming the field and value.

* A token id outside the vocabulary. SGLang 0.5.17 has the check
  (``TokenizerManager._validate_input_ids_in_vocab``) but never calls it, so such an id reaches the
  embedding lookup: a device-side assert on CUDA, which takes the server down, and an ``IndexError``
  in the scheduler on CPU.

What EAGLE3 cannot serve is refused by ``spec/admission.py``, from the same hook.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_input_ids(input_ids: Sequence[int] | None, vocab_size: int) -> None:
    """Raise ``ValueError`` for the first id outside ``[0, vocab_size)``."""
    if not input_ids or (min(input_ids) >= 0 and max(input_ids) < vocab_size):
        return
    i, bad = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    raise ValueError(f"input_ids[{i}]={bad}: outside the model's vocabulary [0, {vocab_size})")
