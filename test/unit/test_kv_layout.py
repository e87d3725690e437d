"""KV layouts and the exact byte budget, from the real released config; pool round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sglang_m3.config import M3Config
from sglang_m3.mem.kv_pool import M3KVPool
from sglang_m3.mem.layout import bytes_per_token, layout_for
from sglang_m3_kernels.kv_quant import nvfp4_dequantize_ref, nvfp4_quantize_ref

RELEASED = Path(__file__).resolve().parents[2] / "python" / "sglang_m3" / "assets" / "minimax-m3-config.json"


@pytest.fixture(scope="module")
def m3() -> M3Config:
    return M3Config.from_hf(json.loads(RELEASED.read_text()))


@pytest.mark.parametrize("kv_dtype, total", [("bf16", 137_472), ("fp8_e4m3", 68_736), ("nvfp4", 43_200)])
def test_released_bytes_per_token(m3, kv_dtype, total):
    layout = layout_for(kv_dtype, torch.bfloat16)
    assert bytes_per_token(m3, layout)["total"] == total
    # a 4-KV-head draft layer in the layout's draft format (FP8 for both quantised layouts)
    extra = {"bf16": 2048, "fp8_e4m3": 1024, "nvfp4": 1024}[kv_dtype]
    assert bytes_per_token(m3, layout, draft_kv_heads=(4,))["total"] == total + extra


def test_released_per_layer_bytes(m3):
    hybrid = bytes_per_token(m3, layout_for("nvfp4", torch.bfloat16))
    assert (hybrid["dense_layer"], hybrid["sparse_layer"], hybrid["index_k"]) == (1024, 576, 128)


def test_unsupported_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="--kv-cache-dtype='fp8_e5m2'"):
        layout_for("fp8_e5m2", torch.bfloat16)


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "nvfp4"])
def test_pool_round_trip_and_budget(kv_dtype):
    from sglang_m3.tiny.build import released_text_config

    cfg = M3Config.from_text_dict(released_text_config("m3-tiny"), "MiniMaxM3SparseForCausalLM")
    layout = layout_for(kv_dtype, torch.float32)
    pool = M3KVPool(64, 16, cfg, layout, "cpu", draft_kv_heads=(1,))
    slots = 64 + 16
    assert pool.mem_usage * (1 << 30) == pytest.approx(slots * bytes_per_token(cfg, layout, (1,))["total"])
    g = torch.Generator().manual_seed(0)
    loc = torch.tensor([17, 3, 40])
    for lid in (0, 1, cfg.num_layers):  # dense, sparse, draft
        k, v = torch.randn(3, 1, 32, generator=g), torch.randn(3, 1, 32, generator=g)
        pool.set_kv_buffer(_Layer(lid), loc, k, v)
        got_k, got_v = pool.read_kv(lid)
        fmt = pool.k[lid].fmt
        if fmt == "plain":
            assert torch.equal(got_k[loc], k) and torch.equal(got_v[loc], v)
        elif fmt == "fp8":
            assert torch.equal(got_k[loc], k.to(torch.float8_e4m3fn).float())
        else:
            assert torch.equal(got_k[loc], nvfp4_dequantize_ref(*nvfp4_quantize_ref(k), 1.0, torch.float32))
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[loc] = False
        assert not got_k[untouched].any()  # writes touched nothing else
    ik = torch.randn(3, 32, generator=g)
    k, v = torch.randn(3, 1, 32, generator=g), torch.randn(3, 1, 32, generator=g)
    pool.set_kv_buffer(_Layer(1), loc, k, v, index_k=ik)  # a sparse layer's three stores in one call
    tol = 0 if layout.index == "plain" else 0.07  # FP8 e4m3: 3 mantissa bits, relative step 2^-4
    torch.testing.assert_close(pool.read_index_k(1)[loc], ik, atol=tol * ik.abs().max().item(), rtol=0)


def test_draft_view_is_the_target_pool_with_shifted_layer_ids():
    from sglang_m3.tiny.build import released_text_config

    cfg = M3Config.from_text_dict(released_text_config("m3-tiny"), "MiniMaxM3SparseForCausalLM")
    pool = M3KVPool(64, 16, cfg, layout_for("fp8_e4m3", torch.float32), "cpu", draft_kv_heads=(2,))
    view = pool.draft_view()
    assert (view.start_layer, view.end_layer, view.layer_num, view.head_num) == (0, 1, 1, 2)
    loc = torch.tensor([5, 70])
    k, v = torch.ones(2, 2, 32), torch.full((2, 2, 32), -2.0)
    view.set_kv_buffer(_Layer(0), loc, k, v)  # the draft's layer 0 ...
    got_k, got_v = pool.read_kv(cfg.num_layers)  # ... is the pool's layer num_layers: same storage
    assert torch.equal(got_k[loc], k) and torch.equal(got_v[loc], v)
    assert not pool.read_kv(0)[0].any()  # the target's layer 0 is untouched
    with pytest.raises(RuntimeError, match="without EAGLE3 draft layers"):
        M3KVPool(64, 16, cfg, layout_for("auto", torch.float32), "cpu").draft_view()


def test_checkpoint_scales_widen_the_fp8_range():
    """FP8 rows store value / scale: a unit scale saturates at 448, the checkpoint's scale does not."""
    from sglang_m3.tiny.build import released_text_config

    cfg = M3Config.from_text_dict(released_text_config("m3-tiny"), "MiniMaxM3SparseForCausalLM")
    k = torch.linspace(-1000, 1000, 2 * 32).reshape(2, 1, 32)
    v = k / 10
    loc = torch.tensor([3, 17])
    results = {}
    for scales in (None, {0: (4.0, 0.25)}):
        pool = M3KVPool(64, 16, cfg, layout_for("fp8_e4m3", torch.float32), "cpu")
        if scales:
            pool.set_scales(scales)
        pool.set_kv_buffer(_Layer(0), loc, k, v)
        results[bool(scales)] = [x[loc] for x in pool.read_kv(0)]
    unit_k, _ = results[False]
    assert unit_k.abs().max() == 448  # saturated
    got_k, got_v = results[True]
    torch.testing.assert_close(got_k, k, rtol=0.0625, atol=0)  # e4m3: 3 mantissa bits, half-ulp 1/16
    torch.testing.assert_close(got_v, v, rtol=0.0625, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "nvfp4"])
