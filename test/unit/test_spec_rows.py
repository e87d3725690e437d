"""Verify-row shaping (``spec/rows.py``) against SGLang's own penalizers applied token by token."""

from __future__ import annotations

import pytest
import torch
from sglang_m3.spec.rows import Penalties, non_finite_requests, penalise_rows, seeded_coins

V = 11


def _reference_row(logits, output, params, stop):
    """SGLang's non-speculative order on one row: additive penalties, min-new-tokens, repetition."""
    out = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    out -= params["frequency"] * counts + params["presence"] * (counts > 0)
    if len(output) < params["min_new"]:
        out[stop] = float("-inf")
    rep = torch.where(counts > 0, torch.tensor(params["repetition"]), torch.tensor(1.0))
    return torch.where(out < 0, out * rep, out / rep)


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency=0.5, presence=0.0, repetition=1.0, min_new=0),
        dict(frequency=0.0, presence=0.75, repetition=1.0, min_new=0),
        dict(frequency=0.0, presence=0.0, repetition=1.3, min_new=0),
        dict(frequency=0.0, presence=0.0, repetition=1.0, min_new=5),
    ],
)
def test_each_row_counts_the_drafts_before_it(params):
    torch.manual_seed(0)
    committed = [[3, 3, 7], [1]]  # two requests' committed outputs
    draft = torch.tensor([[3, 5, 5], [2, 1, 9]])  # K = 3
    logits = torch.randn(2, 4, V) * 3
    stop = torch.zeros(2, V, dtype=torch.bool)
    stop[:, 0] = True
    counts = torch.stack([torch.bincount(torch.tensor(c), minlength=V).float() for c in committed])
    pen = Penalties(
        counts=counts,
        output_len=torch.tensor([len(c) for c in committed]),
        frequency=torch.full((2,), params["frequency"]),
        presence=torch.full((2,), params["presence"]),
        repetition=torch.full((2,), params["repetition"]),
        min_new_tokens=torch.full((2,), params["min_new"]),
        stop=stop,
    )
    got = penalise_rows(logits, draft, pen)
    for i in range(2):
        for t in range(4):
            want = _reference_row(logits[i, t], committed[i] + draft[i, :t].tolist(), params, stop[i])
            torch.testing.assert_close(got[i, t], want)
    # a penalty that ignored the drafts would give row 3 of request 0 the same logits as row 0 for id 5
    if params["frequency"] or params["presence"] or params["repetition"] != 1.0:
        assert not torch.equal(got[0, 3, 5], got[0, 0, 5])


def test_seeded_coins_depend_on_seed_and_position_only():
    a = seeded_coins(torch.tensor([7, 7, 8]), torch.tensor([100, 101, 100]), 4)
    b = seeded_coins(torch.tensor([9, 7]), torch.tensor([3, 100]), 4)
    assert torch.equal(a[0], b[1])  # same (seed, position): same coins, whatever the batch
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert a.dtype == torch.float32 and (a >= 0).all() and (a < 1).all()
    many = seeded_coins(torch.arange(20000), torch.zeros(20000, dtype=torch.long), 1)
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.std().item() - 12**-0.5) < 0.01


def test_non_finite_requests():
    raw = torch.zeros(3, 2, V)
    shaped = raw.clone()
    raw[1, 1, 4] = float("inf")
    shaped[2, 0, 0] = float("nan")
    shaped[0, 0, 0] = float("-inf")  # a mask, not an error
    assert non_finite_requests(raw, shaped).tolist() == [False, True, True]
    assert non_finite_requests(raw, raw).tolist() == [False, True, False]  # nothing shaped: raw alone


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_requests_finds_one_entry_among_many(value, dtype):
    """Any one non-finite entry of a row flags its request, at M3's vocabulary width and in every logits
    dtype (fp16 logits of this width would overflow an fp16 sum: the sum is fp32); large finite logits
    do not."""
    raw = (torch.randn(4, 2, 200_064) * 30).to(dtype)
    raw[:, :, 7] = 6e4 if dtype == torch.float16 else 1e6
    assert not non_finite_requests(raw, raw).any()
    raw[2, 1, 123_456] = value
    assert non_finite_requests(raw, raw).tolist() == [False, False, True, False]
    shaped = raw.clone()
    shaped[0, 0, 5] = float("-inf")  # a mask on another request: not an error
    assert non_finite_requests(raw, shaped).tolist() == [False, False, True, False]
