"""The one seam between sglang-m3 and SGLang (entry point ``sglang.srt.plugins: m3``).

``register()`` runs in every SGLang process (launcher, Engine, scheduler,
detokenizer) and is idempotent: it registers once and checks on every call.
The hook targets and private registries used here are declared in ``sglang_compat.py``,
beside the SGLang version this plugin was written for.

Start-up stops with ``SystemExit`` (SGLang's plugin loader logs and swallows an
``Exception`` from ``register()`` and from hooks that fail to apply, then serves
M3 through its own code) when:

* the installed SGLang is not ``sglang_compat.PINNED_SGLANG`` (0.5.17).
  ``SGLANG_M3_ALLOW_SGLANG_VERSION=1`` allows another version at the user's risk;
  every hook must still apply;
* a hook below did not apply (its target does not resolve or was not patched);
* the M3 architecture names do not resolve to our model afterwards;
* anything else in ``register()`` raises (the message names the error).

Registries changed directly:

* ``ModelRegistry.models``: both released M3 architecture names -> our model;
  a private name for our EAGLE3 draft class (the chain worker selects it).
* ``ATTENTION_BACKENDS`` / ``ATTENTION_BACKEND_CHOICES``: the ``m3_msa`` backend.
* ``arg_groups.overrides._MODEL_OVERRIDE_FNS``: M3's server-arg declarations
  (backend, page size, refusals) replace SGLang's M3 provider.

Hooks (``HookRegistry``; each is unavoidable because SGLang dispatches on the
architecture name inside these functions):

* ``attention_registry.attn_backend_wrapper`` (AROUND): SGLang wraps any M3
  backend into its own MiniMax hybrid backend; ours is returned unwrapped.
* ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` (REPLACE): our pool,
  built from the parsed config (SGLang's reads only the released spelling).
* ``DefaultPoolConfigurator._compute_cell_size`` (AROUND) and ``__init__``
  (AFTER): the exact M3 bytes/token for the memory budget, EAGLE3 draft layers
  included. SGLang's own M3 branch reads only the released config spelling, and
  its draft term scales the target's per-layer average afterwards (which
  undercounts an FP8 draft beside NVFP4 sparse layers): the AFTER hook puts the
  exact value back.
* ``KVCacheConfigurator._init_pools`` (AROUND): the EAGLE3 draft runner gets a
  view of the target's M3 pool (its layers live there, DESIGN section 6)
  instead of a pool of its own.
* ``SpeculativeAlgorithm.create_worker`` (AROUND): ``EAGLE3`` is a reserved
  built-in name; for M3 targets it builds our chain worker
  (``spec/worker.py``), so users keep the standard flags.
* ``ServerArgs._handle_kv4_compatibility`` (AROUND): SGLang allows
  ``--kv-cache-dtype nvfp4`` only on Blackwell with its own backends; for M3 it
  selects our hybrid layout, whose NVFP4 pages are dequantised inside our kernels
  (Hopper) or the references (CPU).
* ``ServerArgs._apply_cuda_graph_compatibility`` (AROUND): M3 prefill runs eagerly
  (its MSA plans are data-dependent); SGLang's default breakable prefill graphs
  are switched off for it, and an explicit request for them is refused. Model
  overrides cannot declare graph settings in 0.5.17.
* ``TokenizerManager._validate_one_request`` (BEFORE): for M3, token ids outside the
  vocabulary are refused at admission (``admission.py``: SGLang's own check is never
  called, and such an id takes a CUDA server down); under EAGLE3, requests with a
  custom logit processor (which the chain verify does not apply) or a
  ``sampling_seed`` SGLang would ignore are refused too (``spec/admission.py``);
  SGLang has no per-model or per-worker admission hook.
* ``Scheduler.get_internal_state`` (AFTER): under our EAGLE3 worker, adds
  ``"sglang_m3_eagle3"``: which path the draft's passes took (CUDA graphs, static
  buffers, eager), counted per pass (``M3Eagle3Worker.sglang_m3_stats``), so
  ``Engine.get_server_info()`` / ``/server_info`` show whether the draft graphs
  replay. SGLang's state dump has no per-worker extension point.
* ``Scheduler.is_disable_overlap_for_batch`` (AROUND): under overlap scheduling, a decode batch
  our EAGLE3 worker cannot run one step ahead of the host (a request with penalties or
  ``min_new_tokens``, whose tables are built from the committed output on the host) runs
  synchronously instead (``M3Eagle3Worker.needs_synchronous_step``): the scheduler processes the
  pending result first, as it does for grammars without a grammar barrier. SGLang's rule
  (``ScheduleBatch.grammar_needs_sync``) is about grammars only and has no per-worker hook;
  without this, greedy penalty requests under overlap differ from plain decoding.
* ``fused_moe_triton_config.get_moe_configs`` (AROUND): the fused MoE's tile configs
  tuned for M3's expert shapes (``moe_configs/``, written by ``scripts/tune_moe.py`` in
  SGLang's format and file names) come first; any shape we have none for gets SGLang's.
  SGLang's only knob, ``SGLANG_MOE_CONFIG_DIR``, replaces its whole config directory.
* ``ModelConfig.__init__`` (AFTER): M3 is served text-only (vision weights are
  skipped). SGLang marks every config with a text sub-config multimodal and
  would load an image processor; its only opt-out list is local to __init__.
  The vision sub-config is dropped too: SGLang's M3 config leaves it a raw dict,
  which its CPU TP adjustment (``adjust_config_with_unaligned_cpu_tp``) trips on.

Without CUDA only (``cpu_hooks.py``, AROUND): ``PagedTokenToKVPoolAllocator.
alloc_extend`` / ``alloc_decode``, ``mem_cache.allocation.get_last_loc`` /
``assign_req_to_token_pool_func`` (speculative slot reservation) and
``utils.common.support_triton``: torch paths where SGLang's Triton bookkeeping
kernels cannot run; SGLang picks them by attention-backend name, and only
``torch_native`` / ``intel_amx`` are known to it as Triton-free. Also there: gloo-only
TP groups, xgrammar's CPU bitmask, and the two pieces overlap scheduling with EAGLE3
needs on CPU (SGLang's CPU rule that turns it off, the ``FutureMap`` relay's gathers).
"""