def test_cuda_pool_writes_the_bytes_the_cpu_pool_writes(kv_dtype):
    """On CUDA a layer's K, V and index-K go through one fused Triton launch (``write_rows``); on CPU
    through the references. Same pool, same rows, padded slot -1 skipped: the same bytes, in bf16."""
    from sglang_m3.tiny.build import released_text_config

    cfg = M3Config.from_text_dict(released_text_config("m3-tiny"), "MiniMaxM3SparseForCausalLM")
    layout = layout_for(kv_dtype, torch.bfloat16)
    pools = {dev: M3KVPool(64, 16, cfg, layout, dev) for dev in ("cpu", "cuda")}
    g = torch.Generator().manual_seed(1)
    loc = torch.tensor([17, -1, 3, 40])
    k, v = (torch.randn(4, 1, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    ik = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    for dev, pool in pools.items():
        keep = loc >= 0  # the CPU references take real slots only
        rows = (loc, k, v, ik) if dev == "cuda" else (loc[keep], k[keep], v[keep], ik[keep])
        l_, k_, v_, i_ = (t.to(dev) for t in rows)
        pool.set_kv_buffer(_Layer(1), l_, k_, v_, index_k=i_)
    for name in ("k", "v", "index_k"):
        cpu, cuda = getattr(pools["cpu"], name)[1], getattr(pools["cuda"], name)[1]
        assert cpu.data.view(torch.uint8).any()
        assert torch.equal(cuda.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8)), name
        if cpu.scales is not None:
            assert torch.equal(cuda.scales.cpu().view(torch.uint8), cpu.scales.view(torch.uint8)), name
