"""``m3_msa``: the MiniMax-M3 attention backend for SGLang.

``init_forward_metadata`` plans the batch once (``metadata.py``); each layer then
stores its K/V (and index-K on sparse layers) at the batch's slots and runs
selection + attention over the pool's pages. Dense layers are MSA with no
selection (plain causal attention over the same pages).

This is the pure-PyTorch reference path (``sglang_m3_kernels`` ``*_ref``): it runs
on CPU, and it is the oracle for the CUDA kernels. It reads the pool's dequantised
view of a whole layer, which is fine for CPU-sized pools; kernels read pages in place.
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang_m3_kernels.msa_index_topk import msa_topk_ref
from sglang_m3_kernels.msa_sparse_attn import msa_attention_ref

from ..config import M3Config
from .metadata import MSAMetadata, plan_decode, plan_extend


class M3MSABackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.cfg = M3Config.from_hf(model_runner.model_config.hf_config)
        self.page_size = model_runner.page_size
        if self.page_size != self.cfg.msa.block_size:  # the start-up override guarantees this
            raise ValueError(f"m3_msa needs page_size == index block size {self.cfg.msa.block_size}, got {self.page_size}")
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        self.metadata: MSAMetadata | None = None

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            self.metadata = plan_decode(
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, self.page_size
            )
        elif mode.is_extend():
            self.metadata = plan_extend(
                self.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.extend_prefix_lens,
                forward_batch.extend_seq_lens,
                self.page_size,
            )
        else:
            raise NotImplementedError(f"m3_msa: forward mode {mode!r} is not supported yet")

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k):
        md, lid = self.metadata, layer.layer_id
        T = q.shape[0]
        if save_kv_cache:
            loc = forward_batch.out_cache_loc
            self.pool.set_kv_buffer(
                layer, loc, k.view(T, layer.tp_k_head_num, layer.qk_head_dim), v.view(T, layer.tp_v_head_num, layer.v_head_dim)
            )
            if index_k is not None:
                self.pool.set_index_k_buffer(layer, loc, index_k.view(T, 1, -1))
        block_ids = None
        if index_q is not None:
            msa = self.cfg.msa
            block_ids = msa_topk_ref(
                index_q,
                self.pool.read_index_k(lid),
                md.page_table,
                md.row_req,
                md.row_pos,
                block_size=msa.block_size,
                topk=msa.topk_blocks,
                local_blocks=msa.local_blocks,
            )
        k_cache, v_cache = self.pool.read_kv(lid)
        out = msa_attention_ref(
            q.view(T, layer.tp_q_head_num, layer.qk_head_dim),
            k_cache,
            v_cache,
            md.page_table,
            md.row_req,
            md.row_pos,
            block_ids,
            block_size=self.page_size,
            scale=layer.scaling,
        )
        return out.view(T, -1)
