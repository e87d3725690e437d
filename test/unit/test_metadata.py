"""The per-batch MSA plan: rows, positions and page tables for each forward mode."""

import torch
from sglang_m3.attention.metadata import plan_decode, plan_extend, plan_verify
from torch.utils._python_dispatch import TorchDispatchMode

P = 4


def _req_to_token():
    # Request slot 1 owns pages 5, 2, 7 (tokens 0..11); slot 3 owns pages 0, 6.
    table = torch.zeros(4, 16, dtype=torch.int32)
    for req, pages in ((1, [5, 2, 7]), (3, [0, 6])):
        for i, page in enumerate(pages):
            table[req, i * P : (i + 1) * P] = torch.arange(page * P, (page + 1) * P)
    return table


def test_verify_ladder_rows_and_positions():
    # seq_lens are the committed lengths before the step: rows sit at seq_len + t.
    md = plan_verify(_req_to_token(), torch.tensor([1, 3]), torch.tensor([7, 3]), rows_per_req=4, page_size=P)
    assert md.row_req.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert md.row_pos.tolist() == [7, 8, 9, 10, 3, 4, 5, 6]  # request 0 crosses from page 1 into page 2
    assert md.page_table[0, :3].tolist() == [5, 2, 7] and md.page_table[1, :2].tolist() == [0, 6]


def test_verify_equals_extend_of_the_same_tokens():
    # A verify step is an extend of qo_len tokens on top of the committed prefix.
    table, reqs, lens = _req_to_token(), torch.tensor([1, 3]), torch.tensor([7, 3])
    verify = plan_verify(table, reqs, lens, rows_per_req=3, page_size=P)
    extend = plan_extend(table, reqs, lens, torch.tensor([3, 3]), P)
    assert torch.equal(verify.row_req, extend.row_req) and torch.equal(verify.row_pos, extend.row_pos)


def test_extend_page_table_spans_the_batch_when_its_length_is_known():
    """Given the batch's longest sequence, the extend plan's page table is only as wide as that (the
    indexer's score buffer is rows x heads x pages): the same pages in the same columns, every row's
    own block inside it."""
    table, reqs = _req_to_token(), torch.tensor([1, 3])
    for prefix, extend, pages in (([4, 0], [5, 6], 3), ([0, 2], [5, 3], 2), ([0, 0], [1, 1], 1)):
        prefix, extend = torch.tensor(prefix), torch.tensor(extend)
        longest = int((prefix + extend).max())
        wide = plan_extend(table, reqs, prefix, extend, P)
        narrow = plan_extend(table, reqs, prefix, extend, P, max_len=longest)
        assert wide.page_table.shape == (2, 16 // P) and narrow.page_table.shape == (2, pages)
        assert torch.equal(narrow.page_table, wide.page_table[:, :pages])
        assert torch.equal(narrow.row_pos, wide.row_pos) and torch.equal(narrow.row_req, wide.row_req)
        assert (narrow.row_pos // P).max() < pages


def test_decode_is_the_one_row_ladder():
    table, reqs = _req_to_token(), torch.tensor([1, 3])
    decode = plan_decode(table, reqs, torch.tensor([8, 4]), P)  # seq_lens include the decoded token
    verify = plan_verify(table, reqs, torch.tensor([7, 3]), rows_per_req=1, page_size=P)
    assert torch.equal(decode.row_pos, verify.row_pos) and decode.row_pos.tolist() == [7, 3]


class _Ops(TorchDispatchMode):
    """The aten ops a plan runs, views (which launch no kernel) left out."""

    VIEWS = {"aten.view.default", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.expand.default"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.VIEWS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plans_launch_few_kernels():
    """Decode and verify plans are recorded into every captured graph (target decode, verify, draft
    chain and catch-up): each op is a kernel of each replayed step. Decode: the positions, the row ids,
    the page-table gather and its division; verify adds the ladder's offsets."""
    table, reqs, lens = _req_to_token(), torch.tensor([1, 3]), torch.tensor([8, 4])
    with _Ops() as decode:
        plan_decode(table, reqs, lens, P)
    with _Ops() as verify:
        plan_verify(table, reqs, lens, rows_per_req=4, page_size=P)
    assert len(decode.ops) == 4, decode.ops
    assert len(verify.ops) == 6, verify.ops
