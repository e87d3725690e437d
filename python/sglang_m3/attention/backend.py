"""``m3_msa``: the MiniMax-M3 attention backend for SGLang.

``init_forward_metadata`` plans the batch once (``metadata.py``); each layer then
stores its K/V (and index-K on sparse layers) at the batch's slots and runs
selection + attention over the pool's pages. Dense layers are MSA with no
selection (plain causal attention over the same pages).

Modes: extend (prefill, chunked prefill, EAGLE3 draft prefill), decode (target and
draft decode steps) and target-verify (the speculative ladder, also used for the
draft's catch-up pass over the verified rows). The same backend serves the EAGLE3
draft runner, whose pool is a view of the target's (``M3KVPool.draft_view``); the
draft's layers are dense.

On CUDA the Triton kernels (``sglang_m3_kernels.msa_topk`` / ``msa_attention``) read
the pool's quantised pages in place. On CPU the PyTorch references (their oracle)
read the pool's dequantised view of the whole layer, which is fine for CPU-sized pools.
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang_m3_kernels.msa_index_topk import msa_topk, msa_topk_ref
from sglang_m3_kernels.msa_sparse_attn import msa_attention, msa_attention_ref

from ..config import M3Config, is_m3_config
from .metadata import MSAMetadata, plan_decode, plan_extend, plan_verify


class M3MSABackend(AttentionBackend):
    needs_cpu_seq_lens = False  # plans read device tensors only

    def __init__(self, model_runner):
        super().__init__()
        hf_config = model_runner.model_config.hf_config
        # The EAGLE3 draft runner (a Llama-style draft) has dense layers only: no MSA config.
        self.msa = M3Config.from_hf(hf_config).msa if is_m3_config(hf_config) else None
        self.page_size = model_runner.page_size
        if self.msa is not None and self.page_size != self.msa.block_size:  # the start-up override guarantees this
            raise ValueError(f"m3_msa needs page_size == index block size {self.msa.block_size}, got {self.page_size}")
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        scales = getattr(model_runner.model, "kv_cache_scales", None)
        if scales is not None and hasattr(self.pool, "set_scales"):
            self.pool.set_scales(scales())  # the checkpoint's FP8 KV scales, before any KV is written
        self.metadata: MSAMetadata | None = None

    # -- planning: once per batch, all device ops (no host sync) --------------------------
    def init_forward_metadata(self, forward_batch):
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Plan the batch. Decode and verify plans are static-shape tensor ops on the
        batch's own buffers, so SGLang records them into the CUDA graph and every replay
        re-plans from the replayed ``seq_lens`` / ``req_pool_indices``; the page table is
        bounded by ``req_to_token``'s width, never by a captured context length."""
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            self.metadata = plan_decode(
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, self.page_size
            )
        elif mode.is_target_verify():
            batch = forward_batch.req_pool_indices.shape[0]
            self.metadata = plan_verify(
                self.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                forward_batch.input_ids.shape[0] // max(batch, 1),
                self.page_size,
            )
        elif mode.is_extend():
            self.metadata = plan_extend(
                self.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.extend_prefix_lens,
                forward_batch.extend_seq_lens,
                self.page_size,
                max_len=self._host_max_len(forward_batch),
            )
        else:
            raise NotImplementedError(f"m3_msa: forward mode {mode!r} is not supported")

    @staticmethod
    def _host_max_len(forward_batch) -> int | None:
        """The longest sequence of a prefill batch (never captured: ``plugin.py`` keeps prefill graphs
        off), from the scheduler's host copy of the lengths, which it builds prefill batches from;
        None for every other batch (decode, verify, mixed: with overlap scheduling their host
        lengths can trail the device's, or be absent, ``needs_cpu_seq_lens`` being False)."""
        lens = forward_batch.seq_lens_cpu
        if lens is None or forward_batch.forward_mode != ForwardMode.EXTEND or get_is_capture_mode():
            return None
        return int(lens.max())

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Nothing to preallocate: the plan's tensors are created inside the captured graph."""

    def get_cuda_graph_seq_len_fill_value(self):
        return 1  # padded rows decode position 0 of their (padding) request

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k):
        lid, T = layer.layer_id, q.shape[0]
        if save_kv_cache:  # K, V and index-K in one store
            self.pool.set_kv_buffer(
                layer,
                forward_batch.out_cache_loc,
                k.view(T, layer.tp_k_head_num, layer.qk_head_dim),
                v.view(T, layer.tp_v_head_num, layer.v_head_dim),
                index_k=index_k,
            )
        block_ids = self._select(index_q, lid) if index_q is not None else None
        out = self._attend(q.view(T, layer.tp_q_head_num, layer.qk_head_dim), lid, block_ids, layer.scaling)
        return out.view(T, -1)

    def _select(self, index_q, lid):
        md, msa = self.metadata, self.msa
        args = (md.page_table, md.row_req, md.row_pos)
        kw = dict(block_size=msa.block_size, topk=msa.topk_blocks, local_blocks=msa.local_blocks)
        store = self.pool.index_store(lid)
        if store.data.is_cuda:
            return msa_topk(index_q, store.data[:, 0], *args, k_scale=store.scale, **kw)
        return msa_topk_ref(index_q, self.pool.read_index_k(lid), *args, **kw)

    def _attend(self, q, lid, block_ids, scale):
        md = self.metadata
        args = (md.page_table, md.row_req, md.row_pos, block_ids)
        k, v = self.pool.kv_stores(lid)
        if k.data.is_cuda:
            return msa_attention(
                q,
                k.data,
                v.data,
                *args,
                block_size=self.page_size,
                scale=scale,
                k_scale=k.scale,
                v_scale=v.scale,
                k_scales=k.scales,
                v_scales=v.scales,
            )
        k_cache, v_cache = self.pool.read_kv(lid)
        return msa_attention_ref(q, k_cache, v_cache, *args, block_size=self.page_size, scale=scale)
