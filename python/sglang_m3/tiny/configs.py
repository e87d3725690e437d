"""Tiny M3 shapes. Block 16 / top-4 makes the sparse threshold 64 tokens, so short
prompts already exercise block dropping (DESIGN section 5)."""

from __future__ import annotations

_BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=32,
    rotary_dim=16,
    partial_rotary_factor=0.5,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    intermediate_size=32,
    dense_intermediate_size=96,
    shared_intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.0,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    hidden_act="swigluoai",
    scoring_func="sigmoid",
    use_routing_bias=True,
    use_gemma_norm=True,
    use_qk_norm=True,
    qk_norm_type="per_head",
    attention_output_gate=False,
    tie_word_embeddings=False,
)

_MSA = dict(
    sparse_index_dim=32,
    sparse_block_size=16,
    sparse_topk_blocks=4,
    sparse_local_block=1,
    sparse_init_block=0,
    sparse_score_type="max",
    use_sparse_attention=True,
)

TINY_CONFIGS: dict[str, dict] = {
    # One KV group: transformers 5.12.1's shared selection equals the per-group rule.
    "m3-tiny": dict(_BASE, num_key_value_heads=1, num_hidden_layers=4, layers=[0, 1, 1, 1], moe=[0, 1, 1, 1], msa=_MSA),
    # Two KV groups: per-group selection differs from 5.12.1's shared one. Eight query heads: tensor
    # parallelism up to TP8, where each KV group (and its index head) is replicated on four ranks. Four
    # layers: its EAGLE3 draft captures the outputs of layers 0-2, as m3-tiny's does.
    "m3-tiny-gqa": dict(
        _BASE,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        layers=[0, 1, 1, 1],
        moe=[0, 0, 1, 1],
        msa=_MSA,
    ),
    # Widths SGLang's CPU path pads (MoE 48 -> 64, kept as original_intermediate_size): loads the
    # checkpoint's unpadded tensors (issue: padded widths on CPU).
    "m3-tiny-w48": dict(
        _BASE,
        hidden_size=96,
        intermediate_size=48,
        dense_intermediate_size=128,
        num_key_value_heads=1,
        num_hidden_layers=2,
        layers=[0, 1],
        moe=[0, 1],
        msa=_MSA,
    ),
}

# Tiny targets with an EAGLE3 draft (``draft.default_draft``): enough layers for ``eagle3.TINY_AUX_LAYER_IDS``.
DRAFT_TARGETS = ("m3-tiny", "m3-tiny-gqa")
