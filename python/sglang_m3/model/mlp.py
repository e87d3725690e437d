"""M3 feed-forward blocks: the dense SwiGLU-OAI MLP and the sigmoid-routed MoE.

On CUDA the experts run through SGLang's fused Triton MoE (``fused_experts``) with
its GPT-OSS SwiGLU variant (``gemm1_alpha`` / ``gemm1_clamp_limit``, gate and up
*not* interleaved): exactly M3's activation, and free of host syncs, so decode and
verify can be captured in CUDA graphs. On CPU (no Triton) a torch loop over the
routed experts is the path, and the oracle; SGLang's native MoE path ignores the
alpha/limit for ``silu`` (DESIGN section 4). Expert weights are stacked
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``), the layout the fused kernel takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from torch import nn

from ..config import M3Config
from .layers import swiglu_oai


class DenseMLP(nn.Module):
    """``down(swiglu_oai(gate_up(x)))``; used for dense layers and the shared expert."""

    def __init__(self, cfg: M3Config, intermediate_size: int, prefix: str):
        super().__init__()
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, bias=False, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2I]
        out, _ = self.down_proj(swiglu_oai(gate_up, self.alpha, self.limit))  # [T, H]
        return out


def _expert_loader(param: nn.Parameter, loaded: torch.Tensor, expert: int | None = None, rows: slice | None = None):
    """One expert's w1/w3/w2 into its rows, or (``expert=None``) all experts at once."""
    if expert is None:
        param.data.copy_(loaded)
    else:
        param.data[expert, rows].copy_(loaded)


class MoE(nn.Module):
    """Sigmoid router with a selection bias, top-k renormalised weights, x routed_scaling, + shared expert."""

    def __init__(self, cfg: M3Config, prefix: str):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.scale = cfg.top_k, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.intermediate = I
        # The released router weight and bias are fp32; routing runs in fp32.
        self.router = nn.Parameter(torch.empty(E, H, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)  # w1 (gate) rows, then w3 (up)
        self.w2 = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        for p in (self.w13, self.w2):
            p.weight_loader = _expert_loader
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size, prefix=f"{prefix}.shared_experts")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
        scores = torch.sigmoid(F.linear(x.float(), self.router))  # [T, E]
        _, ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        routed = self._experts_fused(x, weights, ids) if x.is_cuda else self._experts_loop(x, weights, ids)
        return routed * self.scale + self.shared_experts(x)

    def _experts_fused(self, x, weights, ids):
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        config = MoeRunnerConfig(
            num_experts=self.w13.shape[0],
            num_local_experts=self.w13.shape[0],
            top_k=self.top_k,
            activation="silu",
            is_gated=True,
            inplace=False,
            gemm1_alpha=self.alpha,
            gemm1_clamp_limit=self.limit,
            gate_up_interleaved=False,
        )
        topk = StandardTopKOutput(weights.to(torch.float32), ids.to(torch.int32), None)
        return fused_experts(x, self.w13, self.w2, topk, config)

    def _experts_loop(self, x, weights, ids):
        routed = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == expert, as_tuple=True)
            h = swiglu_oai(F.linear(x[tok], self.w13[expert]), self.alpha, self.limit)  # [t, I]
            y = F.linear(h, self.w2[expert]) * weights[tok, slot, None]  # [t, H] fp32
            routed.index_add_(0, tok, y.to(x.dtype))
        return routed
