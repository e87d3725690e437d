"""Which storage format each kind of M3 KV row uses, chosen by SGLang's ``--kv-cache-dtype``.

| ``--kv-cache-dtype``      | dense layers | sparse layers | index-K | draft layer |
|---------------------------|--------------|---------------|---------|-------------|
| ``auto``                  | model dtype  | model dtype   | model   | model dtype |
| ``bf16`` / ``bfloat16``   | BF16         | BF16          | BF16    | BF16        |
| ``fp8_e4m3``              | FP8          | FP8           | FP8     | FP8         |
| ``nvfp4`` (the hybrid)    | FP8          | NVFP4         | FP8     | FP8         |

Sparse layers read only their top-k blocks, so NVFP4's extra error is confined to few
pages; dense layers, the indexer (whose scores pick the pages) and the draft stay FP8.
Bytes are exact: FP8 one byte per element, NVFP4 half a byte plus one E4M3 scale per 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang_m3_kernels.kv_quant import NVFP4_BLOCK

from ..config import M3Config

PLAIN, FP8, NVFP4 = "plain", "fp8", "nvfp4"


@dataclass(frozen=True)
class KVLayout:
    name: str
    dense: str
    sparse: str
    index: str
    draft: str
    plain_dtype: torch.dtype  # storage dtype of PLAIN rows

    def row_bytes(self, fmt: str, elements: int) -> int:
        """Bytes of one token's row of ``elements`` values in format ``fmt``."""
        if fmt == PLAIN:
            return elements * torch._utils._element_size(self.plain_dtype)
        if fmt == FP8:
            return elements
        return elements // 2 + elements // NVFP4_BLOCK  # E2M1 pairs + one E4M3 scale per block


_LAYOUTS = {
    "auto": (PLAIN, PLAIN, PLAIN, PLAIN),
    "bf16": (PLAIN, PLAIN, PLAIN, PLAIN),
    "bfloat16": (PLAIN, PLAIN, PLAIN, PLAIN),
    "fp8_e4m3": (FP8, FP8, FP8, FP8),
    "nvfp4": (FP8, NVFP4, FP8, FP8),
}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in _LAYOUTS:
        raise ValueError(
            f"--kv-cache-dtype={kv_cache_dtype!r} is not supported by sglang-m3; "
            f"supported: {sorted(_LAYOUTS)} (nvfp4 = the hybrid NVFP4/FP8 layout)"
        )


def layout_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVLayout:
    check_kv_cache_dtype(kv_cache_dtype)
    plain = torch.bfloat16 if kv_cache_dtype in ("bf16", "bfloat16") else model_dtype
    return KVLayout(kv_cache_dtype, *_LAYOUTS[kv_cache_dtype], plain_dtype=plain)


def bytes_per_token(
    cfg: M3Config, layout: KVLayout, draft_kv_heads: tuple[int, ...] = (), kv_heads: int | None = None
) -> dict[str, int]:
    """Exact KV bytes one token costs on one rank: per layer kind, per draft layer, and in total.

    ``kv_heads``: the rank's KV heads per target layer (all of them by default: TP1);
    ``draft_kv_heads``: the rank's KV heads of each EAGLE3 draft layer (head_dim as the target's).
    The index-K head is one per sparse layer on every rank.
    """
    kv = 2 * (cfg.num_kv_heads if kv_heads is None else kv_heads) * cfg.head_dim
    dense = layout.row_bytes(layout.dense, kv)
    sparse = layout.row_bytes(layout.sparse, kv)
    index = layout.row_bytes(layout.index, cfg.msa.index_dim)
    draft = [layout.row_bytes(layout.draft, 2 * h * cfg.head_dim) for h in draft_kv_heads]
    total = len(cfg.dense_layer_ids) * dense + len(cfg.sparse_layer_ids) * (sparse + index) + sum(draft)
    return {"dense_layer": dense, "sparse_layer": sparse, "index_k": index, "draft": sum(draft), "total": total}
