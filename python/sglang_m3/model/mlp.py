"""M3 feed-forward blocks: the dense SwiGLU-OAI MLP and the sigmoid-routed MoE.

The MoE is SGLang's own: ``FusedMoE`` owns the routed experts' weights (``w13_weight``
``[E_local, 2 I / tp, H]`` gate rows then up rows, not interleaved; ``w2_weight``
``[E_local, H, I / tp]``), shards them for tensor and expert parallelism through its
weight loader and applies ``quant_config`` (FP8 and friends); ``TopK`` routes (sigmoid
scores, selection on ``sigmoid + e_score_correction_bias``, renormalised weights, output x
``routed_scaling_factor``). The SwiGLU-OAI gate goes through the MoE runner's
``gemm1_alpha`` / ``gemm1_clamp_limit``. The shared expert is a separate tensor-parallel
MLP, or, with ``--enforce-shared-experts-fusion``, FusedMoE's expert ``E`` (every token's
fifth expert, weight 1, as SGLang's own M3 runs it by default; ``fuse_shared_expert``). Either way the
routed and shared partial sums share one all-reduce.

A separate shared expert runs on a side CUDA stream beside the router and the routed experts while
CUDA graphs are captured (up to ``SIDE_STREAM_MAX_TOKENS`` tokens), as SGLang's DeepSeek / Qwen MoE
models run theirs: at decode sizes both are small memory-bound GEMMs whose ramp-up and tail the other
fills. ``SGLANG_M3_SHARED_EXPERT_STREAM=0`` keeps it on the main stream (the benchmarks' A/B switch).

On CPU (no Triton, and SGLang's native MoE path ignores alpha/limit for ``silu``: DESIGN
section 4) and for fp32 models on CUDA ``route`` and ``experts_ref`` are the path, over the
same ``FusedMoE`` parameters; they are also the test oracle of the CUDA path.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from sglang.srt.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.topk import TopK
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.runtime_context import get_exec, get_parallel, get_stream
from torch import nn

from ..config import M3Config
from .layers import Router, split_router, swiglu, swiglu_oai

SIDE_STREAM_MAX_TOKENS = 1024  # SGLang's DUAL_STREAM_TOKEN_THRESHOLD for its MoE models' shared experts
SIDE_STREAM_ENV = "SGLANG_M3_SHARED_EXPERT_STREAM"


class DenseMLP(nn.Module):
    """``down(swiglu_oai(gate_up(x)))``; used for dense layers and the shared expert.

    ``reduce_results=False`` leaves the tensor-parallel partial sum to the caller (the MoE
    adds it to the routed experts' partial sum before one all-reduce)."""

    def __init__(self, cfg: M3Config, intermediate_size: int, prefix: str, quant_config=None, reduce_results=True):
        super().__init__()
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            cfg.hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2I/tp]
        out, _ = self.down_proj(swiglu(gate_up, self.alpha, self.limit))  # [T, H]
        return out


def fuse_shared_expert(cfg: M3Config) -> bool:
    """Whether the shared expert runs inside FusedMoE as expert ``E`` (decided at start-up, under the
    model's default device and dtype). Only with ``--enforce-shared-experts-fusion``: on the H200 at
    real width the separate MLP measured faster at batch 1 and 32 (docs/perf-notes.md). It needs CUDA
    in half precision (fp32 and CPU models run the torch path, which has no slot), a shared expert as
    wide as a routed one, and no expert parallelism (FusedMoE keeps one fused slot, not one per rank)."""
    return (
        torch.get_default_device().type == "cuda"
        and torch.get_default_dtype() != torch.float32
        and cfg.shared_intermediate_size == cfg.moe_intermediate_size
        and get_parallel().moe_ep_size == 1
        and get_exec().moe.enforce_shared_experts_fusion
    )


