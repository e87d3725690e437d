"""Chain speculative acceptance as pure functions (tensors in, tensors out).

A request proposes ``K`` draft tokens ``d_1..d_K``; the target scores ``K + 1`` rows:
row ``t`` (``t = 0..K``) sits at the position after ``d_t`` (``d_0`` = the previous
bonus token), so its distribution ``p_t`` is the target's choice for the slot ``d_{t+1}``
occupies. Acceptance keeps the longest prefix of drafts the target agrees with and then
emits one token of the target's own, so every step commits ``accept_len = n + 1``
tokens, ``0 <= n <= K`` accepted drafts plus one bonus.

The EAGLE3 chain draft is greedy (top-1), i.e. its proposal ``q_t`` is one-hot on
``d_t``. Rejection sampling then reduces to: accept ``d_t`` with probability
``min(1, p_t(d_t) / q_t(d_t)) = p_t(d_t)``; at the first rejection sample from the
residual ``max(p_t - q_t, 0)`` renormalised = ``p_t`` with ``d_t`` removed. The
emitted tokens are then distributed exactly as sampling the target token by token
(Leviathan et al. 2023, Theorem 1), which is what makes speculation lossless.
"""

from __future__ import annotations

import torch


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify.

    draft: ``[B, K]`` draft token ids; target_logits: ``[B, K + 1, V]``.
    Returns ``tokens [B, K + 1]`` (the target's argmax per row; the first ``accept_len``
    are the committed tokens) and ``accept_len [B]`` in ``1..K + 1``.
    """
    tokens = target_logits.argmax(dim=-1)  # [B, K + 1]
    agree = (draft == tokens[:, :-1]).long()  # [B, K]: the target would have emitted d_{t+1} at row t
    accepted = agree.cumprod(dim=1).sum(dim=1)  # [B]: length of the agreeing prefix
    return tokens, accepted + 1


def accept_sampled(
    draft: torch.Tensor, target_probs: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verify for a one-hot (greedy) draft.

    draft: ``[B, K]``; target_probs: ``[B, K + 1, V]`` (rows sum to 1, already shaped by
    temperature / top-k / top-p); u_accept: ``[B, K]`` and u_sample: ``[B]`` uniform in
    [0, 1) (passed in so the function stays pure and testable).
    Returns ``tokens [B, K + 1]`` (first ``accept_len`` committed) and ``accept_len [B]``.
    """
    B, K = draft.shape
    p_draft = target_probs[:, :K].gather(2, draft.unsqueeze(2)).squeeze(2)  # [B, K]: p_t(d_{t+1})
    agree = (u_accept < p_draft).long()  # accept d_{t+1} with probability p_t(d_{t+1})
    n = agree.cumprod(dim=1).sum(dim=1)  # [B] accepted drafts
    rows = torch.arange(B, device=draft.device)
    p_last = target_probs[rows, n].clone()  # [B, V]: the row that emits the bonus / replacement token
    rejected = n < K
    # At a rejection the residual is p_t with the rejected draft token removed.
    drop = (draft[rows, n.clamp(max=K - 1)] if K > 0 else torch.zeros_like(n)).unsqueeze(1)
    # (a scatter, not boolean-mask indexing: that would wait for the device to count the rejections)
    p_last.scatter_(1, drop, p_last.gather(1, drop) * (~rejected).unsqueeze(1))
    p_last = p_last / p_last.sum(dim=1, keepdim=True).clamp_min(1e-30)
    last = sample_from(p_last, u_sample)  # [B]
    tokens = torch.cat([draft, draft.new_zeros(B, 1)], dim=1)  # [B, K + 1]
    tokens[rows, n] = last
    return tokens, n + 1


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row: probs ``[B, V]``, u ``[B]`` in [0, 1) -> ids ``[B]``."""
    cdf = probs.cumsum(dim=1)
    ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return ids.clamp(max=probs.shape[1] - 1)


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    filtered: bool = True,
    keep_width: int | None = None,
) -> torch.Tensor:
    """The target's sampling distribution per row, as SGLang's sampler shapes it.

    logits ``[N, V]``; temperature / top_p / min_p ``[N]`` float, top_k ``[N]`` int
    (``>= V`` or ``<= 0`` = off). Order: temperature, then top-k, top-p, min-p masks.
    ``filtered=False`` (no row has top-k, top-p or min-p on: SGLang's ``need_*_sampling`` flags, whose
    sampler then samples the softmax as is) returns the tempered softmax without sorting the rows: at
    M3's 200K-token vocabulary the sort and its masks over every verify row made the sampled spec step's
    eager kernels 8.2 ms at batch 64 on the H100, against 0.25 ms greedy (benchmarks/e2e.md).
    ``keep_width`` (every row's top-k at most this, so no row keeps more tokens) takes each row's leading
    tokens from ``torch.topk`` instead of sorting the whole row; the masks over that prefix are the same.
    """
    probs = torch.softmax(logits.float() / temperature.clamp_min(1e-6).unsqueeze(1), dim=-1)  # [N, V]
    if not filtered:
        return probs
    if keep_width is not None and keep_width < probs.shape[1]:
        sorted_p, order = probs.topk(keep_width, dim=-1)  # [N, width], descending
    else:
        sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_p.shape[1], device=probs.device).unsqueeze(0)  # [1, width]
    k = torch.where(top_k > 0, top_k, probs.shape[1]).unsqueeze(1)
    keep = rank < k  # top-k
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < top_p.unsqueeze(1)  # top-p: mass before this token < p
    keep &= sorted_p >= min_p.unsqueeze(1) * sorted_p[:, :1]  # min-p relative to the best token
    keep[:, 0] = True  # the best token always survives
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
