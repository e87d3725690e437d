"""What one rank holds: weight bytes per component, KV bytes per token, token capacity.

Computed from the parsed config and the parallel layout (``parallel.py``), the way the model
builds its layers: the start-up log line, the README capacity table and the benchmarks'
HBM floors all come from here. Vocabulary padding (SGLang pads the vocabulary-parallel
embedding and head to a multiple of 64 per rank) and norm / scale vectors below 0.01 % of
the total are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DraftConfig, M3Config
from .parallel import rank_heads

GIB = 1 << 30
# Bytes per element of the matrices SGLang's fp8 method quantises (attention and MLP / expert projections;
# under --quantization fp8 the indexer's too, as rows of the attention's qkv GEMM, ``M3Attention.
# fuse_qkv_index``, on GPUs with SGLang's CUTLASS FP8 GEMM, sm_89+, while an FP8 checkpoint's indexer stays
# in the model dtype); the embedding, head and norms stay in the model dtype, the router in fp32.
FP8_ELEMENT_BYTES = 1
# Bytes per router element: the released fp32, which a BF16 model on CUDA holds as three BF16 parts
# (model.layers.Router); the sizes here are a CUDA model's.
ROUTER_ELEMENT_BYTES = {2: 6, 4: 4}


@dataclass(frozen=True)
class RankWeights:
    """Bytes of one rank's weights, by component (all layers)."""

    embed: int
    head: int
    attention: int  # q/k/v/o projections
    indexer: int  # index q/k projections of the sparse layers
    dense_mlp: int
    shared_experts: int
    router: int
    experts: int  # this rank's routed experts (its expert range, its slice of each)

    @property
    def total(self) -> int:
        return sum(vars(self).values())


def _linear_bytes(quantization: str | None, dtype_bytes: int) -> int:
    return FP8_ELEMENT_BYTES if quantization == "fp8" else dtype_bytes


