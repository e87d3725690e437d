"""The MSA PyTorch references (the CPU serving path and the kernels' oracle), on fresh random inputs.

Sparse cases use contexts longer than top-k x block (here 4 x 8 = 32 tokens).
fp32 throughout; a layout change (page permutation) must not change a single bit.
"""

from __future__ import annotations

import torch
from sglang_m3_kernels.msa_index_topk import msa_topk_ref, msa_topk_shared_ref
from sglang_m3_kernels.msa_sparse_attn import msa_attention_ref

BLOCK, TOPK, LOCAL = 8, 4, 1


def _paged(lengths, heads_kv, dim, index_dim, *, shuffle: bool, seed: int):
    """Random caches + page table for requests of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // BLOCK) for n in lengths]
    total_pages = sum(pages_per_req) + 1
    order = torch.randperm(total_pages, generator=g) if shuffle else torch.arange(total_pages)
    page_table = torch.zeros(len(lengths), max(pages_per_req), dtype=torch.int64)
    nxt = 0
    for r, n in enumerate(pages_per_req):
        page_table[r, :n] = order[nxt : nxt + n]
        nxt += n
    slots = total_pages * BLOCK
    k = torch.randn(slots, heads_kv, dim, generator=g)
    v = torch.randn(slots, heads_kv, dim, generator=g)
    ik = torch.randn(slots, index_dim, generator=g)
    return page_table, k, v, ik


def _decode_rows(lengths):
    return torch.arange(len(lengths)), torch.tensor(lengths) - 1


def test_selection_matches_brute_force():
    lengths = [5, 33, 70, 101]
    page_table, _, _, ik = _paged(lengths, 1, 8, 16, shuffle=True, seed=1)
    row_req, row_pos = _decode_rows(lengths)
    iq = torch.randn(len(lengths), 2, 16, generator=torch.Generator().manual_seed(2))
    got = msa_topk_ref(iq, ik, page_table, row_req, row_pos, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    for r, n in enumerate(lengths):
        p = n - 1
        for h in range(2):
            scores = {}
            for b in range(p // BLOCK + 1):
                keys = [
                    page_table[r, j // BLOCK] * BLOCK + j % BLOCK for j in range(b * BLOCK, min((b + 1) * BLOCK, p + 1))
                ]
                scores[b] = max(float(iq[r, h] @ ik[s]) for s in keys)
            scores[p // BLOCK] = float("inf")  # the local block always wins a slot
            want = sorted(scores, key=lambda b: (-scores[b], b))[:TOPK]
            want += [-1] * (TOPK - len(want))
            assert got[r, h].tolist() == want, (r, h)


def test_dense_equivalence_below_threshold():
    lengths = [7, 20, 32]  # <= top-k blocks: MSA is dense causal attention
    page_table, k, v, ik = _paged(lengths, 2, 16, 16, shuffle=True, seed=3)
    row_req, row_pos = _decode_rows(lengths)
    g = torch.Generator().manual_seed(4)
    q, iq = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    sel = msa_topk_ref(iq, ik, page_table, row_req, row_pos, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    sparse = msa_attention_ref(q, k, v, page_table, row_req, row_pos, sel, block_size=BLOCK, scale=0.25)
    dense = msa_attention_ref(q, k, v, page_table, row_req, row_pos, None, block_size=BLOCK, scale=0.25)
    assert torch.equal(sparse, dense)


def test_attention_matches_naive_loop_and_drops_blocks():
    lengths = [45, 90]
    page_table, k, v, ik = _paged(lengths, 2, 8, 8, shuffle=True, seed=5)
    # verify-style ladder: 3 rows per request at consecutive positions, one crossing a block boundary
    row_req = torch.tensor([0, 0, 0, 1, 1, 1])
    row_pos = torch.tensor([38, 39, 40, 87, 88, 89])
    g = torch.Generator().manual_seed(6)
    q, iq = torch.randn(6, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    sel = msa_topk_ref(iq, ik, page_table, row_req, row_pos, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    out = msa_attention_ref(q, k, v, page_table, row_req, row_pos, sel, block_size=BLOCK, scale=0.3)
    dense = msa_attention_ref(q, k, v, page_table, row_req, row_pos, None, block_size=BLOCK, scale=0.3)
    assert not torch.allclose(out, dense, atol=1e-3)  # blocks were really dropped
    assert not torch.equal(sel[1], sel[2])  # rows 39 and 40 sit in different blocks: own selections
    for r in range(6):
        for h in range(4):
            grp = h // 2
            keys = [j for j in range(row_pos[r] + 1) if j // BLOCK in sel[r, grp].tolist()]
            slots = [page_table[row_req[r], j // BLOCK] * BLOCK + j % BLOCK for j in keys]
            s = torch.stack([q[r, h] @ k[s_, grp] for s_ in slots]) * 0.3
            want = torch.softmax(s, 0) @ torch.stack([v[s_, grp] for s_ in slots])
            torch.testing.assert_close(out[r, h], want, atol=1e-5, rtol=1e-5)


def test_page_permutation_is_bit_exact():
    lengths = [50, 77]
    flat = _paged(lengths, 2, 8, 8, shuffle=False, seed=7)
    pt, k, v, ik = flat
    # the same token contents scattered through a random page permutation
    perm = torch.randperm(k.shape[0] // BLOCK, generator=torch.Generator().manual_seed(8))
    slot_map = (perm[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    k2, v2, ik2 = torch.empty_like(k), torch.empty_like(v), torch.empty_like(ik)
    k2[slot_map], v2[slot_map], ik2[slot_map] = k, v, ik
    pt2 = perm[pt]
    row_req, row_pos = _decode_rows(lengths)
    g = torch.Generator().manual_seed(9)
    q, iq = torch.randn(2, 4, 8, generator=g), torch.randn(2, 2, 8, generator=g)
    args = dict(block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    sel1, sel2 = (
        msa_topk_ref(iq, ik, pt, row_req, row_pos, **args),
        msa_topk_ref(iq, ik2, pt2, row_req, row_pos, **args),
    )
    assert torch.equal(sel1, sel2)
    o1 = msa_attention_ref(q, k, v, pt, row_req, row_pos, sel1, block_size=BLOCK, scale=0.2)
    o2 = msa_attention_ref(q, k2, v2, pt2, row_req, row_pos, sel2, block_size=BLOCK, scale=0.2)
    assert torch.equal(o1, o2)


def test_per_group_selection_differs_from_shared_only_with_several_groups():
    lengths = [200] * 4
    pt, _, _, ik = _paged(lengths, 1, 8, 16, shuffle=True, seed=10)
    row_req, row_pos = _decode_rows(lengths)
    args = dict(block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    iq1 = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(11))
    assert torch.equal(
        msa_topk_ref(iq1, ik, pt, row_req, row_pos, **args), msa_topk_shared_ref(iq1, ik, pt, row_req, row_pos, **args)
    )
    iq2 = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(12))
    per_group = msa_topk_ref(iq2, ik, pt, row_req, row_pos, **args)
    shared = msa_topk_shared_ref(iq2, ik, pt, row_req, row_pos, **args)
    assert not torch.equal(per_group, shared)
    assert not torch.equal(per_group[:, 0], per_group[:, 1])  # the two groups pick different blocks
