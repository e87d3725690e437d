"""M3 attention layer: projections, per-head Gemma QK norm, partial RoPE, and (on
sparse layers) the lightning-indexer projections; the MSA itself is the backend's.

The layer calls the forward context's attention backend directly, with the index
tensors as keyword arguments, rather than through ``RadixAttention.forward``:
that method routes extend batches carrying ``idx_q`` into SGLang's own MiniMax op.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from ..config import M3Config
from ..parallel import RankHeads, rank_heads
from .layers import FUSED_HEAD_DIM, FUSED_ROTARY_DIM, GemmaNorm, PartialNeoxRope, fused_qk_norm_rope


class Indexer(nn.Module):
    """``index_q [T, H_idx, D_idx]`` (this rank's index heads: one per local KV group) and the
    shared ``index_k [T, D_idx]`` (replicated), normed and rotated. One GEMM projects both
    (``qk_proj``: this rank's q heads' rows of ``index_q_proj``, then ``index_k_proj``), or, on CUDA
    in half precision beside an unquantised ``qkv_proj`` or one quantised row by row, the attention's
    qkv GEMM projects them too (``M3Attention.fuse_qkv_index``). Unquantised on its own: its scores pick
    the pages."""

    def __init__(self, cfg: M3Config, heads: RankHeads, rope: PartialNeoxRope, prefix: str):
        super().__init__()
        msa = cfg.msa
        self.heads, self.dim = heads.kv_heads, msa.index_dim
        self.qk_proj = ReplicatedLinear(
            cfg.hidden_size, (self.heads + 1) * self.dim, bias=False, prefix=f"{prefix}.qk_proj"
        )
        self.qk_proj.weight.weight_loader = self._load_qk(heads.first_kv_head)
        self.q_norm = GemmaNorm(msa.index_dim, eps=cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(msa.index_dim, eps=cfg.rms_norm_eps)
        self.rope = rope

    def _load_qk(self, first_head: int):
        q_rows = self.heads * self.dim

        def load(param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
            if shard == "q":  # this rank's heads of the checkpoint's index_q_proj
                param.data[:q_rows].copy_(loaded.narrow(0, first_head * self.dim, q_rows))
            else:
                param.data[q_rows:].copy_(loaded)

        return load

    def norm_groups(self, first_head: int) -> list[tuple[torch.Tensor, int, int]]:
        """``fused_qk_norm_rope`` groups of this indexer's ``[index q | index k]`` heads from ``first_head``."""
        return [(self.q_norm.weight, first_head, self.heads), (self.k_norm.weight, first_head + self.heads, 1)]

    def split(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, (H_idx + 1) D_idx]`` -> views ``index_q [T, H_idx, D_idx]``, ``index_k [T, D_idx]``."""
        q, k = qk.split([self.heads * self.dim, self.dim], dim=-1)
        return q.view(qk.shape[0], self.heads, self.dim), k

    def norm_rope(self, qk: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path (CPU, fp32): normed and rotated copies of ``split(qk)``."""
        q, k = self.split(qk)
        cos, sin = self.rope.cos_sin(positions)
        q, k = self.q_norm(q), self.k_norm(k.unsqueeze(1))  # [T, H_idx, D_idx], [T, 1, D_idx]
        return self.rope(q, cos, sin), self.rope(k, cos, sin).view(qk.shape[0], self.dim)


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
        # Set by ``use_fused_norm_rope`` (CUDA, bf16): the cos/sin table of SGLang's fused kernel.
        self.cos_sin_table: torch.Tensor | None = None
        # Set by ``fuse_qkv_index``: the layer whose weight holds both projections, where the indexer's rows start.
        self.qkv_index: SimpleNamespace | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv_index is not None:  # one GEMM: [q | k | v | index q | index k]
            out = self.qkv_proj.quant_method.apply(self.qkv_index.layer, x)
            qkv, index_qk = out[:, : self.qkv_index.split], out[:, self.qkv_index.split :]
        else:
            out = qkv = self.qkv_proj(x)[0]
            index_qk = self.indexer.qk_proj(x)[0] if self.indexer is not None else None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views of qkv
        index = {}
        if self.cos_sin_table is not None:  # in place, through the views
            table, eps = self.cos_sin_table, self.q_norm.variance_epsilon
            groups = [(self.q_norm.weight, 0, self.num_heads), (self.k_norm.weight, self.num_heads, self.num_kv_heads)]
            if self.qkv_index is not None:  # all four groups in one launch
                groups += self.indexer.norm_groups(self.qkv_index.split // self.head_dim)
            elif index_qk is not None:
                fused_qk_norm_rope(index_qk, self.indexer.norm_groups(0), table, positions, eps)
            fused_qk_norm_rope(out, groups, table, positions, eps)
            if index_qk is not None:
                index["index_q"], index["index_k"] = self.indexer.split(index_qk)
        else:
            cos, sin = self.rope.cos_sin(positions)
            q = self.rope(self.q_norm(q.reshape(T, self.num_heads, self.head_dim)), cos, sin).view(T, self.q_size)
            k = self.rope(self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)), cos, sin).view(T, self.kv_size)
            if index_qk is not None:
                index["index_q"], index["index_k"] = self.indexer.norm_rope(index_qk, positions)
        out = get_attn_backend().forward(q, k, v, self.attn, forward_batch, **index)
        return self.o_proj(out)[0]

    def fuse_qkv_index(self) -> None:
        """Project q / k / v and the indexer's q / k with one GEMM, as SGLang's own M3 path does for
        unquantised weights: at decode sizes the indexer's narrow GEMM and its own norm launch cost more
        than the bytes they read. The two weights are concatenated into one tensor and run through
        ``qkv_proj``'s quant method. Unquantised (SGLang's GEMM dispatch): both layers' parameters become
        views of it (no extra memory; a later weight load writes through). A method that quantises each
        row of the weight on its own scale as it processes it (``quant.quantises_rows_alone``; called
        before that) gets the concatenation as ``qkv_proj``'s weight, so the index rows become FP8 rows of
        the one GEMM with their own scales and the indexer's unquantised copy is released."""
        if self.indexer is None or self.qkv_index is not None:
            return
        qkv, index = self.qkv_proj.weight, self.indexer.qk_proj.weight
        if qkv.dtype != index.dtype:  # already quantised (a loader that restores processed weights)
            return
        fused = torch.cat([qkv.data, index.data], dim=0)  # [W_qkv + W_index, H]
        split = qkv.shape[0]
        if isinstance(self.qkv_proj.quant_method, UnquantizedLinearMethod):
            qkv.data, index.data = fused[:split], fused[split:]
            self.qkv_index = SimpleNamespace(layer=SimpleNamespace(weight=fused), split=split)
        else:
            qkv.data, index.data = fused, fused.new_empty(0, fused.shape[1])
            self.qkv_index = SimpleNamespace(layer=self.qkv_proj, split=split)


def fused_norm_rope_fits(cfg: M3Config) -> bool:
    """Whether SGLang's fused norm + RoPE kernel is built for this model's head shapes."""
    dims = {cfg.head_dim} | ({cfg.msa.index_dim} if any(cfg.sparse_layers) else set())
    return dims == {FUSED_HEAD_DIM} and cfg.rotary_dim == FUSED_ROTARY_DIM


def use_fused_norm_rope(layers: list[M3Attention], table: torch.Tensor) -> None:
    """Norm and rotate q / k (and index q / k) with SGLang's fused kernel over ``table``."""
    for attn in layers:
        attn.cos_sin_table = table
