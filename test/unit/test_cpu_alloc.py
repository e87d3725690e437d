"""The CPU paths of SGLang's paged allocator (plugin hooks) keep its invariants."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang_m3.mem.cpu_alloc import alloc_decode_cpu, alloc_extend_cpu

P = 4


def _allocator(pages: int):
    return PagedTokenToKVPoolAllocator(pages * P, P, torch.float32, "cpu", kvcache=None, need_sort=False)


def _extend(a, prefix, seq, last_loc):
    prefix_t, seq_t = torch.tensor(prefix), torch.tensor(seq)
    return alloc_extend_cpu(a, prefix_t, prefix_t, seq_t, seq_t, torch.tensor(last_loc), int(sum(seq) - sum(prefix)))


def test_extend_then_decode_is_page_aligned_and_disjoint():
    a = _allocator(8)
    free0 = a.available_size()
    out = _extend(a, [0, 0], [5, 3], [-1, -1])  # two fresh requests
    req0, req1 = out[:5], out[5:]
    for req in (req0, req1):  # token i sits at offset i % P of its page
        assert torch.equal(req % P, torch.arange(len(req)) % P)
        inside = [i for i in range(1, len(req)) if i % P]
        assert all(req[i] == req[i - 1] + 1 for i in inside)  # a page's tokens are consecutive slots
    assert len(set(out.tolist())) == 8
    assert a.available_size() == free0 - 3 * P  # 2 pages + 1 page
    # decode: request 0 (len 5 -> 6) stays in its page, request 1 (len 3 -> 4) too; then 1 (len 4 -> 5) opens one
    dec = alloc_decode_cpu(a, torch.tensor([6, 4]), torch.tensor([6, 4]), torch.stack([req0[-1], req1[-1]]))
    assert dec.tolist() == [req0[-1].item() + 1, req1[-1].item() + 1]
    dec2 = alloc_decode_cpu(a, torch.tensor([7, 5]), torch.tensor([7, 5]), dec)
    assert dec2[0] == dec[0] + 1 and dec2[1] % P == 0 and dec2[1] // P not in (out // P).tolist()
    assert a.available_size() == free0 - 4 * P


def test_short_pool_returns_none_and_keeps_state():
    a = _allocator(2)
    assert _extend(a, [0], [9], [-1]) is None  # needs 3 pages, 2 exist (SGLang reserves none here)
    assert a.available_size() == 2 * P
    full = _extend(a, [0], [8], [-1])
    assert full is not None and a.available_size() == 0
    # no page left: a decode that needs none still works, one that needs a page gets None
    assert alloc_decode_cpu(a, torch.tensor([8]), torch.tensor([8]), full[-2:-1]) is not None
    assert alloc_decode_cpu(a, torch.tensor([9]), torch.tensor([9]), full[-1:]) is None


def test_assign_req_to_token_cpu_writes_each_requests_range():
    from sglang_m3.mem.cpu_alloc import assign_req_to_token_cpu

    table = torch.full((4, 12), -1, dtype=torch.int32)
    reqs, start, end = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    slots = torch.tensor([40, 41, 42, 50, 51])
    assign_req_to_token_cpu(reqs, table, start, end, slots)
    assert table[2, 3:6].tolist() == [40, 41, 42] and table[0, :2].tolist() == [50, 51]
    assert (table == -1).sum() == 48 - 5  # nothing else written
