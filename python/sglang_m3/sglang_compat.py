"""The SGLang internals sglang-m3 patches or reads on SGLang's objects, beside the version it was written for.

Hook targets and private registries are declared here; the model, the backend and the speculative
worker import the SGLang modules they build on (layers, ``ForwardBatch``, the EAGLE inputs and
utilities) where they use them. A SGLang upgrade starts here: bump ``PINNED_SGLANG`` (and
pyproject's pin), check each name below against the new source, then run the suite.
``plugin.register()`` stops start-up (``SystemExit``, which SGLang's plugin loader does not
swallow, unlike the ``Exception`` it logs and ignores) when

* the installed SGLang is not ``PINNED_SGLANG`` (``check_sglang_version``), unless
  ``SGLANG_M3_ALLOW_SGLANG_VERSION=1`` is set: another version at the user's risk; the hooks
  must still apply;
* a hook did not apply (``check_hooks_applied``): its target no longer resolves, or
  ``HookRegistry`` did not patch it. SGLang only logs that, then serves M3 through its own code.

What the checks cannot see: a hooked function whose signature or meaning changed, and the
private attributes the hook bodies read on SGLang objects. Those are listed here too (see
"Attributes read"), to review by hand on an upgrade.

Importing this module is cheap (stdlib only); the accessors import SGLang lazily.

Attributes read on SGLang objects by the hook bodies (``plugin.py``, ``cpu_hooks.py``,
``mem.kv_pool.build_kv_pool``):
``KVCacheConfigurator.{is_draft_worker, model_config, kv_cache_dtype_str, model_dtype,
server_args, pool_page_size, device, layer_info}``, ``DefaultPoolConfigurator._cell_size``
(written), ``ServerArgs.{cuda_graph_config.prefill.backend, _cuda_graph_config_locked,
get_model_config(), speculative_algorithm, enable_deterministic_inference}``,
``SpeculativeAlgorithm.is_eagle3()``, ``TokenizerManager.{server_args, model_config}``,
``ModelConfig.{hf_config, vocab_size, is_multimodal, ...}`` (the flags in
``plugin._MULTIMODAL_FLAGS``), ``PagedTokenToKVPoolAllocator.device``, ``Scheduler.{draft_worker,
result_queue}``, ``GetInternalStateReqOutput.internal_state`` (written), ``FutureMap.{device,
spec_algo, need_topk, need_hidden_states, output_tokens_buf, topk_p_buf, topk_index_buf,
hidden_states_buf, draft_probs_buf, dsa_topk_indices_buf}`` and the ``EagleDraftInput`` fields
``cpu_hooks.resolve_spec_extras`` fills.
"""

from __future__ import annotations

import logging
import os
import pkgutil
from typing import Any, Callable, Iterable, Mapping

logger = logging.getLogger(__name__)

PINNED_SGLANG = "0.5.17"
ALLOW_VERSION_ENV = "SGLANG_M3_ALLOW_SGLANG_VERSION"

# The name our attention backend is registered under (ATTENTION_BACKENDS, --attention-backend).
BACKEND_NAME = "m3_msa"

# --- Hook targets (dotted paths ``HookRegistry`` patches). plugin.py says what each hook does and why.
ATTN_BACKEND_WRAPPER = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
BUILD_MINIMAX_SPARSE_KV_POOL = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_minimax_sparse_kv_pool"
)
INIT_POOLS = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools"
COMPUTE_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
POOL_CONFIGURATOR_INIT = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
CREATE_SPEC_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
HANDLE_KV4_COMPATIBILITY = "sglang.srt.server_args.ServerArgs._handle_kv4_compatibility"
APPLY_CUDA_GRAPH_COMPATIBILITY = "sglang.srt.server_args.ServerArgs._apply_cuda_graph_compatibility"
MODEL_CONFIG_INIT = "sglang.srt.configs.model_config.ModelConfig.__init__"
VALIDATE_ONE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
SCHEDULER_GET_INTERNAL_STATE = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
SCHEDULER_DISABLE_OVERLAP_FOR_BATCH = "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch"
GET_MOE_CONFIGS = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config.get_moe_configs"
# CPU only (registered when torch.cuda.is_available() is False; cpu_hooks.py)
PAGED_ALLOC_EXTEND = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend"
PAGED_ALLOC_DECODE = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode"
GET_LAST_LOC = "sglang.srt.mem_cache.allocation.get_last_loc"
ASSIGN_REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
SUPPORT_TRITON = "sglang.srt.utils.common.support_triton"
INIT_MODEL_PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
XGRAMMAR_ALLOCATE_BITMASK = "sglang.srt.constrained.xgrammar_backend._allocate_token_bitmask"
XGRAMMAR_APPLY_MASK = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask"
SPEC_CPU_NO_OVERLAP = "sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu"
RESOLVE_SPEC_EXTRAS = "sglang.srt.managers.overlap_utils.FutureMap._resolve_spec_extras"