class MoE(nn.Module):
    """Sigmoid router with a selection bias, top-k renormalised weights, x routed_scaling, + shared expert."""

    def __init__(self, cfg: M3Config, layer_id: int, prefix: str, quant_config=None):
        super().__init__()
        self.top_k, self.scale = cfg.top_k, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_experts = cfg.num_experts
        fused = int(fuse_shared_expert(cfg))  # the shared expert's slot in FusedMoE: expert E
        # The released router weight and bias are fp32; routing runs in fp32 (never quantised).
        self.gate = Router(cfg.hidden_size, cfg.num_experts, split_router(torch.get_default_dtype()))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False
        )
        self.experts = FusedMoE(
            num_experts=cfg.num_experts + fused,
            num_fused_shared_experts=fused,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            layer_id=layer_id,
            top_k=cfg.top_k + fused,
            reduce_results=False,
            inplace=False,  # the shared expert may still be reading x on the side stream
            quant_config=quant_config,
            activation="silu",
            is_gated=True,
            gemm1_alpha=cfg.swiglu_alpha,
            gemm1_clamp_limit=cfg.swiglu_limit,
            gate_up_interleaved=False,
            prefix=f"{prefix}.experts",
        )
        self.topk = TopK(
            top_k=cfg.top_k + fused,
            layer_id=layer_id,
            renormalize=True,
            scoring_func="sigmoid",
            correction_bias=self.e_score_correction_bias,
            num_fused_shared_experts=fused,
            routed_scaling_factor=cfg.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=True,
        )
        self.shared_experts = (
            None
            if fused
            else DenseMLP(
                cfg,
                cfg.shared_intermediate_size,
                prefix=f"{prefix}.shared_experts",
                quant_config=quant_config,
                reduce_results=False,
            )
        )
        side = not fused and torch.get_default_device().type == "cuda" and os.environ.get(SIDE_STREAM_ENV) != "0"
        self.side_stream = get_stream("alt") if side else None  # created here: not while a graph is captured

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream() if x.is_cuda else None
        side = self.side_stream if x.shape[0] <= SIDE_STREAM_MAX_TOKENS and get_is_capture_mode() else None
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts(x)  # [T, H]: this rank's part
        else:
            shared = None if self.shared_experts is None else self.shared_experts(x)
        logits = self.gate(x)  # [T, E] fp32
        if x.is_cuda and x.dtype != torch.float32:
            out = self.experts(x, self.topk(x, logits))  # weights x routed_scaling inside
        else:
            # No Triton on CPU; and SGLang's fused MoE computes fp32 inputs in fp16 (``compute_type``
            # in moe_runner/triton_utils/fused_moe.py), which fp32 parity runs cannot take.
            out = self.experts_ref(x, *self.route(logits)) * self.scale
        if side is not None:
            main.wait_stream(side)
        if shared is not None:
            out = out + shared
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[T, E]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
        scores = torch.sigmoid(logits.float())  # [T, E]
        _, ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def experts_ref(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed experts (its expert range, its slice of each expert's width) in torch.

        On CPU each expert runs on the rows routed to it. On CUDA every local expert runs on every
        row, weighted 0 where not routed (exact: the SwiGLU is clamped, so finite): no host sync,
        so CUDA graphs capture it."""
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight  # [E_local, 2I', H], [E_local, H, I']
        local_ids = ids - self.experts.moe_ep_rank * w13.shape[0]  # other EP ranks' experts fall outside
        if x.is_cuda:
            experts = range(w13.shape[0])
        else:
            experts = [e for e in torch.unique(local_ids).tolist() if 0 <= e < w13.shape[0]]
        routed = torch.zeros_like(x)
        for expert in experts:
            hit = local_ids == expert  # [T, k]
            if x.is_cuda:
                h = swiglu_oai(F.linear(x, w13[expert]), self.alpha, self.limit)  # [T, I']
                routed += (F.linear(h, w2[expert]) * (weights * hit).sum(-1, keepdim=True)).to(x.dtype)
                continue
            tok, slot = torch.nonzero(hit, as_tuple=True)
            h = swiglu_oai(F.linear(x[tok], w13[expert]), self.alpha, self.limit)  # [t, I']
            routed.index_add_(0, tok, (F.linear(h, w2[expert]) * weights[tok, slot, None]).to(x.dtype))
        return routed
