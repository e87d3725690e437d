"""The LM head's GEMV dispatch (``model/head.py``) on SGLang's own ``ParallelLMHead`` and logits rule.

On CUDA, bf16 / fp16 heads at one row (``GEMV_ROWS``) take ``sglang_m3_kernels.gemv`` (bit for bit the
kernel's output, within 2^-7 of the largest fp32-reference logit: ``test/kernel/test_gemv.py`` states
that bound); every other case is SGLang's product bit for bit. ``--enable-fp32-lm-head`` keeps SGLang's
path.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from cpu_model import one_rank
from sglang_m3.tiny import default_checkpoint

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def head_on_one_rank(dtype=torch.bfloat16, vocab=1000, hidden=512, **server_args):
    from sglang.srt import runtime_context
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.server_args import ServerArgs

    path = default_checkpoint("m3-tiny", "vl")
    with one_rank(path):
        if server_args:
            runtime_context.reset_context()
            runtime_context.publish(ServerArgs(model_path=str(path), device="cpu", **server_args), role="test")
        with set_default_torch_dtype(dtype):
            head = ParallelLMHead(vocab, hidden)
        head.weight.data.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        yield head.to(DEV)


def test_plain_heads_take_the_streamed_method_and_sglang_routes_logits_through_it():
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
    from sglang_m3.model.head import StreamedHeadMethod, stream_head

    with head_on_one_rank() as head:
        assert not should_apply_lm_head_quant_method(head, head.quant_method)  # SGLang's own matmul before
        assert stream_head(head) and type(head.quant_method) is StreamedHeadMethod
        assert should_apply_lm_head_quant_method(head, head.quant_method)
        assert not stream_head(head)  # only SGLang's plain method is replaced


def test_target_and_draft_heads_are_streamed():
    """Both models M3 serves with build their heads with the GEMV method (bf16, as the engine builds them)."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.eagle3 import M3Eagle3Draft
    from sglang_m3.model.head import StreamedHeadMethod
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM
    from sglang_m3.tiny.draft import default_draft
    from transformers import AutoConfig

    path, draft_path = default_checkpoint("m3-tiny", "vl"), default_draft("m3-tiny")  # built in fp32 if not cached
    with one_rank(path), set_default_torch_dtype(torch.bfloat16):
        target = MiniMaxM3ForCausalLM(AutoConfig.from_pretrained(path))
        draft = M3Eagle3Draft(AutoConfig.from_pretrained(draft_path))
    assert type(target.lm_head.quant_method) is StreamedHeadMethod
    assert type(draft.lm_head.quant_method) is StreamedHeadMethod


def test_an_fp32_head_keeps_sglangs_path():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
    from sglang_m3.model.head import stream_head

    with head_on_one_rank(enable_fp32_lm_head=True) as head:
        assert not stream_head(head)
        assert type(head.quant_method) is UnquantizedEmbeddingMethod


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_equal_sglangs_product_where_the_gemv_does_not_apply(dtype):
    """CPU (every row count), fp32, and more than ``GEMV_ROWS`` rows on CUDA: ``x @ w.T`` as SGLang's
    logits processor computes it."""
    from sglang_m3.model.head import GEMV_ROWS, stream_head

    with head_on_one_rank(dtype) as head:
        stream_head(head)
        for rows in sorted({1, GEMV_ROWS, GEMV_ROWS + 1, 7}):
            if DEV == "cuda" and dtype != torch.float32 and rows <= GEMV_ROWS:
                continue  # the GEMV's case: the GPU test below
            x = torch.randn(rows, head.weight.shape[1], device=DEV).to(dtype)
            assert torch.equal(head.quant_method.apply(head, x), torch.matmul(x, head.weight.T))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_up_to_gemv_rows_run_the_gemv(dtype, monkeypatch):
    import sglang_m3_kernels.gemv as kernel
    from sglang_m3.model.head import GEMV_ROWS, stream_head

    gemv, calls = kernel.gemv, []
    monkeypatch.setattr(kernel, "gemv", lambda x, w: calls.append(x.shape[0]) or gemv(x, w))
    with head_on_one_rank(dtype, vocab=2051, hidden=1100) as head:
        stream_head(head)
        for rows in range(1, GEMV_ROWS + 1):
            x = torch.randn(rows, 1100, device=DEV).to(dtype)
            out = head.quant_method.apply(head, x)
            ref = kernel.gemv_ref(x, head.weight).float()
            assert torch.equal(out, gemv(x, head.weight))
            assert (out.float() - ref).abs().max() <= 2.0**-7 * ref.abs().max()
    assert calls == list(range(1, GEMV_ROWS + 1))
