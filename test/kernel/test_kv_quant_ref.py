"""FP8 e4m3 / NVFP4 references: code-point tables, packing layout, round-trip error bounds.

CPU only and fast (< 10 s): these references are also the KV pool's CPU path.

Round-trip bounds (stated per format; ``a = |x| / s`` is the value in units of its scale):

| format | bound on ``|dequant(quant(x)) - x|``                                   |
| ------ | ----------------------------------------------------------------------- |
| FP8    | ``max(2^-4 |x|, 2^-10 s)`` for ``|x| <= 448 s`` (half an ulp, 3 mantissa bits; subnormal step 2^-9) |
| NVFP4  | ``s_blk * (0.25 if a <= 2 else 0.5 if a <= 4 else 1.0)`` (half the E2M1 gap), ``s_blk = e4m3(amax/6/g) * g`` |
| NVFP4  | random normal rows: relative RMS error < 0.12 (measured ~0.09)           |
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import kv_quant as kq

# E2M1: code -> value (OCP MX spec table: sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0).
E2M1_TABLE = {
    0b0000: 0.0,
    0b0001: 0.5,
    0b0010: 1.0,
    0b0011: 1.5,
    0b0100: 2.0,
    0b0101: 3.0,
    0b0110: 4.0,
    0b0111: 6.0,
    0b1000: -0.0,
    0b1001: -0.5,
    0b1010: -1.0,
    0b1011: -1.5,
    0b1100: -2.0,
    0b1101: -3.0,
    0b1110: -4.0,
    0b1111: -6.0,
}


def e4m3_table() -> dict[int, float]:
    """Every finite float8_e4m3fn code (OCP FP8 spec): bias 7, no infinities, S.1111.111 is NaN.

    normal: (1 + m/8) * 2^(e-7) for e in 1..15 (max 1.75 * 2^8 = 448); subnormal: m * 2^-9.
    """
    table = {}
    for code in range(256):
        sign, e, m = code >> 7, (code >> 3) & 0xF, code & 7
        if e == 15 and m == 7:
            continue  # NaN
        mag = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        table[code] = -mag if sign else mag
    return table


def test_e4m3_table_matches_torch():
    table = e4m3_table()
    assert len(table) == 254 and max(table.values()) == 448.0 and table[0x01] == 2.0**-9 and table[0x08] == 2.0**-6
    codes = torch.tensor(list(table), dtype=torch.uint8)
    got = kq.e4m3_decode(codes.view(torch.float8_e4m3fn))
    assert torch.equal(got, torch.tensor(list(table.values()), dtype=torch.float32))
    # every finite value encodes back to its own code (except -0 -> compare as values)
    enc = kq.e4m3_encode(got).float()
    assert torch.equal(enc, got)


def test_e4m3_encode_rounding_and_saturation():
    vals = sorted({v for v in e4m3_table().values() if v >= 0})
    lo = torch.tensor(vals[:-1])
    hi = torch.tensor(vals[1:])
    mid = (lo + hi) / 2  # exact in fp32
    got = kq.e4m3_encode(mid).float()
    lo_code = lo.to(torch.float8_e4m3fn).view(torch.uint8)
    want = torch.where(lo_code % 2 == 0, lo, hi)  # ties go to the even mantissa
    assert torch.equal(got, want)
    assert kq.e4m3_encode(torch.tensor([1e9, -1e9, 449.0, 470.0])).float().tolist() == [448.0, -448.0, 448.0, 448.0]


def test_e2m1_table_and_encode():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(kq.e2m1_decode(codes), torch.tensor([E2M1_TABLE[c] for c in range(16)]))
    pos = torch.tensor(kq.E2M1_VALUES)
    assert torch.equal(kq.e2m1_encode(pos), torch.arange(8, dtype=torch.uint8))
    assert torch.equal(kq.e2m1_encode(-pos[1:]), torch.arange(9, 16, dtype=torch.uint8))
    mids = (pos[:-1] + pos[1:]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
    assert kq.e2m1_decode(kq.e2m1_encode(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # to even
    assert kq.e2m1_decode(kq.e2m1_encode(torch.tensor([6.5, 100.0, -7.0]))).tolist() == [6.0, 6.0, -6.0]


def test_nvfp4_packing_layout():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 15] = 0.5, -1.0, 6.0  # block 0: amax 6 -> scale e4m3(1.0) = 1.0
    x[0, 16], x[0, 17] = 3.0, 12.0  # block 1: amax 12 -> scale 2.0 -> codes 1.5 (0x3), 6 (0x7)
    data, scales = kq.nvfp4_quantize_ref(x)
    assert data.shape == (1, 16) and scales.shape == (1, 2)
    assert scales.float().tolist() == [[1.0, 2.0]]
    assert data[0, 0].item() == 0x1 | (0xA << 4)  # element 0 low nibble, element 1 high nibble
    assert data[0, 7].item() == 0x7 << 4 and data[0, 8].item() == 0x3 | (0x7 << 4)
    assert torch.equal(kq.nvfp4_dequantize_ref(data, scales), x)


def _adversarial(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, d, generator=g)
    rows[0] = 0  # all zeros
    rows[1] *= 1e3  # large
    rows[2] *= 1e-5  # tiny (FP8 subnormals / NVFP4 scale subnormals)
    rows[3, ::2] = 0  # half zero blocks
    rows[4] = torch.where(torch.arange(d) % 16 == 0, 5.0, 1e-3)  # one outlier per block
    rows[5] = torch.linspace(-4, 4, d)
    return rows


@pytest.mark.parametrize("scale", [1.0, 0.0625, 3.7])
def test_fp8_round_trip_bound(scale):
    x = torch.cat([torch.randn(64, 128) * 50, _adversarial(128)])
    x = x.clamp(-448 * scale, 448 * scale)
    q = kq.fp8_quantize_ref(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    err = (kq.fp8_dequantize_ref(q, scale) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10 * scale)) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert fp8_saturates(scale)


def fp8_saturates(scale: float) -> bool:
    big = torch.tensor([1e30, -1e30]) * scale
    want = torch.tensor([448.0, -448.0]) * scale  # fp32 product, as the dequantiser computes it
    return torch.equal(kq.fp8_dequantize_ref(kq.fp8_quantize_ref(big, scale), scale), want)


@pytest.mark.parametrize("gscale", [1.0, 0.01, 8.0])
def test_nvfp4_round_trip_bound(gscale):
    x = torch.cat([torch.randn(64, 128) * 3 * gscale, _adversarial(128) * gscale])
    data, scales = kq.nvfp4_quantize_ref(x, gscale)
    deq = kq.nvfp4_dequantize_ref(data, scales, gscale)
    assert not deq.isnan().any()
    sf = (scales.float() * gscale).repeat_interleave(16, dim=-1)  # [rows, D]
    a = torch.where(sf > 0, x.abs() / sf.clamp(min=1e-30), torch.zeros_like(x))
    half_gap = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    amax = x.abs().view(x.shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=-1)
    # blocks whose scale underflowed to 0 store zeros: their error is the value itself (< 6 * 2^-10 * g)
    bound = torch.where(sf > 0, sf * half_gap, amax) * (1 + 1e-6)
    err = (deq - x).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert torch.equal(deq[64], torch.zeros(128))  # zero row stays exactly zero
    rel = (deq[:64] - x[:64]).norm() / x[:64].norm()
    assert rel < 0.12, rel


def test_nvfp4_saturates_and_underflows_cleanly():
    x = torch.tensor([[1e30] * 16, [1e-12] * 16])
    data, scales = kq.nvfp4_quantize_ref(x)
    deq = kq.nvfp4_dequantize_ref(data, scales)
    assert deq[0].tolist() == [448.0 * 6] * 16  # scale saturates at 448, code at 6
    assert deq[1].tolist() == [0.0] * 16 and scales[1].float().item() == 0.0