from __future__ import annotations

import functools
import logging

from . import sglang_compat as compat
from .config import M3_ARCHITECTURES, is_m3_config
from .sglang_compat import BACKEND_NAME

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "register"]

_registered = False


def register() -> None:
    """Register M3 with SGLang once per process, then check that it took (``SystemExit`` otherwise)."""
    try:
        _register()
    except SystemExit:
        raise
    except Exception as exc:  # SGLang's loader would log this and serve M3 through its own code
        logger.exception("sglang-m3: registration failed")
        raise SystemExit(f"sglang-m3: registration with SGLang failed: {exc!r} (traceback above)") from exc


def _register() -> None:
    global _registered
    compat.check_sglang_version()
    HookRegistry, _ = compat.hook_registry()
    hooks = _hooks()
    if not _registered:
        from .model.eagle3 import DRAFT_ARCH, M3Eagle3Draft
        from .model.minimax_m3 import EntryClass
        from .server_args import m3_server_overrides

        models = compat.model_registry().models
        models.update({cls.__name__: cls for cls in EntryClass})
        models[DRAFT_ARCH] = M3Eagle3Draft
        compat.attention_backends()[BACKEND_NAME] = _create_backend
        compat.add_attention_backend_choice(BACKEND_NAME)
        override_fns = compat.model_override_fns()
        for arch in M3_ARCHITECTURES:
            override_fns[arch] = [m3_server_overrides]
        for target, hook, kind in hooks:
            HookRegistry.register(target, hook, kind)
        _registered = True
    # load_plugins() applies hooks after all plugins ran; applying here too makes a direct
    # register() call (tests, scripts) complete and lets the check below see them. It is
    # idempotent, but a target is patched once: a plugin loaded after this one cannot add a
    # hook to one of these targets.
    HookRegistry.apply_hooks()
    compat.check_hooks_applied(hooks, HookRegistry)
    _check_registered(compat.model_registry())


