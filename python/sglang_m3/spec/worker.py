"""EAGLE3 chain speculative decoding for MiniMax-M3 (``--speculative-algorithm EAGLE3``).

SGLang builds this worker instead of its own EAGLE worker for M3 targets
(``plugin.py`` hooks the worker factory). It follows SGLang's spec-v2 scheduler
contract: the scheduler allocates ``kv_committed_len + reserve`` slots per request
before each step (``eagle_prepare_for_decode``), ``batch.seq_lens`` is the committed
length *before* the step's tokens, and the result carries ``next_token_ids``
``[bs * (K + 1)]``, ``accept_lens`` and the next step's ``EagleDraftInput``.

One step (``K`` = ``--speculative-num-steps``, position ``s`` = ``seq_len``):

1. draft chain: ``d_1`` came from the previous step; draft decode ``j = 1..K-1``
   runs at position ``s + j - 1`` on ``d_j`` and the draft's own previous hidden state;
2. verify: the target scores ``[bonus, d_1..d_K]`` at positions ``s..s+K`` as one
   ladder (``TARGET_VERIFY``, each row its own MSA selection), writing target KV;
3. accept (``verify.py``): greedy prefix match or rejection sampling, one bonus;
4. draft catch-up: the draft re-runs the ``K + 1`` verified rows (token ``t+1`` +
   the target's aux hidden state of row ``t``), rewriting its KV with real inputs;
   the row of the last accepted token gives the next ``d_1`` and hidden state.

Draft KV lives in the target's pool (``M3KVPool.draft_view``), in the same slots as
the target's, so rejected positions are simply overwritten by the next step and
finishing a request frees everything.

Under SGLang's overlap scheduler (the default; ``--disable-overlap-schedule`` runs the same
steps synchronously) the worker follows the spec-v2 contract its own EAGLE worker v2 follows:
the scheduler prepares step N + 1 on the host while the device runs step N, so the step's
``seq_lens`` and draft input (``d_1``, hidden state, bonus token) arrive as device tensors
gathered from the ``FutureMap`` (what step N published), never a host copy made before
acceptance. Every length this worker and the MSA plans read (``s``, the ladder, the
``req_to_token`` slots, the plans' page tables in ``attention/metadata.py``) is that corrected
one. ``on_publish(new_seq_lens)`` fires after acceptance, before the catch-up, so the next
step's preparation overlaps the catch-up. Everything of one step runs on the scheduler's
forward stream, so a graph replay's in-place writes land before any later read of its outputs
(the catch-up's outputs are cloned out of the graph pool). Host state that lags one step under
overlap: the grammar FSM, advanced through the scheduler's ``grammar_barrier`` (step N's
committed tokens) before the chain's masks are built; the committed output ids the penalty
tables count, for which such a batch runs synchronously (``needs_synchronous_step``, applied by
``plugin.py``'s scheduler hook). On CUDA with graphs on, the target's verify
replays SGLang's captured graphs and the draft's chain (1) and catch-up (4) replay our
own, one pair per captured batch size (``draft_graphs.py``); batches above the largest
size, CPU and ``--disable-cuda-graph`` run them eagerly through ``runner.forward``.
Acceptance (3) stays eager (its grammar masks and penalty tables are host work); grammar
masks aside (they need the drafts on the host), the step never waits for the device: a
request with non-finite logits is found on the device, its flag copied back behind the step
and read when SGLang's result processor takes that step (``on_verify_complete_cpu``), before
it checks the requests' finish state.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

import torch
from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_utils import _eagle_prefill_tail_tokens
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType
from sglang.srt.speculative.spec_utils import generate_token_bitmask

from ..model.eagle3 import DRAFT_ARCH
from .rows import Penalties, non_finite_requests, penalise_rows, seeded_coins
from .verify import accept_greedy, accept_sampled, target_probs

logger = logging.getLogger(__name__)


@dataclass
class ChainInput(SpecInput):
    """What one of our forwards hands the model through ``forward_batch.spec_info``."""

    hidden_states: Optional[torch.Tensor] = None  # [T or B, H_in] the draft's input hidden states
    positions: Optional[torch.Tensor] = None  # [T] verify-ladder positions (None: SGLang's default)
    num_tokens_per_req: int = 1
    num_tokens_for_logprob_per_req: int = 1
    verify: bool = False

    def __post_init__(self):
        super().__init__(SpecInputType.EAGLE_VERIFY if self.verify else SpecInputType.EAGLE_DRAFT)


class M3Eagle3Worker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        super().__init__()
        self.server_args = server_args
        self.device = server_args.device
        self.num_steps = server_args.speculative_num_steps
        self._target_worker = target_worker
        # The draft runs as sglang-m3's draft class (``model/eagle3.py``), not SGLang's Llama.
        draft_args = copy.deepcopy(server_args)
        draft_args.override("sglang_m3.draft", json_model_override_args=json.dumps({"architectures": [DRAFT_ARCH]}))
        bundle = build_draft_tp_worker(
            server_args=draft_args,
            gpu_id=gpu_id,
            ps=replace(ps, pp_rank=0),
            nccl_port=nccl_port,
            target_model_config=target_worker.model_config,
            algo_label="EAGLE3 (sglang-m3)",
            attention_backend_override="m3_msa",
        )
        self._draft_worker = bundle.draft_worker
        self.draft_runner = bundle.draft_model_runner
        draft = self.draft_runner.model
        draft.set_embed(target_worker.model_runner.model.get_input_embeddings())
        hot = draft.get_hot_token_id()
        self.draft_to_target = hot.to(self.device) if hot is not None else None  # [V_draft] target ids
        self.draft_graphs = None  # ``draft_graphs.DraftGraphs`` once ``init_cuda_graphs`` ran, if any apply
        self._eager_counts = {"eager_chain": 0, "eager_catch_up": 0}
        # (requests, host flags, copy event) of each decode step whose result SGLang has not processed yet
        self._non_finite = deque()
        logger.info("sglang-m3 EAGLE3 chain worker: %d draft steps, %d verify rows", self.num_steps, self.num_steps + 1)

    # -- SGLang's worker interface ------------------------------------------------------
    def init_cuda_graphs(self):
        """SGLang captures the target's graphs first (scheduler order); the draft's own follow,
        in the same graph memory pool."""
        from .draft_graphs import DraftGraphs

        self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=False)
        self.draft_graphs = DraftGraphs.build(self)
        if self.draft_graphs is not None and self.draft_graphs.mode == "cuda_graph":
            self._additional_graph_memory_usage["draft_decode"] = self.draft_graphs.memory_gb
            self._additional_graph_time_usage["draft_decode"] = self.draft_graphs.capture_s

    def update_weights_from_tensor(self, recv_req):
        """SGLang's weight update from tensors (RL trainers), which its scheduler hands the speculative
        worker: the tensors carry the target checkpoint's names, so they go to the target alone and the
        draft keeps its weights (as SGLang's n-gram worker does; a stale draft costs acceptance, never
        tokens). ``BaseSpecWorker`` has no such method: without this one the update raised."""
        return self.target_worker.update_weights_from_tensor(recv_req)

    def sglang_m3_stats(self) -> dict:
        """Which path the draft's passes took, counted per pass since start-up; surfaced through
        ``Engine.get_server_info()["internal_states"][rank]["sglang_m3_eagle3"]`` (``plugin.py``)."""
        graphs = self.draft_graphs
        base = graphs.stats() if graphs is not None else {"draft_graphs": "off", "sizes": []}
        return {**base, **self._eager_counts}

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self.target_worker.model_runner.attn_backend, self.draft_runner.attn_backend)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None) -> GenerationBatchResult:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._prefill(batch, on_publish)
        return self._decode(batch, on_publish, grammar_barrier)

    @staticmethod
    def needs_synchronous_step(batch) -> bool:
        """Whether this decode batch must see the previous step's committed output on the host,
        so the overlap scheduler processes that step first (``plugin.py``): penalties and
        ``min_new_tokens`` count ``req.output_ids``, which under overlap lack the step in flight.
        Grammars need no such step: their FSM is advanced by ``grammar_barrier``."""
        return batch.forward_mode.is_decode() and any(_has_penalty(r.sampling_params) for r in batch.reqs)

    # -- prefill: target extend, then the draft over the prompt -----------------------------
    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens  # spec-v2: length before the next step's tokens
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        # The draft at position p reads token p + 1 and the target's hidden state at p.
        tail = _eagle_prefill_tail_tokens(batch, out.next_token_ids)
        shifted = torch.empty_like(batch.input_ids)
        start = 0
        for i, n in enumerate(batch.extend_lens):
            shifted[start : start + n - 1] = batch.input_ids[start + 1 : start + n]
            shifted[start + n - 1] = tail[i]
            start += n
        lo, _ = self._run(
            self.draft_runner,
            batch,
            ForwardMode.EXTEND,
            input_ids=shifted,
            out_cache_loc=batch.out_cache_loc,
            seq_lens=batch.seq_lens,
            spec_info=ChainInput(hidden_states=out.logits_output.hidden_states),
            capture=CaptureHiddenMode.LAST,
        )
        out.next_draft_input = self._draft_input(lo.next_token_logits, lo.hidden_states, out.next_token_ids)
        return out

    # -- decode: draft chain, verify, accept, draft catch-up --------------------------------
    def _decode(self, batch, on_publish, grammar_barrier=None) -> GenerationBatchResult:
        K, R = self.num_steps, self.num_steps + 1
        info: EagleDraftInput = batch.spec_info
        s = batch.seq_lens  # [bs] committed length before this step
        bs = s.shape[0]
        rows = torch.arange(R, device=s.device)
        ladder = s.unsqueeze(1) + rows  # [bs, R] positions s..s+K
        slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices.unsqueeze(1), ladder]  # [bs, R]

        draft = None
        if self.draft_graphs is not None and K > 1:  # K = 1: no draft forward before verify
            draft = self.draft_graphs.chain(info.topk_index[:, 0], info.hidden_states, s, batch.req_pool_indices, slots)
        if draft is None:
            draft = self._eager_chain(batch, info, s, slots)  # [bs, K]

        verify_ids = torch.cat([info.bonus_tokens.to(draft.dtype).unsqueeze(1), draft], dim=1)  # [bs, R]
        lo, graphed = self._run(
            self.target_worker.model_runner,
            batch,
            ForwardMode.TARGET_VERIFY,
            input_ids=verify_ids.reshape(-1),
            out_cache_loc=slots.reshape(-1),
            seq_lens=s,
            spec_info=ChainInput(positions=ladder.reshape(-1), num_tokens_per_req=R, verify=True),
            capture=CaptureHiddenMode.FULL,
        )
        tokens, accept_len, bad = self._accept(batch, verify_ids, lo.next_token_logits.view(bs, R, -1), grammar_barrier)
        bad_host, copied = self._to_host_later(bad)
        if batch.return_logprob:
            compute_spec_v2_logprobs(
                batch, lo, tokens.reshape(-1), torch.arange(bs * R, device=s.device).view(bs, R), K
            )
        new_seq_lens = s + accept_len
        if on_publish is not None:
            on_publish(new_seq_lens)

        # Catch-up: row t gets token t + 1 (= tokens[t] where accepted) and the target's hidden of row t.
        seed = None
        if self.draft_graphs is not None:
            seed = self.draft_graphs.catch_up(tokens, lo.hidden_states, s, batch.req_pool_indices, slots, accept_len)
        if seed is None:
            seed = self._eager_catch_up(batch, tokens, lo.hidden_states, s, ladder, slots, accept_len)
        bonus = tokens.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1)
        lo.hidden_states = None  # the aux states are consumed; don't ship them to the scheduler
        self._non_finite.append((list(batch.reqs), bad_host, copied))
        return GenerationBatchResult(
            logits_output=lo,
            next_token_ids=tokens.reshape(-1),
            accept_lens=accept_len,
            new_seq_lens=new_seq_lens,
            speculative_num_draft_tokens=R,
            next_draft_input=self._seed(*seed, bonus),
            can_run_cuda_graph=graphed,
        )

    def _eager_chain(self, batch, info, s, slots):
        """Drafts ``[bs, K]`` through ``runner.forward`` (no graph covers this batch)."""
        self._eager_counts["eager_chain"] += int(self.num_steps > 1)  # K = 1 has no chain forward

        def decode(j, d, hidden):
            return self._run(
                self.draft_runner,
                batch,
                ForwardMode.DECODE,
                input_ids=d,
                out_cache_loc=slots[:, j - 1].contiguous(),
                seq_lens=s + j,
                spec_info=ChainInput(hidden_states=hidden),
                capture=CaptureHiddenMode.LAST,
            )[0]

        return draft_chain(info.topk_index[:, 0], info.hidden_states, self.num_steps, decode, self._to_target)

    def _eager_catch_up(self, batch, tokens, aux, s, ladder, slots, accept_len):
        """(next ``d_1`` ``[bs, 1]``, hidden ``[bs, H]``) through ``runner.forward``."""
        self._eager_counts["eager_catch_up"] += 1
        bs, R = tokens.shape
        dlo, _ = self._run(
            self.draft_runner,
            batch,
            ForwardMode.TARGET_VERIFY,
            input_ids=tokens.reshape(-1),
            out_cache_loc=slots.reshape(-1),
            seq_lens=s,
            spec_info=ChainInput(hidden_states=aux, positions=ladder.reshape(-1), num_tokens_per_req=R, verify=True),
            capture=CaptureHiddenMode.FULL,
        )
        last = torch.arange(bs, device=s.device) * R + accept_len - 1  # row of the last committed token
        return self._to_target(dlo.next_token_logits[last].argmax(dim=-1, keepdim=True)), dlo.hidden_states[last]

    def _accept(self, batch, verify_ids, logits, grammar_barrier=None):
        """Tokens ``[bs, K + 1]``, accept lengths ``[bs]`` (``verify.py``) from the rows shaped as
        SGLang's sampler shapes one token (``rows.py``), and ``[bs]`` flags of requests whose logits
        are not finite: those commit one placeholder token (id 0) and end with an error at the end
        of the step. All on the device: acceptance does not wait for the host (verify on such rows
        gives valid ids, which are replaced)."""
        draft = verify_ids[:, 1:]
        shaped = self._shape_rows(batch, verify_ids, logits, grammar_barrier)
        bad = non_finite_requests(logits, shaped)
        tokens, accept_len = self._verify(batch, draft, shaped)
        tokens = tokens.masked_fill(bad.unsqueeze(1), 0)
        return tokens, accept_len.masked_fill(bad, 1), bad

    @staticmethod
    def _to_host_later(flags):
        """A host copy of ``flags`` queued behind the work so far, and the event to wait on before
        reading it (None on the CPU)."""
        if not flags.is_cuda:
            return flags, None
        host = flags.to("cpu", non_blocking=True)  # into pinned memory: no wait here
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _verify(self, batch, draft, shaped):
        info = batch.sampling_info
        greedy_tokens, greedy_len = accept_greedy(draft, shaped)
        if info.is_all_greedy:
            return greedy_tokens, greedy_len
        bs, R, V = shaped.shape
        per_row = lambda x: x.reshape(bs).repeat_interleave(R)  # noqa: E731  [bs] -> [bs * R]
        filtered = info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling
        probs = target_probs(
            shaped.reshape(bs * R, V),
            per_row(info.temperatures),
            per_row(info.top_ks),
            per_row(info.top_ps),
            per_row(info.min_ps),
            filtered=filtered,
            keep_width=_top_k_bound(batch.reqs) if filtered else None,  # the bound only shapes filtered rows
        ).view(bs, R, V)
        if info.sampling_seed is not None:  # under --enable-deterministic-inference: every request's (42 unseeded)
            u = seeded_coins(info.sampling_seed.reshape(bs), batch.seq_lens, R)
        else:
            u = torch.rand(bs, R, device=shaped.device)
        tokens, accept_len = accept_sampled(draft, probs, u[:, :-1], u[:, -1])
        # A greedy request (temperature 0) inside a sampled batch keeps exact argmax semantics.
        is_greedy = (info.temperatures.reshape(bs) <= 1e-5) | (info.top_ks.reshape(bs) == 1)
        return (
            torch.where(is_greedy.unsqueeze(1), greedy_tokens, tokens),
            torch.where(is_greedy, greedy_len, accept_len),
        )

    def _shape_rows(self, batch, verify_ids, logits, grammar_barrier=None):
        """Penalties, grammar masks and logit bias on the verify rows ``[bs, R, V]``, in SGLang's order.
        ``grammar_barrier`` (overlap scheduling) first advances each grammar over the tokens the
        previous step committed, which the host has not processed yet."""
        bs, R, V = logits.shape
        reqs, info = batch.reqs, batch.sampling_info
        out = logits
        if any(_has_penalty(r.sampling_params) for r in reqs):
            out = penalise_rows(out, verify_ids[:, 1:], _penalties(reqs, V, logits.device))
        if batch.has_grammar:
            if grammar_barrier is not None:
                grammar_barrier()
            out = out.float().clone() if out is logits else out
            chain_next = torch.tensor([*range(1, R), -1]).repeat(bs, 1)  # row t's child is row t + 1
            # SGLang's tree walk over the chain: advances each grammar along the drafts it allows, fills
            # one mask per row (row 0: the state after the committed tokens) and rolls back.
            masks, grammar = generate_token_bitmask(
                reqs, chain_next, torch.full_like(chain_next, -1), verify_ids.cpu(), V
            )
            grammar.apply_vocab_mask(out.view(bs * R, V), grammar.move_vocab_mask(masks, out.device))
        if info.logit_bias is not None:
            out = out + info.logit_bias.view(bs, 1, -1)
        return out

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        """SGLang's result processor calls this once per decode step's result, in launch order, with the
        accept lengths on the host and before it updates the requests' finish state: the step's
        non-finite flags are read here, so the forward itself never waits for the device."""
        reqs, bad, copied = self._non_finite.popleft()
        assert len(reqs) == batch_size, (len(reqs), batch_size)
        if copied is not None:
            copied.synchronize()  # long done: the result's own copies were queued behind it
        if bad.any():
            self._abort_non_finite(reqs, bad)

    @staticmethod
    def _abort_non_finite(reqs, bad) -> None:
        for i in bad.nonzero().flatten().tolist():
            reqs[i].to_finish = FINISH_ABORT(
                "sglang-m3 EAGLE3: the target produced non-finite logits (NaN or inf) for this request",
                status_code=500,
                err_type="InternalServerError",
            )

    # -- helpers --------------------------------------------------------------------------
    def _run(self, runner, batch, mode, *, input_ids, out_cache_loc, seq_lens, spec_info, capture):
        """One forward of ``runner`` over the batch's requests with the given rows; (logits, graph replayed)."""
        b = copy.copy(batch)  # shallow: the scheduler's batch keeps its own fields
        b.forward_mode, b.input_ids, b.out_cache_loc, b.spec_info = mode, input_ids, out_cache_loc, spec_info
        b.seq_lens = seq_lens
        b.seq_lens_cpu = seq_lens.cpu() if seq_lens.device.type == "cpu" else None
        b.seq_lens_sum = None
        b.return_logprob = False
        fb = ForwardBatch.init_new(b, runner, capture_hidden_mode=capture, return_hidden_states_before_norm=False)
        out = runner.forward(fb)
        return out.logits_output, out.can_run_graph

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def _draft_input(self, logits, hidden, bonus) -> EagleDraftInput:
        """Next step's seed from the draft's logits of each request's last row."""
        return self._seed(self._to_target(logits.argmax(dim=-1, keepdim=True)), hidden, bonus)

    @staticmethod
    def _seed(d1, hidden, bonus) -> EagleDraftInput:
        """Next step's seed: ``d_1`` ``[bs, 1]`` (target ids, in ``topk_index``), hidden state, bonus token."""
        return EagleDraftInput(
            topk_p=torch.ones_like(d1, dtype=torch.float32),
            topk_index=d1,
            hidden_states=hidden,
            bonus_tokens=bonus.to(torch.int32),
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )


