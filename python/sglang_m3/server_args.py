"""Server-argument declarations for M3 checkpoints, and the start-up refusals.

SGLang calls ``m3_server_overrides(server_args, hf_config)`` from its model
override registry while it resolves ``ServerArgs`` (in the launcher, before any
worker starts), so a config or flag this plugin cannot serve stops the server
with a message naming the field and the value.
"""

from __future__ import annotations

from typing import Any

from .config import DraftConfig, M3Config, check_page_size
from .mem.layout import check_kv_cache_dtype
from .parallel import check_heads, check_parallel

# ServerArgs fills these in for CPU before model overrides run, so they are not the user's choice.
_DEVICE_DEFAULT_BACKENDS = {"cpu": ("intel_amx", "torch_native")}


def m3_server_overrides(server_args: Any, hf_config: Any) -> dict:
    cfg = M3Config.from_hf(hf_config)  # refuses unsupported configs
    page_size = check_page_size(server_args.page_size, cfg.msa)
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(server_args, field, None)
        if value not in (None, "m3_msa", *_DEVICE_DEFAULT_BACKENDS.get(server_args.device, ())):
            raise ValueError(f"--{field.replace('_', '-')}={value!r}: MiniMax-M3 runs on sglang-m3's 'm3_msa' backend")
    check_parallel(cfg, server_args.tp_size, server_args.ep_size)
    _refuse_unsupported_features(server_args)
    check_kv_cache_dtype(server_args.kv_cache_dtype)
    declared = {"attention_backend": "m3_msa", "page_size": page_size}
    if server_args.speculative_algorithm is not None:
        _check_speculative(server_args, cfg)
    return declared


def _refuse_unsupported_features(server_args: Any) -> None:
    """SGLang features M3 cannot run with stop start-up here rather than fail at run time."""
    pp = server_args.pp_size
    for flag, value, refused, why in (
        ("pp-size", pp, pp != 1, "sglang-m3 does not split MiniMax-M3 into pipeline stages"),
        (
            "enable-dp-attention",
            server_args.enable_dp_attention,
            server_args.enable_dp_attention,
            "sglang-m3's MSA backend does not run data-parallel attention",
        ),
        (
            "enable-hierarchical-cache",
            server_args.enable_hierarchical_cache,
            server_args.enable_hierarchical_cache,
            "sglang-m3's KV pool (hybrid formats, index-K, draft layers) has no host-memory tier",
        ),
    ):
        if refused:
            raise ValueError(f"--{flag}={value!r}: {why}")


def _check_speculative(server_args: Any, cfg: M3Config) -> None:
    """EAGLE3 chain speculation (topk 1) through sglang-m3's worker; anything else is refused."""
    algo = server_args.speculative_algorithm
    if str(algo).upper() != "EAGLE3":
        raise ValueError(f"--speculative-algorithm={algo!r}: sglang-m3 supports EAGLE3 (chain) only")
    if server_args.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            f"--speculative-eagle-topk={server_args.speculative_eagle_topk}: sglang-m3 drafts a chain (topk 1); "
            "tree drafts are not supported"
        )
    if not server_args.speculative_draft_model_path:
        raise ValueError("--speculative-draft-model-path is required for EAGLE3 (an LlamaForCausalLMEagle3 draft)")
    draft = DraftConfig.from_path(server_args.speculative_draft_model_path, cfg)  # refuses an unusable draft
    check_heads("the draft's ", draft.num_heads, draft.num_kv_heads, server_args.tp_size)
    steps = server_args.speculative_num_steps
    if steps is not None and steps < 1:
        raise ValueError(f"--speculative-num-steps={steps}: must be >= 1")
    if steps is not None and server_args.speculative_eagle_topk is None:
        # SGLang 0.5.17 fills topk only when all three are unset; a bare step count crashes later.
        raise ValueError(f"--speculative-num-steps={steps} needs --speculative-eagle-topk 1 too (chain drafting)")
    # SGLang's EAGLE worker reads these; sglang-m3's verify accepts exactly (a draft token with its target
    # probability, greedy: the argmax) and its step count is fixed at start-up.
    for flag, value, default in (
        ("speculative-accept-threshold-single", server_args.speculative_accept_threshold_single, 1.0),
        ("speculative-accept-threshold-acc", server_args.speculative_accept_threshold_acc, 1.0),
        ("speculative-adaptive", server_args.speculative_adaptive, False),
    ):
        if value != default:
            raise ValueError(
                f"--{flag}={value!r}: sglang-m3's EAGLE3 worker verifies exactly with a fixed step count "
                f"(relaxed acceptance and adaptive steps are not implemented); leave it at {default!r}"
            )
    # Unset step counts resolve to SGLang's chain default for this architecture (3 steps, topk 1,
    # 4 draft tokens). Overlap scheduling stays as the user set it (on by default).