def _hooks() -> list:
    """``(target, hook, HookType)`` for every hook, in the module docstring's order."""
    import torch

    _, HookType = compat.hook_registry()
    hooks = [
        (compat.ATTN_BACKEND_WRAPPER, _keep_m3_backend, HookType.AROUND),
        (compat.BUILD_MINIMAX_SPARSE_KV_POOL, _build_kv_pool, HookType.REPLACE),
        (compat.COMPUTE_CELL_SIZE, _cell_size, HookType.AROUND),
        (compat.POOL_CONFIGURATOR_INIT, _draft_term, HookType.AFTER),
        (compat.INIT_POOLS, _draft_pools, HookType.AROUND),
        (compat.CREATE_SPEC_WORKER, _spec_worker, HookType.AROUND),
        (compat.HANDLE_KV4_COMPATIBILITY, _kv4_check, HookType.AROUND),
        (compat.APPLY_CUDA_GRAPH_COMPATIBILITY, _decode_graphs_only, HookType.AROUND),
        (compat.VALIDATE_ONE_REQUEST, _admit, HookType.BEFORE),
        (compat.SCHEDULER_GET_INTERNAL_STATE, _eagle3_state, HookType.AFTER),
        (compat.SCHEDULER_DISABLE_OVERLAP_FOR_BATCH, _sync_step_if_needed, HookType.AROUND),
        (compat.GET_MOE_CONFIGS, _tuned_moe_configs, HookType.AROUND),
        (compat.MODEL_CONFIG_INIT, _text_only, HookType.AFTER),
    ]
    if not torch.cuda.is_available():
        from . import cpu_hooks

        hooks += cpu_hooks.hooks(HookType)
    return hooks


def _check_registered(registry) -> None:
    """Stop if another plugin took the M3 names: SGLang would silently fall back."""
    from .model.minimax_m3 import MiniMaxM3ForCausalLM

    for arch in M3_ARCHITECTURES:
        cls = registry.models.get(arch)
        if not (isinstance(cls, type) and issubclass(cls, MiniMaxM3ForCausalLM)):
            raise SystemExit(f"sglang-m3: architecture {arch} resolves to {cls!r}, not sglang-m3's model")


def _create_backend(runner):
    from .attention.backend import M3MSABackend

    return M3MSABackend(runner)


def _keep_m3_backend(original, runner, full_attn_backend):
    from .attention.backend import M3MSABackend

    if isinstance(full_attn_backend, M3MSABackend):
        return full_attn_backend
    return original(runner, full_attn_backend)


def _build_kv_pool(self, *, max_total_num_tokens: int):
    from .mem.kv_pool import build_kv_pool

    return build_kv_pool(self, max_total_num_tokens)


def _exact_cell_size(kvc) -> int | None:
    """Exact KV bytes per token on this rank of an M3 target, EAGLE3 draft layers included (None otherwise)."""
    if kvc.is_draft_worker or not is_m3_config(kvc.model_config.hf_config):
        return None
    from .mem.kv_pool import rank_budget

    return rank_budget(kvc)[-1]["total"]


def _cell_size(original, self, kvc, num_layers: int) -> int:
    self._m3_cell_size = _exact_cell_size(kvc)
    return original(self, kvc, num_layers) if self._m3_cell_size is None else self._m3_cell_size


def _draft_term(result, self, kvc) -> None:
    if getattr(self, "_m3_cell_size", None) is not None:
        self._cell_size = self._m3_cell_size  # undo SGLang's draft scaling by the target's average layer


def _draft_pools(original, self, *, sizes, req_to_token_pool, token_to_kv_pool_allocator):
    from .mem.kv_pool import M3KVPool

    target_pool = token_to_kv_pool_allocator.get_kvcache() if token_to_kv_pool_allocator is not None else None
    if not (self.is_draft_worker and isinstance(target_pool, M3KVPool)):
        return original(
            self,
            sizes=sizes,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        )
    return compat.initialized_pools(
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=target_pool.draft_view(),
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
    )


def _spec_worker(original, self, server_args):
    if not (self.is_eagle3() and is_m3_config(server_args.get_model_config().hf_config)):
        return original(self, server_args)
    from .spec.worker import M3Eagle3Worker

    return M3Eagle3Worker