def draft_chain(d1, hidden, num_steps, decode, to_target) -> torch.Tensor:
    """Drafts ``d_1..d_K`` ``[bs, K]`` from ``d_1`` and the draft's hidden state: draft decode ``j = 1..K-1``
    (``decode(j, d_j, hidden)`` -> SGLang's logits output, at position ``s + j - 1``) predicts ``d_{j+1}``.
    The worker's eager chain and the captured chain body (``draft_graphs.py``) differ only in ``decode``."""
    drafts = [d1]
    for j in range(1, num_steps):
        out = decode(j, drafts[-1], hidden)
        drafts.append(to_target(out.next_token_logits.argmax(dim=-1)))
        hidden = out.hidden_states
    return torch.stack(drafts, dim=1)


TOP_K_WIDTH_MAX = 1024  # the largest top-k the verify's filters take from torch.topk instead of a sort


def _top_k_bound(reqs) -> int | None:
    """The largest top-k of the batch when every request sets one up to ``TOP_K_WIDTH_MAX`` (greedy requests
    hold top-k 1), else None: ``target_probs(keep_width=...)``. From the host's sampling params: no sync."""
    ks = [r.sampling_params.top_k for r in reqs]
    return max(ks) if ks and all(0 < k <= TOP_K_WIDTH_MAX for k in ks) else None


