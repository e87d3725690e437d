"""The EAGLE3 draft head for M3 targets (``LlamaForCausalLMEagle3`` checkpoints).

Semantics are those of SGLang's ``llama_eagle3.py`` (the format public M3 drafts
ship in): ``h = fc(cat(aux_low, aux_mid, aux_high))`` (skipped when the input is
already hidden-sized: a draft step feeding its own state), then one decoder layer
over ``cat(input_layernorm(embed(token)), hidden_norm(h))`` with ``h`` as the
residual, a final norm for the logits (draft vocabulary; ``d2t`` maps to target
ids) and the *pre-norm* sum as the hidden state carried to the next draft step.

Why our own class: SGLang's Llama layers reach for CUDA / vLLM rotary kernels on
CPU (``RotaryEmbedding`` imports ``vllm._custom_ops`` there), and the draft must
run on our ``m3_msa`` backend over the target's pool. The worker selects this class
for the draft runner by architecture name (``DRAFT_ARCH``).
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.nn.functional as F
from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_loader.weight_utils import default_weight_loader
from torch import nn

from ..config import DraftConfig
from ..parallel import rank_heads
from .head import stream_head
from .layers import PartialNeoxRope, RMSNorm
from .weights import LoadedParts

DRAFT_ARCH = "SglangM3Eagle3Draft"

# checkpoint projection -> (our fused parameter, shard)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int):
        super().__init__()
        H = cfg.hidden_size
        heads = rank_heads(
            cfg.num_heads, cfg.num_kv_heads, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        )
        self.heads, self.kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(2 * H, self.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.head_dim, H, bias=False)
        self.rope = PartialNeoxRope(self.head_dim, cfg.rope_theta)  # full rotary, NeoX pairing (Llama)
        self.attn = RadixAttention(
            self.heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.kv_heads, layer_id=layer_id
        )
        self.gate_up_proj = MergedColumnParallelLinear(H, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, H, bias=False)

    def forward(self, positions, embeds, hidden, forward_batch):
        """``embeds``, ``hidden``: ``[T, H]``; returns (mlp output, residual) ``[T, H]`` each."""
        T = hidden.shape[0]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        q, k, v = self.qkv_proj(x)[0].split([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], -1)
        cos, sin = self.rope.cos_sin(positions)
        q = self.rope(q.reshape(T, self.heads, self.head_dim), cos, sin).reshape(T, -1)
        k = self.rope(k.reshape(T, self.kv_heads, self.head_dim), cos, sin).reshape(T, -1)
        attn = get_attn_backend().forward(q, k, v.contiguous(), self.attn, forward_batch)
        x, residual = self.post_attention_layernorm(self.o_proj(attn)[0], hidden)
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0], residual


class M3Eagle3Draft(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if quant_config is not None:
            raise ValueError(f"EAGLE3 draft: quantization={quant_config.get_name()!r} is not supported")
        self.config = config
        self.cfg = cfg = DraftConfig.from_hf(config)
        H = cfg.hidden_size
        self.draft_vocab_size = cfg.draft_vocab_size
        self.fc = nn.Linear(len(cfg.aux_layer_ids or (0, 0, 0)) * H, H, bias=False)
        self.layer = DraftLayer(cfg, layer_id=0)
        self.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, H)
        stream_head(self.lm_head)
        logits_config = copy.copy(config)
        logits_config.vocab_size = self.draft_vocab_size
        self.logits_processor = LogitsProcessor(logits_config)
        object.__setattr__(self, "embed_tokens", None)  # the target's (vocab-parallel) embedding (``set_embed``)
        self.hot_token_id = None  # [draft_vocab] target ids, from ``d2t``

    def set_embed(self, embed_tokens: nn.Module) -> None:
        """Share the target's embedding module (under TP each rank holds a vocabulary shard). Held
        outside the module tree: the target owns those weights."""
        object.__setattr__(self, "embed_tokens", embed_tokens)

    def get_hot_token_id(self):
        return self.hot_token_id

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **_):
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        hidden = forward_batch.spec_info.hidden_states  # [T, 3H] target aux, or [T, H] own state
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden.to(self.fc.weight.dtype))
        x, residual = self.layer(positions, embeds, hidden, forward_batch)
        normed, prenorm = self.norm(x, residual)
        return self.logits_processor(input_ids, normed, self.lm_head, forward_batch, [prenorm])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = LoadedParts()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layer.").replace("layers.0.", "layer.")
            if name == "d2t":  # stored as target_id - draft_id
                self.hot_token_id = self._hot_ids(tensor)
                continue
            if name in ("t2d", "embed_tokens.weight"):  # unused: the target's embedding is shared
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _STACKED:
                fused, shard = _STACKED[parts[-2]]
                name = ".".join([*[p for p in parts[:-2] if p not in ("self_attn", "mlp")], fused, parts[-1]])
            else:
                name = ".".join(p for p in parts if p not in ("self_attn", "mlp"))
            if name not in params:
                raise ValueError(f"EAGLE3 draft tensor {name!r} has no parameter in sglang-m3's draft")
            param = params[name]
            _check_shape(name, tensor, shard, self.cfg)
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(name, shard)
        missing = loaded.missing(params)
        if missing:
            raise ValueError(f"EAGLE3 draft checkpoint lacks {missing}")
        if self.draft_vocab_size != self.cfg.vocab_size and self.hot_token_id is None:
            raise ValueError(
                f"EAGLE3 draft draft_vocab_size={self.draft_vocab_size} < vocab_size={self.cfg.vocab_size} "
                "but the checkpoint has no d2t table mapping draft ids to target ids"
            )

    def _hot_ids(self, d2t: torch.Tensor) -> torch.Tensor:
        """``d2t`` (target id - draft id per draft id) -> target ids ``[draft_vocab]``, range-checked here
        rather than as a device assert at the first decode."""
        if d2t.shape != (self.draft_vocab_size,):
            raise ValueError(
                f"EAGLE3 draft d2t has shape {tuple(d2t.shape)}: expected ({self.draft_vocab_size},) "
                f"(draft_vocab_size={self.draft_vocab_size})"
            )
        ids = d2t.long() + torch.arange(d2t.shape[0])
        bad = (ids < 0) | (ids >= self.cfg.vocab_size)
        if bad.any():
            first = int(bad.nonzero()[0])
            raise ValueError(
                f"EAGLE3 draft d2t[{first}]={int(d2t[first])} maps draft id {first} to target id {int(ids[first])}, "
                f"outside the vocabulary [0, vocab_size={self.cfg.vocab_size})"
            )
        return ids


def _checkpoint_shape(name: str, shard, cfg: DraftConfig) -> tuple[int, ...] | None:
    """The whole (unsharded) shape the config implies for a checkpoint tensor, by our parameter name."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    if name == "layer.qkv_proj.weight":
        return ({"q": q, "k": kv, "v": kv}[shard], 2 * H)
    if name == "layer.gate_up_proj.weight":
        return (I, H)
    return {
        "fc.weight": (H, len(cfg.aux_layer_ids or (0, 0, 0)) * H),
        "layer.o_proj.weight": (H, q),
        "layer.down_proj.weight": (H, I),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }.get(name, (H,) if name.endswith("norm.weight") else None)


def _check_shape(name: str, tensor: torch.Tensor, shard, cfg: DraftConfig) -> None:
    """A checkpoint tensor whose shape does not fit the config is refused naming both, not left to
    a loader assertion."""
    want = _checkpoint_shape(name, shard, cfg)
    if want is not None and tuple(tensor.shape) != want:
        raise ValueError(
            f"EAGLE3 draft tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {want} "
            f"(hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
            f"num_attention_heads={cfg.num_heads}, num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
            f"draft_vocab_size={cfg.draft_vocab_size})"
        )
