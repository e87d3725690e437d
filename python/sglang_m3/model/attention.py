"""M3 attention layer: projections, per-head Gemma QK norm, partial RoPE, and (on
sparse layers) the lightning-indexer projections; the MSA itself is the backend's.

The layer calls the forward context's attention backend directly, with the index
tensors as keyword arguments, rather than through ``RadixAttention.forward``:
that method routes extend batches carrying ``idx_q`` into SGLang's own MiniMax op.
"""

from __future__ import annotations

import torch
from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from ..config import M3Config
from ..parallel import RankHeads, rank_heads
from .layers import GemmaNorm, PartialNeoxRope


def _head_rows_loader(first: int, rows_per_head: int):
    """Weight loader of a projection that keeps only this rank's heads' rows of the checkpoint tensor."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, first * rows_per_head, param.shape[0]))

    return load


class Indexer(nn.Module):
    """``index_q [T, H_idx, D_idx]`` (this rank's index heads: one per local KV group) and the
    shared ``index_k [T, D_idx]`` (replicated), normed and rotated. Unquantised: its scores
    pick the pages."""

    def __init__(self, cfg: M3Config, heads: RankHeads, rope: PartialNeoxRope, prefix: str):
        super().__init__()
        msa = cfg.msa
        self.heads, self.dim = heads.kv_heads, msa.index_dim
        self.q_proj = ReplicatedLinear(cfg.hidden_size, self.heads * self.dim, bias=False, prefix=f"{prefix}.q_proj")
        self.q_proj.weight.weight_loader = _head_rows_loader(heads.first_kv_head, self.dim)
        self.k_proj = ReplicatedLinear(cfg.hidden_size, msa.index_dim, bias=False, prefix=f"{prefix}.k_proj")
        self.q_norm = GemmaNorm(msa.index_dim, eps=cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(msa.index_dim, eps=cfg.rms_norm_eps)
        self.rope = rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x)[0].view(T, self.heads, self.dim))  # [T, H_idx, D_idx]
        k = self.k_norm(self.k_proj(x)[0].view(T, 1, self.dim))  # [T, 1, D_idx]
        return self.rope(q, cos, sin), self.rope(k, cos, sin).view(T, self.dim)


class M3Attention(nn.Module):
    def __init__(self, cfg: M3Config, layer_id: int, prefix: str, quant_config=None):
        super().__init__()
        heads = rank_heads(
            cfg.num_heads, cfg.num_kv_heads, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = GemmaNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.rope = PartialNeoxRope(cfg.rotary_dim, cfg.rope_theta)
        self.indexer = (
            Indexer(cfg, heads, self.rope, prefix=f"{prefix}.indexer") if cfg.sparse_layers[layer_id] else None
        )
        self.attn = RadixAttention(
            self.num_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch) -> torch.Tensor:
        T = x.shape[0]
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.rope.cos_sin(positions)
        q = self.rope(self.q_norm(q.reshape(T, self.num_heads, self.head_dim)), cos, sin)  # [T, Hq, D]
        k = self.rope(self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)), cos, sin)  # [T, Hkv, D]
        index = {}
        if self.indexer is not None:
            index["index_q"], index["index_k"] = self.indexer(x, cos, sin)
        out = get_attn_backend().forward(
            q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v.contiguous(), self.attn, forward_batch, **index
        )
        return self.o_proj(out)[0]
