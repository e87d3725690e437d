"""The M3 KV pool: every attention layer's K/V, index-K for sparse layers and K/V for
EAGLE3 draft layers, all addressed by the same token slot (one allocator, one
``req_to_token``, one radix tree), so freeing, eviction and retraction release
target KV, index-K, scales and draft KV together. Page size == MSA block size.

Each row store holds one format (``layout.py``): plain, FP8 (per-tensor scale) or
NVFP4 (E2M1 pairs + E4M3 block scales + global scale); quantised on write,
dequantised on read. On CUDA a layer's K, V and index-K go through one launch of the fused
Triton store; on CPU through the PyTorch references, which are its oracle.
"""

from __future__ import annotations

import copy
import logging

import torch
from sglang.srt.mem_cache.memory_pool import KVCache
from sglang_m3_kernels.kv_quant import (
    dequantize_cache,
    fp8_quantize_ref,
    kv_store_many,
    nvfp4_quantize_ref,
)

from ..config import DraftConfig, M3Config
from ..parallel import rank_heads
from ..sizing import describe, rank_weights
from .layout import FP8, PLAIN, KVLayout, bytes_per_token

logger = logging.getLogger(__name__)


class RowStore:
    """Token rows ``[slots, heads, dim]`` in one storage format."""

    def __init__(self, fmt: str, slots: int, heads: int, dim: int, plain_dtype: torch.dtype, device):
        # ``scale``: the per-tensor dequantisation scale of FP8 rows (value = fp8 x scale) and the global
        # scale of NVFP4 rows; 1.0 unless the checkpoint carries KV scales (``M3KVPool.set_scales``).
        self.fmt, self.scale, self.scales = fmt, 1.0, None
        if fmt == PLAIN:
            self.data = torch.zeros(slots, heads, dim, dtype=plain_dtype, device=device)
        elif fmt == FP8:
            self.data = torch.zeros(slots, heads, dim, dtype=torch.float8_e4m3fn, device=device)
        else:
            self.data = torch.zeros(slots, heads, dim // 2, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(slots, heads, dim // 16, dtype=torch.float8_e4m3fn, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        """Quantise ``x [T, heads, dim]`` into slots ``loc [T]`` (the PyTorch references; on CUDA
        ``write_rows`` takes the fused Triton store)."""
        loc = loc.long()
        if self.fmt == PLAIN:
            self.data[loc] = x.to(self.data.dtype)
        elif self.fmt == FP8:  # CPU float8 tensors take no index_put: write the bytes
            self.data.view(torch.uint8)[loc] = fp8_quantize_ref(x, self.scale).view(torch.uint8)
        else:
            data, scales = nvfp4_quantize_ref(x, self.scale)
            self.data[loc] = data
            self.scales.view(torch.uint8)[loc] = scales.view(torch.uint8)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised copy of every slot (the reference path's view)."""
        return dequantize_cache(self.data, scale=self.scale, scales=self.scales, dtype=dtype)


def write_rows(loc: torch.Tensor, rows: list[tuple[RowStore, torch.Tensor]]) -> None:
    """Each ``(store, x [T, heads, dim])`` quantised into its store at slots ``loc [T]``: on CUDA one
    Triton launch for all of them (a layer's K, V and index-K), on CPU the references."""
    if loc.is_cuda:
        kv_store_many(loc, [(x, store.data, store.scale, store.scales) for store, x in rows])
        return
    for store, x in rows:
        store.write(loc, x)