# --- Registries and private names changed or used directly (HookRegistry cannot patch dict/list entries).
def hook_registry():
    """``(HookRegistry, HookType)``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return HookRegistry, HookType


def model_registry():
    """``ModelRegistry``: ``.models`` maps architecture names to classes."""
    from sglang.srt.models.registry import ModelRegistry

    return ModelRegistry


def attention_backends() -> dict:
    """``attention_registry.ATTENTION_BACKENDS``: backend name -> factory(runner)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS


def add_attention_backend_choice(name: str) -> None:
    """Make ``--attention-backend NAME`` parse (``server_args.ATTENTION_BACKEND_CHOICES``)."""
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])


def model_override_fns() -> dict:
    """``arg_groups.overrides._MODEL_OVERRIDE_FNS`` (private): architecture -> server-arg override providers."""
    from sglang.srt.arg_groups import overrides

    return overrides._MODEL_OVERRIDE_FNS


def initialized_pools(**pools):
    """``kv_cache_configurator._InitializedPools(...)`` (private): what ``_init_pools`` returns."""
    from sglang.srt.mem_cache.kv_cache_configurator import _InitializedPools

    return _InitializedPools(**pools)


def cuda_graph_enums():
    """``(Backend, Phase)`` of ``model_executor.cuda_graph_config``."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    return Backend, Phase


def get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens):
    """``mem_cache.allocation.get_last_loc_torch``: SGLang's own torch path of ``get_last_loc``."""
    from sglang.srt.mem_cache.allocation import get_last_loc_torch as fn

    return fn(req_to_token, req_pool_indices, prefix_lens)


# --- Start-up checks
def sglang_version() -> str:
    import sglang

    return sglang.__version__


def check_sglang_version(installed: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Stop start-up unless SGLang is ``PINNED_SGLANG`` or ``SGLANG_M3_ALLOW_SGLANG_VERSION=1`` is set."""
    installed = sglang_version() if installed is None else installed
    environ = os.environ if environ is None else environ
    allow = environ.get(ALLOW_VERSION_ENV, "0")
    if allow not in ("0", "1"):
        raise SystemExit(f"sglang-m3: {ALLOW_VERSION_ENV}={allow!r}: expected 0 or 1")
    if installed == PINNED_SGLANG:
        return
    if allow == "1":
        logger.warning(
            "sglang-m3 was written for SGLang %s; running on SGLang %s at your risk (%s=1)",
            PINNED_SGLANG,
            installed,
            ALLOW_VERSION_ENV,
        )
        return
    raise SystemExit(
        f"sglang-m3: installed SGLang {installed} != {PINNED_SGLANG}, the version this plugin was written for "
        f"(it patches SGLang internals that move between releases). Install sglang=={PINNED_SGLANG}, or set "
        f"{ALLOW_VERSION_ENV}=1 to try SGLang {installed} at your own risk."
    )


def hook_in_place(target: str, hook: Callable, registry: Any) -> bool:
    """True when ``registry`` patched ``target`` and the attribute there now wraps ``hook``."""
    if target not in registry._patched:
        return False
    obj_path, _, attr = target.rpartition(".")
    try:
        obj = pkgutil.resolve_name(obj_path)
    except Exception:
        return False
    fn = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
    seen = 0
    while fn is not None and seen < 64:  # HookRegistry's wrappers chain through __wrapped__; the hook is a closure cell
        if any(_cell(c) is hook for c in getattr(fn, "__closure__", None) or ()):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def check_hooks_applied(hooks: Iterable[tuple[str, Callable, Any]], registry: Any) -> None:
    """Stop start-up naming every hook target that did not apply (SGLang logs that and carries on)."""
    missing = [target for target, hook, _kind in hooks if not hook_in_place(target, hook, registry)]
    if missing:
        raise SystemExit(
            f"sglang-m3: hook(s) not applied on SGLang {sglang_version()} (written for {PINNED_SGLANG}): "
            + ", ".join(missing)
            + ". The target does not resolve or was not patched; without it SGLang would serve MiniMax-M3 "
            "through its own code. See the log above for HookRegistry's error."
        )
