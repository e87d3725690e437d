"""How MiniMax-M3 is split over tensor-parallel (TP) and expert-parallel (EP) ranks.

* Query heads split evenly over the TP ranks.
* KV heads split evenly when TP divides them, else each is replicated on ``tp / kv``
  consecutive ranks (the release has 4 KV heads: at TP8 each lives on two ranks), which is
  how SGLang's ``QKVParallelLinear`` lays them out.
* Each rank's MSA index heads follow its KV groups (one index head per KV head); the one
  shared index-K head is replicated.
* Routed experts: SGLang's convention, ``--ep-size`` ranks of the TP group each hold
  ``experts / ep`` whole experts, and every expert's width splits over the remaining
  ``tp / ep`` ranks (``FusedMoE``); dense MLPs, the shared expert, the vocabulary and the
  projections split over TP.

``check_parallel`` refuses, at start-up, sizes that do not divide the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import M3Config, M3ConfigError


@dataclass(frozen=True)
class RankHeads:
    """Attention heads one TP rank holds."""

    q_heads: int
    kv_heads: int
    first_kv_head: int  # global index of the rank's first KV head (= its first index head)


def rank_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> RankHeads:
    if num_kv_heads >= tp_size:
        kv = num_kv_heads // tp_size
        return RankHeads(num_heads // tp_size, kv, tp_rank * kv)
    return RankHeads(num_heads // tp_size, 1, tp_rank // (tp_size // num_kv_heads))


def check_heads(what: str, num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise M3ConfigError(f"--tp-size={tp_size} does not divide {what}num_attention_heads={num_heads}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise M3ConfigError(
            f"--tp-size={tp_size}: {what}num_key_value_heads={num_kv_heads} must be a multiple or a divisor of it "
            "(KV heads are split, or replicated when the TP size exceeds them)"
        )


def check_parallel(cfg: M3Config, tp_size: int, ep_size: int) -> None:
    """Refuse TP / EP sizes that do not divide the model, naming field and value."""
    if tp_size < 1 or ep_size < 1:
        raise M3ConfigError(f"--tp-size={tp_size} / --ep-size={ep_size}: must be positive")
    check_heads("", cfg.num_heads, cfg.num_kv_heads, tp_size)
    if tp_size % ep_size:
        raise M3ConfigError(f"--ep-size={ep_size} must divide --tp-size={tp_size} (experts split inside the TP group)")
    if cfg.num_experts % ep_size:
        raise M3ConfigError(f"--ep-size={ep_size} does not divide num_local_experts={cfg.num_experts}")
    moe_tp = tp_size // ep_size
    for field, size, parts in (
        ("intermediate_size", cfg.moe_intermediate_size, moe_tp),
        ("shared_intermediate_size", cfg.shared_intermediate_size, tp_size),
        ("dense_intermediate_size", cfg.dense_intermediate_size, tp_size),
    ):
        if size % parts:
            raise M3ConfigError(
                f"{field}={size} does not split over {parts} ranks (--tp-size={tp_size}, --ep-size={ep_size})"
            )
