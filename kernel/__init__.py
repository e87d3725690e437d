"""Triton kernels for MiniMax-M3, each beside its PyTorch reference; no SGLang imports.

Modules: ``paged`` (page-table addressing contract), ``kv_quant`` (FP8 / NVFP4 references and
the fused quantise-and-store ``kv_store``, and ``kv_store_many`` for a layer's K, V and index-K
in one launch), ``msa_index_topk`` (indexer block scores + top-k:
``msa_topk_ref`` / ``msa_topk``, knobs in ``TopkSettings``), ``msa_sparse_attn`` (block-sparse
or dense paged GQA attention: ``msa_attention_ref`` / ``msa_attention``, knobs in
``AttentionSettings``; the Triton bodies of these two are in ``*_triton.py`` beside them), ``gemv``
(a weight-streaming GEMV for one to four rows, which the LM head runs at one token: ``gemv_ref`` /
``gemv``). ``pdl`` holds the programmatic-dependent-launch helpers they use. Timings:
``benchmarks/kernels.md``; tuning conclusions: ``docs/perf-notes.md``.
"""