def _has_penalty(params) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


def _penalties(reqs, vocab: int, device) -> Penalties:
    """The committed state of each request's penalties (SGLang's penaltylib keeps only the last token
    of each speculative step, so it is rebuilt here from the requests' outputs). Only the token ids
    cross to the device; the ``[bs, V]`` tables are built there."""
    bs = len(reqs)
    # non_blocking: a pageable host copy is staged at once, without waiting for the device's queue
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    out_rows = as_tensor([i for i, r in enumerate(reqs) for _ in r.output_ids], torch.long)
    out_ids = as_tensor([t for r in reqs for t in r.output_ids], torch.long)
    counts = torch.zeros(bs, vocab, dtype=torch.float32, device=device)
    counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True)
    stop_rows, stop_ids = [], []
    for i, r in enumerate(reqs):
        if r.sampling_params.min_new_tokens > 0:  # the stop ids SGLang's min-new-tokens penalizer holds back
            tok = r.tokenizer
            ids = set(r.sampling_params.stop_token_ids or ()) | set(
                getattr(tok, "additional_stop_token_ids", None) or ()
            )
            if getattr(tok, "eos_token_id", None) is not None:
                ids.add(tok.eos_token_id)
            ids = [t for t in ids if 0 <= t < vocab]
            stop_rows += [i] * len(ids)
            stop_ids += ids
    stop = torch.zeros(bs, vocab, dtype=torch.bool, device=device)
    stop[as_tensor(stop_rows, torch.long), as_tensor(stop_ids, torch.long)] = True
    p = [r.sampling_params for r in reqs]
    return Penalties(
        counts=counts,
        output_len=as_tensor([len(r.output_ids) for r in reqs], torch.long),
        frequency=as_tensor([x.frequency_penalty for x in p], torch.float32),
        presence=as_tensor([x.presence_penalty for x in p], torch.float32),
        repetition=as_tensor([x.repetition_penalty for x in p], torch.float32),
        min_new_tokens=as_tensor([x.min_new_tokens for x in p], torch.long),
        stop=stop,
    )
