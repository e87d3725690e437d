"""Torch paths for SGLang's paged allocator on CPU.

``PagedTokenToKVPoolAllocator.alloc_extend/alloc_decode`` launch Triton kernels,
which fail without a GPU ("0 active drivers"). These do the same bookkeeping with
tensor ops: extend reuses SGLang's own ``alloc_extend_naive`` (its NPU allocator
uses it), decode takes a new page only for requests whose next token starts one.
Both check capacity *before* touching ``free_pages`` and return ``None`` when the
pool is short, exactly like the originals.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator import alloc_extend_naive
from sglang.srt.utils import get_num_new_pages


def alloc_extend_cpu(
    self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages=None
):
    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
    if self.need_sort and num_new_pages > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages > len(self.free_pages):
        return None
    out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def alloc_decode_cpu(self, seq_lens, seq_lens_cpu, last_loc):
    num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
    if self.need_sort and num_new_pages > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages > len(self.free_pages):
        return None
    out = last_loc.long() + 1
    if num_new_pages:
        # seq_lens already counts the token being decoded: it opens a page when seq_len % page == 1.
        needs_page = seq_lens % self.page_size == 1  # [B]
        page_idx = torch.cumsum(needs_page.long(), 0) - needs_page.long()  # [B] index into free_pages
        page_idx = page_idx.clamp(max=num_new_pages - 1)  # rows that need no page read a valid dummy
        out = torch.where(needs_page, self.free_pages[page_idx] * self.page_size, out)
        self.free_pages = self.free_pages[num_new_pages:]
    return out


def assign_req_to_token_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc) -> None:
    """``req_to_token[req_i, start_i:end_i] = the next end_i - start_i slots of out_cache_loc``."""
    lengths = (end_offset - start_offset).long()  # [B]
    req = torch.repeat_interleave(req_pool_indices.long(), lengths)  # [N]
    first = torch.cumsum(lengths, 0) - lengths  # [B] first slot of each request in out_cache_loc
    col = torch.arange(req.shape[0]) - torch.repeat_interleave(first - start_offset.long(), lengths)  # [N]
    req_to_token[req, col] = out_cache_loc[: req.shape[0]].to(req_to_token.dtype)
