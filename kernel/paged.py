"""Paged-KV addressing shared by the MSA references and kernels.

Layout contract (the same for every kernel in this package):

* A token cache is token-slot major: ``cache[slot, ...]``. Slot ``s`` lives in
  physical page ``s // page_size`` at offset ``s % page_size``.
* ``page_size`` equals the MSA index block size, so logical block ``b`` of a
  request *is* its page ``page_table[req, b]``; token ``j`` of that request sits
  in slot ``page_table[req, j // page_size] * page_size + j % page_size``.
* ``page_table``: int32/int64 ``[num_reqs, max_pages]``; entries past a request's
  length are ignored (they may hold anything).
* Query rows: ``row_req[R]`` (which page-table row a query row reads) and
  ``row_pos[R]`` (the absolute position of the query token; it sees keys
  ``0..row_pos`` inclusive). Decode has one row per request, speculative verify
  ``1 + draft`` rows per request, prefill one row per new token.
"""

from __future__ import annotations

import torch


def request_slots(page_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slot ids of tokens ``0..length-1`` of one request, ``[length]`` int64."""
    num_pages = -(-length // page_size)
    pages = page_table_row[:num_pages].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:length]


def rows_by_request(row_req: torch.Tensor):
    """Yield ``(req, row_ids)`` for each distinct request among the rows.

    References process one request at a time so they read its history once.
    """
    for req in torch.unique(row_req).tolist():
        yield req, torch.nonzero(row_req == req, as_tuple=False).flatten()


_SM_COUNTS: dict[str, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 132 (an H200) elsewhere, e.g. the interpreter."""
    key = str(device)
    if key not in _SM_COUNTS:
        cuda = device.type == "cuda"
        _SM_COUNTS[key] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    return _SM_COUNTS[key]


_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced buffers stay alive: a captured CUDA graph may still use them


def counters(device: torch.device, name: str, n: int) -> torch.Tensor:
    """``>= n`` zeroed int32 ticket counters for the kernels' last-program-finishes pattern.

    A kernel that takes tickets leaves every counter it used at 0 when it finishes (the
    program that draws the last ticket resets it), so one cached buffer per (device, name)
    serves every later launch, eager or CUDA-graph replay, with no memset. Launches on the
    same stream are ordered, which is how the model runs its layers; kernels of one name
    must not run concurrently on two streams. Called while a graph is being captured with
    no large-enough buffer cached, it returns a fresh zeroed buffer (a memset node in that
    graph) and caches nothing.
    """
    key = (str(device), name)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    size = max(1024, 1 << max(0, n - 1).bit_length())
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[key] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf
