"""The EAGLE3 draft's two passes per spec step as CUDA graphs, one pair per captured batch size.

SGLang's ``CudaGraphRunner`` refuses draft workers, so without this module the draft's
K - 1 chain forwards and its catch-up pass ran eagerly (``ForwardBatch.init_new`` and
``runner.forward`` each time): host work that, at real widths, costs more than the
speculation saves. Two graphs per batch size, not one and not the whole step:

* ``chain``: ``d_1`` [bs], the draft's hidden state [bs, H], committed lengths ``s``,
  ``req_pool_indices``, the step's slots [bs, K + 1] -> drafts ``d_1..d_K`` [bs, K]
  (target ids, through ``d2t``); draft decode ``j = 1..K-1`` at position ``s + j - 1``.
* ``catch_up``: the verified tokens [bs, K + 1], the target's aux hidden states
  [bs * (K + 1), 3H], ``s``, ``req_pool_indices``, slots, ``accept_len`` -> the next
  ``d_1`` [bs, 1] and hidden state [bs, H] of each request's last accepted row.

Between them sit the target's verify (already SGLang's graph) and acceptance, whose
grammar masks and penalty tables are host-side work; and the step boundary goes
through the scheduler (requests join and leave), so neither the two passes nor the
catch-up of one step and the chain of the next can be one graph.

A batch of ``b`` requests replays the smallest captured size ``>= b``: the live rows
are copied into static buffers and the padded rows get what SGLang's
``DecodeCudaGraphRunner`` gives its own (``req_pool_indices`` 0, ``seq_lens`` the
backend's fill value 1, KV slots 0: the allocator's reserved padding page, which no
request owns), tokens 0 and ``accept_len`` 1. The graph bodies build their
``ForwardBatch`` over those buffers as SGLang's capture does and run the draft model
with the ``m3_msa`` plan inside (pure device ops over ``req_pool_indices`` /
``seq_lens`` / ``out_cache_loc``, page table as wide as ``req_to_token``: no host
maximum in any gather). No host synchronisation inside; the inputs are never written
by the bodies, so warm-up needs no save/restore; the catch-up's outputs are cloned
out of the graph pool right after replay (they outlive the step, and the pool is
shared with the target's graphs).

Sizes: the target's captured decode sizes (``DecodeCudaGraphRunner.capture_bs``) on
CUDA with graphs on. Anything else (CPU, ``--disable-cuda-graph``, a batch above the
largest size) runs the worker's eager path. ``SGLANG_M3_DRAFT_STATIC_BS=2,4`` (a test
and debugging switch) runs the same bodies over the same padded static buffers
eagerly where no graphs are captured, so the CPU suite exercises this path.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Callable, Optional

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from .worker import ChainInput, draft_chain

logger = logging.getLogger(__name__)

STATIC_BS_ENV = "SGLANG_M3_DRAFT_STATIC_BS"


def static_sizes_from_env(environ=os.environ) -> list[int]:
    value = environ.get(STATIC_BS_ENV, "").strip()
    if not value:
        return []
    try:
        sizes = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{STATIC_BS_ENV}={value!r}: expected comma-separated batch sizes, e.g. 2,4") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{STATIC_BS_ENV}={value!r}: batch sizes must be >= 1")
    return sizes


class DraftGraphs:
    """Static buffers and per-size bodies (CUDA graphs when ``capture``) of the draft's two passes."""

    def __init__(self, worker, sizes: list[int], capture: bool, exact_sizes_only: bool = False):
        runner = worker.draft_runner
        self.runner, self.model, self.attn_backend = runner, runner.model, runner.attn_backend
        self.spec_algorithm = runner.spec_algorithm
        self.to_target: Callable[[torch.Tensor], torch.Tensor] = worker._to_target
        self.K = K = worker.num_steps
        self.R = R = K + 1
        self.sizes = sorted(set(sizes))
        self.exact_sizes_only = exact_sizes_only
        self.mode = "cuda_graph" if capture else "static"
        self.counts = {"chain_replays": 0, "catch_up_replays": 0}
        n, device = self.sizes[-1], runner.device
        hidden, aux = self.model.config.hidden_size, self.model.fc.in_features
        i64 = dict(dtype=torch.int64, device=device)
        # Inputs (allocated outside any graph pool). Padded rows: see the module docstring.
        self.d1 = torch.zeros(n, **i64)
        self.hidden = torch.zeros(n, hidden, dtype=runner.dtype, device=device)
        self.seq_lens = torch.ones(n, **i64)
        self.req_pool_indices = torch.zeros(n, **i64)
        self.slots = torch.zeros(n, R, **i64)
        self.tokens = torch.zeros(n, R, **i64)
        self.aux = torch.zeros(n * R, aux, dtype=worker.target_worker.model_runner.dtype, device=device)
        self.accept_len = torch.ones(n, **i64)
        self._rows = torch.arange(R, **i64)
        self._reqs = torch.arange(n, **i64)
        self._pad = {  # buffer -> value of its padded rows; hidden / aux keep stale rows (read by padded rows only)
            "d1": 0,
            "seq_lens": 1,
            "req_pool_indices": 0,
            "slots": 0,
            "tokens": 0,
            "accept_len": 1,
        }
        self._graphs: dict = {}  # (pass, bs) -> (CUDAGraph, outputs)
        self._chain_inputs: Optional[tuple] = None  # (seq_lens, req_pool_indices, slots) this step's chain loaded
        self.memory_gb = self.capture_s = 0.0
        if capture:
            self._capture()

    # -- building -------------------------------------------------------------------------
    @classmethod
    def build(cls, worker) -> Optional["DraftGraphs"]:
        """Graphs at the target's captured sizes on CUDA; the eager static bodies at
        ``SGLANG_M3_DRAFT_STATIC_BS`` where there are none; else None (the worker's eager path)."""
        target = getattr(worker.target_worker.model_runner, "decode_cuda_graph_runner", None)
        exact = bool(getattr(worker.server_args, "disable_cuda_graph_padding", False))
        sizes = list(getattr(target, "capture_bs", None) or ())
        if worker.draft_runner.device == "cuda" and sizes:
            return cls(worker, sizes, capture=True, exact_sizes_only=exact)
        static = static_sizes_from_env()
        if static:
            logger.info("sglang-m3 EAGLE3: draft passes over static padded buffers (eager) at sizes %s", static)
            return cls(worker, static, capture=False)
        return None

    def _capture(self) -> None:
        from sglang.srt.distributed.device_communicators.pynccl_allocator import set_graph_pool_id
        from sglang.srt.distributed.parallel_state import graph_capture
        from sglang.srt.model_executor.runner import freeze_gc, model_capture_mode
        from sglang.srt.model_executor.runner_utils.pool import get_or_create_global_graph_memory_pool

        tic = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = get_or_create_global_graph_memory_pool(torch.cuda)  # the target's graphs' pool
        set_graph_pool_id(pool)
        passes = [("catch_up", self._catch_up_body)] + ([("chain", self._chain_body)] if self.K > 1 else [])
        enable_gc = bool(getattr(self.runner.server_args, "enable_cudagraph_gc", False))
        name, bs = None, None
        try:
            with model_capture_mode(), freeze_gc(enable_gc), graph_capture() as ctx:
                for bs in reversed(self.sizes):  # largest first, so smaller sizes reuse its pool memory
                    for name, body in passes:
                        for _ in range(2):  # warm-up: kernels compiled / autotuned, one-time setup paid
                            torch.cuda.synchronize()
                            self.runner.tp_group.barrier()
                            body(bs)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=ctx.stream):
                            out = body(bs)
                        self._graphs[name, bs] = (graph, out)
        except RuntimeError as exc:
            raise RuntimeError(
                f"sglang-m3 EAGLE3: capturing the draft's {name} CUDA graph at bs={bs} failed: {exc} "
                "(--disable-cuda-graph runs the draft eagerly)"
            ) from exc
        torch.cuda.synchronize()
        self.memory_gb = max(free_before - torch.cuda.mem_get_info()[0], 0) / 2**30
        self.capture_s = time.perf_counter() - tic
        logger.info(
            "sglang-m3 EAGLE3: captured draft chain + catch-up CUDA graphs for bs=%s (%.2f GB, %.1f s)",
            self.sizes,
            self.memory_gb,
            self.capture_s,
        )

    # -- the bodies (captured on CUDA, run as they are otherwise) -------------------------
    def _forward(self, mode, bs, *, input_ids, seq_lens, out_cache_loc, positions, spec_info, capture):
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=input_ids,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=seq_lens,
            seq_lens_cpu=None,
            orig_seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=None,  # host-side; m3_msa plans from the device tensors only
            return_logprob=False,
            positions=positions,
            spec_algorithm=self.spec_algorithm,
            spec_info=spec_info,
            capture_hidden_mode=capture,
            global_forward_mode=mode,
        )
        with forward_context(ForwardContext(attn_backend=self.attn_backend)):
            self.attn_backend.init_forward_metadata(fb)
            return self.model.forward(fb.input_ids, fb.positions, fb)

    def _chain_body(self, bs: int) -> torch.Tensor:
        s, slots = self.seq_lens[:bs], self.slots[:bs]

        def decode(j, d, hidden):
            lens = s + j
            return self._forward(
                ForwardMode.DECODE,
                bs,
                input_ids=d,
                seq_lens=lens,
                out_cache_loc=slots[:, j - 1].contiguous(),
                positions=lens - 1,  # what SGLang's clamp_position gives (s >= 1), in plain torch
                spec_info=ChainInput(hidden_states=hidden),
                capture=CaptureHiddenMode.LAST,
            )

        return draft_chain(self.d1[:bs], self.hidden[:bs], self.K, decode, self.to_target)  # [bs, K]

    def _catch_up_body(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        R, s = self.R, self.seq_lens[:bs]
        ladder = (s.unsqueeze(1) + self._rows).reshape(-1)  # [bs * R] positions s..s+K
        out = self._forward(
            ForwardMode.TARGET_VERIFY,
            bs,
            input_ids=self.tokens[:bs].reshape(-1),
            seq_lens=s,
            out_cache_loc=self.slots[:bs].reshape(-1),
            positions=ladder,
            spec_info=ChainInput(hidden_states=self.aux[: bs * R], positions=ladder, num_tokens_per_req=R, verify=True),
            capture=CaptureHiddenMode.FULL,
        )
        last = self._reqs[:bs] * R + self.accept_len[:bs] - 1  # row of each request's last committed token
        d1 = self.to_target(out.next_token_logits[last].argmax(dim=-1, keepdim=True))  # [bs, 1]
        return d1, out.hidden_states[last]

    # -- replay ---------------------------------------------------------------------------
    def size_for(self, raw_bs: int) -> Optional[int]:
        """The captured size a batch of ``raw_bs`` replays, or None (eager)."""
        i = bisect.bisect_left(self.sizes, raw_bs)
        if i == len(self.sizes) or (self.exact_sizes_only and self.sizes[i] != raw_bs):
            return None
        return self.sizes[i]

    def chain(self, d1, hidden, seq_lens, req_pool_indices, slots) -> Optional[torch.Tensor]:
        """Drafts ``[b, K]`` for ``b`` live requests, or None when no captured size covers ``b``."""
        raw = seq_lens.shape[0]
        bs = self.size_for(raw)
        if bs is None:
            return None
        self._load(raw, bs, d1=d1, hidden=hidden, seq_lens=seq_lens, req_pool_indices=req_pool_indices, slots=slots)
        self._chain_inputs = (seq_lens, req_pool_indices, slots)  # the catch-up's too: loaded once
        self.counts["chain_replays"] += 1
        return self._run("chain", bs)[:raw]  # consumed (copied into the verify ids) before the next replay

    def catch_up(self, tokens, aux, seq_lens, req_pool_indices, slots, accept_len):
        """(next ``d_1`` ``[b, 1]``, hidden ``[b, H]``), or None when no captured size covers ``b``."""
        raw = seq_lens.shape[0]
        bs = self.size_for(raw)
        if bs is None:
            return None
        live = dict(tokens=tokens, aux=aux, accept_len=accept_len)
        shared = dict(seq_lens=seq_lens, req_pool_indices=req_pool_indices, slots=slots)
        chained, self._chain_inputs = self._chain_inputs, None  # never carried into the next step
        # the same tensors (the same seq_lens: the same batch and size) are in the static buffers already
        if chained is None or any(a is not b for a, b in zip(chained, shared.values())):
            live.update(shared)  # no chain ran this step (K = 1, or it ran eagerly): load them here
        self._load(raw, bs, **live)
        self.counts["catch_up_replays"] += 1
        d1, hidden = self._run("catch_up", bs)
        return d1[:raw].clone(), hidden[:raw].clone()  # out of the graph pool: they outlive this step

    def _load(self, raw: int, bs: int, **live) -> None:
        for name, src in live.items():
            buf = getattr(self, name)
            rows = raw * self.R if name == "aux" else raw
            buf[:rows].copy_(src)
            if name in self._pad and bs > raw:
                buf[raw:bs].fill_(self._pad[name])

    def _run(self, name: str, bs: int):
        if self.mode == "static":
            return self._catch_up_body(bs) if name == "catch_up" else self._chain_body(bs)
        graph, out = self._graphs[name, bs]
        graph.replay()
        return out

    def stats(self) -> dict:
        return {"draft_graphs": self.mode, "sizes": list(self.sizes), **self.counts}