def _decode_graphs_only(original, self):
    original(self)
    if not is_m3_config(self.get_model_config().hf_config):
        return
    Backend, Phase = compat.cuda_graph_enums()
    if self.cuda_graph_config.prefill.backend == Backend.DISABLED:
        return
    if (Phase.PREFILL, "backend") in self._cuda_graph_config_locked:
        raise ValueError(
            f"prefill CUDA graph backend={self.cuda_graph_config.prefill.backend!r}: sglang-m3 captures decode and "
            "verify only (MSA prefill plans are data-dependent); use the 'disabled' prefill backend"
        )
    logger.info("sglang-m3: prefill CUDA graphs off for MiniMax-M3 (decode and verify are captured)")
    self.cuda_graph_config.prefill.backend = Backend.DISABLED


def _admit(self, obj, input_ids):
    if not is_m3_config(self.model_config.hf_config):
        return
    from .admission import check_input_ids

    check_input_ids(input_ids, self.model_config.vocab_size)
    if getattr(self.server_args, "speculative_algorithm", None):
        from .spec.admission import check_sampling_params

        params = obj.sampling_params if isinstance(getattr(obj, "sampling_params", None), dict) else None
        check_sampling_params(
            params,
            getattr(obj, "custom_logit_processor", None),
            bool(getattr(self.server_args, "enable_deterministic_inference", False)),
        )


def _eagle3_state(result, self, *args, **kwargs) -> None:
    stats = getattr(getattr(self, "draft_worker", None), "sglang_m3_stats", None)
    if callable(stats):
        result.internal_state["sglang_m3_eagle3"] = stats()


def _sync_step_if_needed(original, self, batch, *args, **kwargs):
    if original(self, batch, *args, **kwargs):
        return True
    needs_sync = getattr(getattr(self, "draft_worker", None), "needs_synchronous_step", None)
    # Only with a result still pending (what the scheduler then processes first), as SGLang's grammar rule.
    pending = len(getattr(self, "result_queue", ()))
    return bool(batch) and pending > 0 and callable(needs_sync) and needs_sync(batch)


def _tuned_moe_configs(original, E, N, dtype, block_n=0, block_k=0, per_channel_quant=False, down_moe=False):
    from sglang.srt.runtime_context import get_exec

    ours = None
    if not get_exec().deterministic.enable_deterministic_inference:  # SGLang's own rule: defaults only then
        ours = _moe_configs_for(E, N, dtype, block_n, block_k, per_channel_quant, down_moe)
    return ours if ours is not None else original(E, N, dtype, block_n, block_k, per_channel_quant, down_moe)


@functools.lru_cache(maxsize=None)
def _moe_configs_for(E, N, dtype, block_n, block_k, per_channel_quant, down_moe):
    import triton
    from sglang.srt.layers.moe.moe_runner.triton_utils import get_config_file_name

    from . import moe_configs

    name = get_config_file_name(E, N, dtype, [block_n, block_k], per_channel_quant, down_moe)
    found = moe_configs.lookup(name, triton.__version__)
    if found is None and per_channel_quant:
        # Per-tensor FP8 experts run in per-channel mode (quant.per_token_moe_activations): the same
        # GEMM, only the scales' loads differ, so the per-tensor file's tiles hold.
        name = get_config_file_name(E, N, dtype, [block_n, block_k], False, down_moe)
        found = moe_configs.lookup(name, triton.__version__)
    if found is not None:
        logger.info("sglang-m3: fused MoE configs tuned for M3: %s", moe_configs.config_path(name, triton.__version__))
    return found


def _kv4_check(original, self):
    if is_m3_config(self.get_model_config().hf_config):
        return None
    return original(self)


_MULTIMODAL_FLAGS = (
    "is_multimodal",
    "is_audio_model",
    "is_image_understandable_model",
    "is_audio_understandable_model",
    "is_multimodal_chunked_prefill_supported",
    "is_multimodal_piecewise_cuda_graph_supported",
    "is_multimodal_breakable_cuda_graph_supported",
)


def _text_only(result, self, *args, **kwargs):
    if not is_m3_config(self.hf_config):
        return
    if kwargs.get("enable_multimodal"):
        raise ValueError("--enable-multimodal: sglang-m3 serves MiniMax-M3 text-only (vision weights are skipped)")
    for flag in _MULTIMODAL_FLAGS:
        setattr(self, flag, False)
    if hasattr(self.hf_config, "vision_config"):
        del self.hf_config.vision_config