class M3KVPool(KVCache):
    def __init__(
        self,
        size: int,
        page_size: int,
        cfg: M3Config,
        layout: KVLayout,
        device,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
        draft_kv_heads: tuple[int, ...] = (),
        kv_heads: int | None = None,
    ):
        """``kv_heads``: this rank's KV heads per target layer (``cfg.num_kv_heads`` at TP1);
        ``draft_kv_heads``: this rank's KV heads of each EAGLE3 draft layer."""
        end_layer = cfg.num_layers if end_layer is None else end_layer
        super().__init__(
            size, page_size, layout.plain_dtype, end_layer - start_layer, device, False, start_layer, end_layer
        )
        self.cfg, self.layout, self.draft_kv_heads = cfg, layout, draft_kv_heads
        slots = size + page_size  # SGLang pools keep one spare page for padded writes
        D, H = cfg.head_dim, cfg.num_kv_heads if kv_heads is None else kv_heads
        self.k, self.v, self.index_k = {}, {}, {}
        for lid in range(start_layer, end_layer):
            fmt = layout.sparse if cfg.sparse_layers[lid] else layout.dense
            self.k[lid] = RowStore(fmt, slots, H, D, layout.plain_dtype, device)
            self.v[lid] = RowStore(fmt, slots, H, D, layout.plain_dtype, device)
            if cfg.sparse_layers[lid]:
                self.index_k[lid] = RowStore(layout.index, slots, 1, cfg.msa.index_dim, layout.plain_dtype, device)
        for i, heads in enumerate(draft_kv_heads):  # draft layers follow the target's layer ids
            lid = cfg.num_layers + i
            self.k[lid] = RowStore(layout.draft, slots, heads, D, layout.plain_dtype, device)
            self.v[lid] = RowStore(layout.draft, slots, heads, D, layout.plain_dtype, device)
        stores = [*self.k.values(), *self.v.values(), *self.index_k.values()]
        self.mem_usage = sum(s.nbytes for s in stores) / (1 << 30)
        self.head_num, self.head_dim = H, D

    def set_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Per-layer ``(k_scale, v_scale)`` of quantised rows (the checkpoint's FP8 KV scales). Set once,
        before the first write; plain rows ignore them."""
        for lid, (k_scale, v_scale) in scales.items():
            if lid in self.k:
                self.k[lid].scale, self.v[lid].scale = k_scale, v_scale

    # -- writes (quantise on write) -------------------------------------------------------
    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, index_k=None, **kwargs) -> None:
        """K, V ``[T, heads, dim]`` and, on sparse layers, ``index_k [T, index_dim]`` at slots ``loc``."""
        lid = layer.layer_id
        rows = [(self.k[lid], cache_k), (self.v[lid], cache_v)]
        if index_k is not None:
            rows.append((self.index_k[lid], index_k.reshape(index_k.shape[0], 1, -1)))
        write_rows(loc, rows)

    # -- reads ----------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id].data

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id].data

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def kv_stores(self, layer_id: int) -> tuple[RowStore, RowStore]:
        """K and V stores of a layer (raw pages + scales, for the kernels)."""
        return self.k[layer_id], self.v[layer_id]

    def index_store(self, layer_id: int) -> RowStore:
        """Index-K store ``[slots, 1, D_idx]`` of a sparse layer."""
        return self.index_k[layer_id]

    def read_kv(self, layer_id: int, dtype: torch.dtype = torch.float32):
        """Dequantised K, V ``[slots, H, D]`` of a layer."""
        return self.k[layer_id].read(dtype), self.v[layer_id].read(dtype)

    def read_index_k(self, layer_id: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised index-K ``[slots, D_idx]`` of a sparse layer."""
        return self.index_k[layer_id].read(dtype)[:, 0]

    def draft_view(self) -> "M3KVPool":
        """The EAGLE3 draft runner's window onto this pool: its layer ``i`` is our
        layer ``num_layers + i``. Same stores, same slots, same allocator: a freed or
        evicted slot releases target KV, index-K and draft KV together (DESIGN 6)."""
        if not self.draft_kv_heads:
            raise RuntimeError("this M3 KV pool was built without EAGLE3 draft layers")
        view = copy.copy(self)
        base = self.cfg.num_layers
        n = len(self.draft_kv_heads)
        view.k = {i: self.k[base + i] for i in range(n)}
        view.v = {i: self.v[base + i] for i in range(n)}
        view.index_k = {}
        view.start_layer, view.end_layer, view.layer_num = 0, n, n
        view.head_num = self.draft_kv_heads[0]
        view.mem_usage = sum(view.k[i].nbytes + view.v[i].nbytes for i in range(n)) / (1 << 30)
        return view

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError("sglang-m3's KV pool does not support hierarchical-cache CPU copies")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError("sglang-m3's KV pool does not support hierarchical-cache CPU copies")


def rank_budget(kvc):
    """``(cfg, layout, kv_heads, draft_heads, bytes)``: this rank's exact KV bytes per token of an M3
    target, EAGLE3 draft layers included, from SGLang's ``KVCacheConfigurator``."""
    from .layout import layout_for

    cfg = M3Config.from_hf(kvc.model_config.hf_config)
    layout = layout_for(kvc.kv_cache_dtype_str or "auto", kvc.model_dtype)
    kv_heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, kvc.server_args.tp_size, 0).kv_heads
    draft_heads = draft_kv_heads(kvc.server_args, cfg)
    return cfg, layout, kv_heads, draft_heads, bytes_per_token(cfg, layout, draft_heads, kv_heads)


def build_kv_pool(kvc, max_total_num_tokens: int) -> M3KVPool:
    """``KVCacheConfigurator``-side constructor (see ``plugin.py``); logs what one rank holds."""
    cfg, layout, kv_heads, draft_heads, budget = rank_budget(kvc)
    args = kvc.server_args
    weights = rank_weights(
        cfg,
        args.tp_size,
        args.ep_size,
        getattr(kvc.model_config, "quantization", None) or args.quantization,
        torch._utils._element_size(kvc.model_dtype),
        fp8_checkpoint=getattr(kvc.model_config.hf_config, "quantization_config", None) is not None,
    )
    logger.info(
        "sglang-m3 per rank of TP %d / EP %d: weights %s; KV (%s, %d KV heads/layer) %d B/token = dense layer %d"
        " + sparse layer %d + index-K %d per sparse layer + draft %d; capacity %d tokens (%d pages of %d)",
        args.tp_size,
        args.ep_size,
        describe(weights),
        layout.name,
        kv_heads,
        budget["total"],
        budget["dense_layer"],
        budget["sparse_layer"],
        budget["index_k"],
        budget["draft"],
        max_total_num_tokens,
        max_total_num_tokens // kvc.pool_page_size,
        kvc.pool_page_size,
    )
    return M3KVPool(
        max_total_num_tokens,
        kvc.pool_page_size,
        cfg,
        layout,
        kvc.device,
        start_layer=kvc.layer_info.start_layer,
        end_layer=kvc.layer_info.end_layer,
        draft_kv_heads=draft_heads,
        kv_heads=kv_heads,
    )


def draft_kv_heads(server_args, cfg: M3Config) -> tuple[int, ...]:
    """This rank's KV heads of each EAGLE3 draft layer the pool must hold (none without speculation)."""
    if server_args.speculative_algorithm is None:
        return ()
    draft = DraftConfig.from_path(server_args.speculative_draft_model_path, cfg)
    heads = rank_heads(draft.num_heads, draft.num_kv_heads, server_args.tp_size, 0).kv_heads
    return (heads,) * draft.num_layers
