"""Per-batch MSA plan, built once per forward and read by every layer.

Every query token of the batch is a *row*: it reads the page-table row of its
request and sees keys ``0..row_pos``. Decode has one row per request, extend
(prefill, chunked prefill, radix-prefix hits) one row per new token, speculative
verify ``1 + drafts`` rows per request on the ladder (DESIGN section 5). Rows are
in the batch's token order, so row ``t`` is query token ``t``. Each row gets its
own top-k, so a chain that crosses a block boundary never shares one selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MSAMetadata:
    page_table: torch.Tensor  # [B, max_pages] int (req_to_token's dtype), physical page ids of each request
    row_req: torch.Tensor  # [T] int64, batch index of each query row
    row_pos: torch.Tensor  # [T] int, absolute position of each query row

    def __post_init__(self):
        devices = {self.page_table.device, self.row_req.device, self.row_pos.device}
        assert len(devices) == 1, f"MSA metadata split across devices: {devices}"
        assert self.row_req.shape == self.row_pos.shape


def page_table_for(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int, max_len: int | None = None
) -> torch.Tensor:
    """``[B, pages]`` page ids: as wide as the pool's longest context (graph safe), or, given the
    batch's longest sequence ``max_len`` (known on the host, outside graphs), only as wide as that."""
    tokens = req_to_token.shape[1] if max_len is None else min(req_to_token.shape[1], max_len)
    return req_to_token[req_pool_indices, :tokens:page_size] // page_size


def plan_decode(req_to_token, req_pool_indices, seq_lens, page_size: int) -> MSAMetadata:
    """One row per request at position ``seq_len - 1`` (the token being decoded): the one-row ladder."""
    return plan_verify(req_to_token, req_pool_indices, seq_lens - 1, 1, page_size)


def plan_extend(
    req_to_token, req_pool_indices, prefix_lens, extend_lens, page_size: int, max_len: int | None = None
) -> MSAMetadata:
    """One row per new token; request ``i``'s rows sit at ``prefix_i .. prefix_i + extend_i - 1``.

    ``max_len`` (the batch's longest ``prefix + extend``, when the host knows it) narrows the page
    table from the model's longest context to the batch's: the indexer's per-row score buffer is
    ``[rows, heads, pages]`` fp32, 1 GiB for an 8K-token chunk against M3's 1M-token table."""
    batch = req_pool_indices.shape[0]
    extend_lens = extend_lens.long()
    row_req = torch.repeat_interleave(torch.arange(batch, device=extend_lens.device), extend_lens)  # [T]
    starts = torch.cumsum(extend_lens, 0) - extend_lens  # [B] first row of each request
    offset = torch.arange(row_req.shape[0], device=row_req.device) - starts[row_req]
    return MSAMetadata(
        page_table=page_table_for(req_to_token, req_pool_indices, page_size, max_len),
        row_req=row_req,
        row_pos=prefix_lens.long()[row_req] + offset,
    )


def plan_verify(req_to_token, req_pool_indices, seq_lens, rows_per_req: int, page_size: int) -> MSAMetadata:
    """The verify ladder: ``rows_per_req`` rows per request at ``seq_len + t``.

    ``seq_lens`` are the committed lengths *before* this step's tokens (SGLang's
    spec-v2 convention); row ``t`` sees keys ``<= seq_len + t``, i.e. ``kv_len =
    seq_len + qo_len`` and ``p_t = kv_len - qo_len + t``. Fixed shapes, no host sync, and
    few kernels (a plan runs in every captured decode, verify and draft graph): four for a
    decode step, six for a verify.
    """
    batch = req_pool_indices.shape[0]
    rows = torch.arange(batch * rows_per_req, device=seq_lens.device)  # [B * R]
    if rows_per_req == 1:
        row_req, row_pos = rows, seq_lens
    else:
        row_req = rows // rows_per_req
        row_pos = (seq_lens.unsqueeze(1) + torch.arange(rows_per_req, device=seq_lens.device)).view(-1)
    return MSAMetadata(
        page_table=page_table_for(req_to_token, req_pool_indices, page_size), row_req=row_req, row_pos=row_pos
    )
