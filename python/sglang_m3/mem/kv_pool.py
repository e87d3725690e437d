"""The M3 KV pool: K/V for every attention layer plus index-K for sparse layers, one slot space.

Built from the parsed ``M3Config`` (SGLang's own builder reads only the released
config spelling and sizes an index-V cache M3 never uses). Storage is SGLang's
``MiniMaxSparseKVPool`` with every sparse layer K-only on the index side.
"""

from __future__ import annotations

import logging

import torch

from ..config import M3Config

logger = logging.getLogger(__name__)

SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bytes_per_token(cfg: M3Config, kv_dtype: torch.dtype, index_dtype: torch.dtype) -> dict[str, int]:
    """Exact KV bytes one token costs, by layer kind and in total."""
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * torch._utils._element_size(kv_dtype)
    index = cfg.msa.index_dim * torch._utils._element_size(index_dtype)
    n_sparse, n_dense = len(cfg.sparse_layer_ids), len(cfg.dense_layer_ids)
    return {
        "dense_layer": kv,
        "sparse_layer": kv + index,
        "total": n_dense * kv + n_sparse * (kv + index),
    }


def check_kv_dtype(kv_dtype: torch.dtype, kv_cache_dtype_str: str | None) -> None:
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype={kv_cache_dtype_str!r} ({kv_dtype}) is not supported by sglang-m3 yet; "
            f"use 'auto' (the model dtype)"
        )


def build_kv_pool(kvc, max_total_num_tokens: int):
    """``KVCacheConfigurator``-side constructor (see ``plugin.py``)."""
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    cfg = M3Config.from_hf(kvc.model_config.hf_config)
    check_kv_dtype(kvc.kv_cache_dtype, kvc.kv_cache_dtype_str)
    budget = bytes_per_token(cfg, kvc.kv_cache_dtype, kvc.kv_cache_dtype)
    logger.info(
        "sglang-m3 KV pool: %d tokens, %d B/token (dense layer %d B, sparse layer %d B incl. index-K), %s",
        max_total_num_tokens, budget["total"], budget["dense_layer"], budget["sparse_layer"], kvc.kv_cache_dtype,
    )
    return MiniMaxSparseKVPool(
        size=max_total_num_tokens,
        page_size=kvc.pool_page_size,
        dtype=kvc.kv_cache_dtype,
        index_dtype=kvc.kv_cache_dtype,
        head_num=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        idx_head_dim=cfg.msa.index_dim,
        dense_layer_ids=cfg.dense_layer_ids,
        sparse_layer_ids=cfg.sparse_layer_ids,
        disable_value_sparse_layer_ids=cfg.sparse_layer_ids,  # M3 has no index value
        device=kvc.device,
        start_layer=kvc.layer_info.start_layer,
        end_layer=kvc.layer_info.end_layer,
    )
