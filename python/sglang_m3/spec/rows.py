"""What shapes each verify row's logits before acceptance, and the seeded coins, as pure functions.

Verify row ``t`` (``t = 0..K``) of a request stands where the request's output holds its
committed tokens plus drafts ``d_1..d_t`` (they were all accepted if row ``t`` is used at
all). So, with the semantics of SGLang's sampler without speculation (``penaltylib``,
``SamplingBatchInfo.apply_logits_bias``; additive penalties, then the multiplicative one,
then the logit bias), row ``t`` is penalised for the committed output tokens *and*
``d_1..d_t``, and ``min_new_tokens`` masks the stop tokens while ``len(output) + t`` is
below it.

Seeded requests (``sampling_seed``) take their acceptance coins from a hash of (seed,
position, column) instead of the global generator, so the same seed gives the same output
whatever else is in the batch. The hash is ours (SGLang's seeded path is a Triton kernel,
which does not run on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class Penalties:
    """Per-request penalty state (``bs`` requests, vocabulary ``V``)."""

    counts: torch.Tensor  # [bs, V] float: committed output tokens per id
    output_len: torch.Tensor  # [bs] int: committed output tokens
    frequency: torch.Tensor  # [bs] float
    presence: torch.Tensor  # [bs] float
    repetition: torch.Tensor  # [bs] float (1 = off)
    min_new_tokens: torch.Tensor  # [bs] int
    stop: torch.Tensor  # [bs, V] bool: the ids min_new_tokens holds back


def penalise_rows(logits: torch.Tensor, draft: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """``logits [bs, R, V]`` of the verify rows, ``draft [bs, R - 1]`` -> penalised fp32 copy."""
    bs, R, V = logits.shape
    seen = torch.zeros(bs, R, V, dtype=torch.float32, device=logits.device)
    seen[:, 1:].scatter_(2, draft.long().unsqueeze(2), 1.0)  # row t + 1 has seen d_{t+1} more than row t
    counts = pen.counts.unsqueeze(1) + seen.cumsum(dim=1)  # [bs, R, V]
    out = logits.float() - pen.frequency[:, None, None] * counts
    out = out - pen.presence[:, None, None] * (counts > 0)
    rows = torch.arange(R, device=logits.device)
    short = (pen.output_len[:, None] + rows[None, :]) < pen.min_new_tokens[:, None]  # [bs, R]
    out = out.masked_fill(short.unsqueeze(2) & pen.stop.unsqueeze(1), float("-inf"))
    scale = torch.where(counts > 0, pen.repetition[:, None, None], torch.ones_like(counts))
    return torch.where(out < 0, out * scale, out / scale)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values < 2^32 (products stay below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seeded_coins(seed: torch.Tensor, position: torch.Tensor, columns: int) -> torch.Tensor:
    """Uniforms in [0, 1) from (``seed [bs]``, ``position [bs]``, column) -> ``[bs, columns]``, fp32."""
    cols = torch.arange(columns, device=seed.device, dtype=torch.int64)
    h = _mix32((seed.long() & _MASK32)[:, None] ^ _mix32(position.long()[:, None] & _MASK32))
    h = _mix32(h ^ _mix32(cols[None, :] + 0x9E3779B9 & _MASK32))
    return (h.double() / 2**32).float().clamp(max=1.0 - 2**-24)


def non_finite_requests(raw: torch.Tensor, shaped: torch.Tensor) -> torch.Tensor:
    """``[bs]`` True where the target's rows ``[bs, R, V]`` hold NaN or an infinity, or shaping made a NaN
    (masks legitimately put -inf into ``shaped``, so only its NaNs count).

    One reduction over each tensor's ``[bs, R, V]`` (they are the step's largest: 205 MB of fp32 logits at
    batch 64 with M3's vocabulary), the second only when shaping made a new tensor: a row's fp32 sum is
    NaN or infinite when any entry is, and otherwise only when the entries reach ~1e33, a broken model's
    logits anyway."""
    bad = ~torch.isfinite(raw.sum(-1, dtype=torch.float32)).all(-1)
    if shaped is not raw:
        bad |= torch.isnan(shaped.sum(-1, dtype=torch.float32)).any(-1)
    return bad
