"""Torch paths for SGLang's Triton bookkeeping kernels, registered only without CUDA.

With ``page_size > 1`` SGLang's paged allocator and its speculative slot reservation
launch Triton kernels, which cannot run without a GPU ("0 active drivers"; DESIGN
section 2). SGLang picks the Triton-free paths by attention-backend name, and only
``torch_native`` / ``intel_amx`` are known to it as Triton-free. The allocator hooks keep
SGLang's function for tensors that are not on the CPU; the others decide by backend, model or
process (below). ``plugin.register()`` registers these (AROUND) only when
``torch.cuda.is_available()`` is False (it runs before the server's ``--device`` is known), so a
CPU engine on a GPU host needs the GPUs hidden (``CUDA_VISIBLE_DEVICES=``):

* ``PagedTokenToKVPoolAllocator.alloc_extend`` -> ``mem.cpu_alloc.alloc_extend_cpu``
  (SGLang's own ``alloc_extend_naive``, which its NPU allocator uses);
* ``PagedTokenToKVPoolAllocator.alloc_decode`` -> ``mem.cpu_alloc.alloc_decode_cpu``;
* ``mem_cache.allocation.get_last_loc`` -> SGLang's ``get_last_loc_torch``;
* ``mem_cache.allocation.assign_req_to_token_pool_func`` -> ``mem.cpu_alloc.assign_req_to_token_cpu``;
* ``utils.common.support_triton``: False for ``m3_msa`` (so SGLang takes its torch paths elsewhere);
* ``distributed.parallel_state.init_model_parallel_group``: tensor-parallel groups without NCCL
  or custom all-reduce communicators (SGLang turns them off only under ``SGLANG_USE_CPU_ENGINE``,
  which needs a CPU build of sgl-kernel that PyPI lacks): collectives run on gloo, so
  ``--tp-size 2 --device cpu`` works;
* xgrammar's token bitmask: SGLang allocates it in pinned memory (which needs a CUDA driver: the
  scheduler dies on the first regex / JSON-schema request) and applies it with GPU kernels only;
  without CUDA it is allocated unpinned and applied with xgrammar's own CPU kernel;
* ``arg_groups.speculative_hook._disable_overlap_schedule_for_cpu``: skipped for M3, whose EAGLE3
  worker runs under SGLang's overlap scheduler on CPU too (``spec/worker.py``); other models keep
  SGLang's rule (speculation on CPU without overlap);
* ``managers.overlap_utils.FutureMap._resolve_spec_extras`` (the overlap scheduler's relay of the
  next step's draft input out of the ``FutureMap``): plain index gathers on the CPU. SGLang's version gathers
  the rows with a Triton kernel and calls ``record_stream`` with ``torch.cpu.current_stream()``, which
  torch rejects ("unknown parameter type"): the scheduler died on the first speculative decode step.
"""

from __future__ import annotations

from . import sglang_compat as compat


def hooks(hook_type) -> list:
    """``(target, hook, kind)`` for ``HookRegistry.register``; ``hook_type`` is SGLang's ``HookType``."""
    return [
        (compat.PAGED_ALLOC_EXTEND, alloc_extend, hook_type.AROUND),
        (compat.PAGED_ALLOC_DECODE, alloc_decode, hook_type.AROUND),
        (compat.GET_LAST_LOC, get_last_loc, hook_type.AROUND),
        (compat.ASSIGN_REQ_TO_TOKEN_POOL, assign_req_to_token, hook_type.AROUND),
        (compat.SUPPORT_TRITON, support_triton, hook_type.AROUND),
        (compat.INIT_MODEL_PARALLEL_GROUP, gloo_only_group, hook_type.AROUND),
        (compat.XGRAMMAR_ALLOCATE_BITMASK, unpinned_token_bitmask, hook_type.AROUND),
        (compat.XGRAMMAR_APPLY_MASK, apply_token_bitmask, hook_type.AROUND),
        (compat.SPEC_CPU_NO_OVERLAP, keep_overlap_for_m3, hook_type.AROUND),
        (compat.RESOLVE_SPEC_EXTRAS, resolve_spec_extras, hook_type.AROUND),
    ]


def alloc_extend(original, self, *args, **kwargs):
    if str(self.device) != "cpu":
        return original(self, *args, **kwargs)
    from .mem.cpu_alloc import alloc_extend_cpu

    return alloc_extend_cpu(self, *args, **kwargs)


def alloc_decode(original, self, *args, **kwargs):
    if str(self.device) != "cpu":
        return original(self, *args, **kwargs)
    from .mem.cpu_alloc import alloc_decode_cpu

    return alloc_decode_cpu(self, *args, **kwargs)


def get_last_loc(original, req_to_token, req_pool_indices, prefix_lens):
    if req_to_token.device.type != "cpu":
        return original(req_to_token, req_pool_indices, prefix_lens)
    return compat.get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)


def assign_req_to_token(original, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    if req_to_token.device.type != "cpu":
        return original(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)
    from .mem.cpu_alloc import assign_req_to_token_cpu

    assign_req_to_token_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)


def support_triton(original, backend):
    return False if backend == compat.BACKEND_NAME else original(backend)


def gloo_only_group(original, *args, **kwargs):
    kwargs.update(
        use_pynccl=False,
        use_custom_allreduce=False,
        use_mscclpp_allreduce=False,
        use_torch_symm_mem_allreduce=False,
    )
    return original(*args, **kwargs)


def unpinned_token_bitmask(original, vocab_size: int, batch_size: int):
    import xgrammar

    return xgrammar.allocate_token_bitmask(batch_size, vocab_size)


def apply_token_bitmask(original, self, logits, vocab_mask):
    if logits.device.type != "cpu":
        return original(self, logits, vocab_mask)
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))


def keep_overlap_for_m3(original, server_args):
    from .config import is_m3_config

    if is_m3_config(server_args.get_model_config().hf_config):
        return None
    return original(server_args)


def resolve_spec_extras(original, self, batch):
    info = batch.spec_info
    if str(self.device) != "cpu" or self.spec_algo.is_ngram() or info is None or info.future_indices.shape[0] == 0:
        return original(self, batch)  # on the CPU, SGLang's early returns come before record_stream
    rows = info.future_indices
    info.bonus_tokens = self.output_tokens_buf[rows]
    if self.need_topk:
        info.topk_p, info.topk_index = self.topk_p_buf[rows], self.topk_index_buf[rows]
    if self.need_hidden_states:
        info.hidden_states = self.hidden_states_buf[rows]
    if self.draft_probs_buf is not None and info.draft_probs is not None:
        info.draft_probs = self.draft_probs_buf[rows]
    info.dsa_topk_indices = self.dsa_topk_indices_buf[rows] if info.future_dsa_topk_indices_available else None
