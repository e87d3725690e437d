"""Kernel-test set-up and the helpers the attention tests share (as fixtures).

* Makes ``kernel/`` importable as ``sglang_m3_kernels`` when the package is not installed
  (a plain checkout), by loading it through importlib under that name.
* Triton's CPU interpreter is switched on by test/conftest.py (before Triton is imported).
  GPU parity tests carry ``@pytest.mark.gpu`` and are skipped there by test/conftest.py.
* ``peaked_q`` and ``rel_err``: queries whose softmax depends on which keys are attended, and
  the error metric the attention bounds are stated in.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

if importlib.util.find_spec("sglang_m3_kernels") is None:
    _root = pathlib.Path(__file__).resolve().parents[2] / "kernel"
    _spec = importlib.util.spec_from_file_location(
        "sglang_m3_kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["sglang_m3_kernels"] = _mod
    _spec.loader.exec_module(_mod)

PEAK_LOGIT = 12.0  # softmax logit of the planted key; the others are ~N(0, 144 / D)


def _peaked_q(k_view, page_table, row_req, row_pos, block_ids, group, block_size, scale, gen):
    """Queries each dominated by one attended key, picked at random per (row, query head).

    ``q[r, h] = a * k[j] + noise`` with ``a`` such that ``q . k[j] * scale = PEAK_LOGIT``, where key
    ``j`` lies in a block the row attends (``block_ids``, or any causal block when ``None``) at a
    position ``<= row_pos``. That key takes ~95 % or more of the softmax, so the output is nearly
    its value row: reading a wrong page or a wrong scale block moves it by O(1) of its norm,
    where random queries (a near-flat softmax over thousands of keys) would barely move.
    Returns ``(q [R, Hkv * group, D] fp32, slot [R, Hkv * group])``: the planted keys' cache slots.
    """
    rows, hkv, dim = len(row_req), k_view.shape[1], k_view.shape[2]
    heads, dev = hkv * group, k_view.device
    gdev = gen.device  # draws come from the generator's device (a CPU one seeds the interp tests on CUDA too)
    pos = row_pos.long()[:, None].expand(rows, heads)  # [R, H]
    if block_ids is None:
        blk = (torch.rand(rows, heads, generator=gen, device=gdev).to(dev) * (pos // block_size + 1)).long()
    else:
        ids = block_ids.long().repeat_interleave(group, dim=1)  # [R, H, topk]
        pick = torch.rand(ids.shape, generator=gen, device=gdev).to(dev).masked_fill(ids < 0, -1.0)
        blk = ids.gather(-1, pick.argmax(-1, keepdim=True)).squeeze(-1)  # a random non-empty slot
    offset = torch.randint(0, block_size, blk.shape, generator=gen, device=gdev).to(dev)
    key = torch.minimum(blk * block_size + offset, pos)
    page = page_table.long()[row_req.long()[:, None], key // block_size]
    slot = page * block_size + key % block_size  # [R, H]
    k = k_view[slot, (torch.arange(heads, device=dev) // group)[None, :].expand(rows, -1)].float()  # [R, H, D]
    a = PEAK_LOGIT / (k.pow(2).sum(-1, keepdim=True) * scale)
    noise = torch.randn(rows, heads, dim, generator=gen, device=gdev).to(dev) * 0.1
    return a * k + noise, slot


def _rel_err(out, ref):
    """Largest relative RMS error over (row, head): ``||out - ref|| / ||ref||`` per output row."""
    return ((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)).max().item()


@pytest.fixture
def peaked_q():
    return _peaked_q


@pytest.fixture
def rel_err():
    return _rel_err