def expert_bytes(cfg: M3Config, quantization: str | None = None, width_parts: int = 1, dtype_bytes: int = 2) -> int:
    """One routed expert's gate, up and down matrices (``width_parts``: ranks its width splits over)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size // width_parts * _linear_bytes(quantization, dtype_bytes)


def rank_weights(
    cfg: M3Config,
    tp: int = 1,
    ep: int = 1,
    quantization: str | None = None,
    dtype_bytes: int = 2,
    fp8_checkpoint: bool = False,
) -> RankWeights:
    """Weights of one rank at ``--tp-size tp --ep-size ep``, in a model dtype of ``dtype_bytes``
    (2: BF16), the projections in FP8 with ``quantization="fp8"`` (``fp8_checkpoint``: weights an
    FP8 checkpoint brings, whose indexer is not quantised)."""
    q, b = _linear_bytes(quantization, dtype_bytes), dtype_bytes
    h, d = cfg.hidden_size, cfg.head_dim
    heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, tp, 0)
    attention = h * d * (2 * heads.q_heads + 2 * heads.kv_heads) * q  # q, k, v in; o out
    # this rank's index-q heads + the shared index-k
    indexer = h * cfg.msa.index_dim * (heads.kv_heads + 1) * (b if fp8_checkpoint else q)
    moe_layers = sum(cfg.moe_layers)
    return RankWeights(
        embed=cfg.vocab_size // tp * h * b,
        head=0 if cfg.tie_word_embeddings else cfg.vocab_size // tp * h * b,
        attention=cfg.num_layers * attention,
        indexer=len(cfg.sparse_layer_ids) * indexer,
        dense_mlp=(cfg.num_layers - moe_layers) * 3 * h * cfg.dense_intermediate_size // tp * q,
        shared_experts=moe_layers * 3 * h * cfg.shared_intermediate_size // tp * q,
        router=moe_layers * h * cfg.num_experts * ROUTER_ELEMENT_BYTES[dtype_bytes],
        experts=moe_layers * cfg.num_experts // ep * expert_bytes(cfg, quantization, tp // ep, dtype_bytes),
    )


def token_capacity(free_bytes: float, mem_fraction_static: float, weights: int, kv_bytes_per_token: int) -> int:
    """Tokens the KV pool holds when SGLang sizes it (``KVCacheConfigurator``): the memory free before
    the weights load, times ``mem_fraction_static``, less the weights, over the bytes of one token."""
    return max(0, int((free_bytes * mem_fraction_static - weights) // kv_bytes_per_token))


def describe(weights: RankWeights) -> str:
    """``"12.34 GiB (experts 10.00, attention 1.00, ...)"``: the start-up log's weight figure."""
    parts = sorted(((v, k) for k, v in vars(weights).items() if v), reverse=True)
    return f"{weights.total / GIB:.2f} GiB (" + ", ".join(f"{k} {v / GIB:.2f}" for v, k in parts) + ")"


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` rows route to when each picks ``top_k`` of ``num_experts``
    uniformly at random: ``E (1 - (1 - k/E)^tokens)`` (e.g. 29 of 128 at 8 rows, 82 at 32)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_step_bytes(
    cfg: M3Config, batch: int, context: int, kv: dict[str, int], weights: RankWeights, rows: int = 1
) -> dict[str, float]:
    """Bytes one decode step must move on one rank (its HBM floor is their sum over the bandwidth).

    ``batch`` requests of ``context`` tokens each, ``rows`` query rows per request (1; 1 + drafts
    in a verify step), ``kv``: ``bytes_per_token`` of the rank. Weights: everything except the
    routed experts once, plus the experts the step's rows touch under random routing. KV: every
    token of the dense layers; on sparse layers the selected blocks (top-k, at most the context)
    and the index-K of every token.
    """
    msa = cfg.msa
    moe_layers = sum(cfg.moe_layers)
    per_expert = weights.experts / max(moe_layers, 1) / cfg.num_experts  # one expert, this rank's part
    selected = min(context, msa.topk_blocks * msa.block_size)
    return {
        # the embedding: B rows only (tied: it is the head, read whole)
        "weights": float(weights.total - weights.experts - (0 if cfg.tie_word_embeddings else weights.embed)),
        "experts": moe_layers * experts_touched(cfg.num_experts, cfg.top_k, batch * rows) * per_expert,
        "kv": float(
            batch
            * (
                len(cfg.dense_layer_ids) * context * kv["dense_layer"]
                + len(cfg.sparse_layer_ids) * (selected * kv["sparse_layer"] + context * kv["index_k"])
            )
        ),
    }


def draft_weight_bytes(
    draft: DraftConfig, dtype_bytes: int = 2, own_embed: bool = False, tp: int = 1
) -> dict[str, int]:
    """Bytes of one rank's EAGLE3 draft weights by part at ``--tp-size tp``: its decoder layer (q/k/v over
    ``2H``, o, gate/up/down; heads split as the target's, KV heads replicated where TP exceeds them), ``fc``
    over the captured states (replicated), its lm_head (vocabulary-parallel), and (``own_embed``: as the
    public M3 drafts ship it) an embedding of ``vocab_size`` rows, which sglang-m3 does not load (the
    target's is shared). Norms left out."""
    h, hd, b = draft.hidden_size, draft.head_dim, dtype_bytes
    heads = rank_heads(draft.num_heads, draft.num_kv_heads, tp, 0)
    q, kv = heads.q_heads * hd, heads.kv_heads * hd
    n_aux = len(draft.aux_layer_ids or (0, 0, 0))
    return {
        "layer": (2 * h * (q + 2 * kv) + q * h + 3 * h * draft.intermediate_size // tp) * b,
        "fc": n_aux * h * h * b,
        "head": draft.draft_vocab_size // tp * h * b,
        "embed": draft.vocab_size // tp * h * b if own_embed else 0,
    }


def draft_step_bytes(
    draft: DraftConfig,
    batch: int,
    context: int,
    num_steps: int,
    kv_bytes_per_token: int,
    dtype_bytes: int = 2,
    tp: int = 1,
) -> dict[str, float]:
    """Bytes the draft's passes of one EAGLE3 chain step move on one rank (``num_steps`` = K): K - 1 chain
    decodes on the draft's own H-wide state and one catch-up over the K + 1 verified rows (the only pass
    through ``fc``), each reading the layer, the lm_head and every request's ``context`` tokens of draft KV
    (``kv_bytes_per_token``: the rank's ``bytes_per_token(...)["draft"]``). The embedding reads B rows only:
    left out."""
    w = draft_weight_bytes(draft, dtype_bytes, tp=tp)
    return {
        "draft_weights": float(num_steps * (w["layer"] + w["head"]) + w["fc"]),
        "draft_kv": float(num_steps * batch * context * kv_bytes_per_token),
    }


def capacity_table(cfg: M3Config, setups, kv_dtypes, free_gib: float, mem_fraction_static: float) -> str:
    """Markdown: per ``(tp, quantization)`` setup, weights per rank and KV bytes/token and token capacity
    per rank at each ``--kv-cache-dtype``, the way start-up sizes the pool (``token_capacity``)."""
    import torch

    from .mem.layout import bytes_per_token, layout_for

    head = "| setup | weights per rank | " + " | ".join(f"`{k}`: B/token, tokens" for k in kv_dtypes) + " |"
    lines = [head, "|" + "---|" * (2 + len(kv_dtypes))]
    for tp, quant in setups:
        weights = rank_weights(cfg, tp, 1, quant)
        kv_heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, tp, 0).kv_heads
        cells = []
        for kv_dtype in kv_dtypes:
            per_token = bytes_per_token(cfg, layout_for(kv_dtype, torch.bfloat16), kv_heads=kv_heads)["total"]
            tokens = token_capacity(free_gib * GIB, mem_fraction_static, weights.total, per_token)
            cells.append(f"{per_token:,} B, {tokens:,}")
        lines.append(f"| TP{tp} {quant or 'bf16'} | {weights.total / GIB:.1f} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)
