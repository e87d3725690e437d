"""MiniMax-M3 text backbone for SGLang: embed -> decoder layers -> norm -> lm_head.

One class serves both released architecture names: the VL checkpoint
(``MiniMaxM3SparseForConditionalGeneration``, text weights under
``language_model.``; vision weights are skipped) and the text-only
``MiniMaxM3SparseForCausalLM``. Layer kinds come from the parsed per-layer lists,
never from a hard-coded count.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_loader.weight_utils import default_weight_loader
from torch import nn

from ..config import M3Config, aux_capture_inputs
from ..quant import check_quantization, keep_block_fp8_on_triton, per_token_moe_activations, quantises_rows_alone
from .attention import M3Attention, fused_norm_rope_fits, use_fused_norm_rope
from .head import stream_head
from .layers import GemmaNorm
from .mlp import DenseMLP, MoE
from .weights import EXPERT_PARAMS, KV_SCALE, QUANT_SCALES, LoadedParts, fused_shared_target, map_name

logger = logging.getLogger(__name__)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class M3DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, layer_id: int, prefix: str, quant_config=None):
        super().__init__()
        self.input_layernorm = GemmaNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = M3Attention(cfg, layer_id, prefix=f"{prefix}.self_attn", quant_config=quant_config)
        self.post_attention_layernorm = GemmaNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = (
            MoE(cfg, layer_id, prefix=f"{prefix}.mlp", quant_config=quant_config)
            if cfg.moe_layers[layer_id]
            else DenseMLP(cfg, cfg.dense_intermediate_size, prefix=f"{prefix}.mlp", quant_config=quant_config)
        )

    def forward(self, positions, hidden, residual, forward_batch):
        """``hidden``: the previous layer's output, ``residual``: the sum before it (``None`` at layer 0,
        where ``hidden`` is the embeddings). Each norm adds its input to the residual first (one fused
        kernel on CUDA). Returns this layer's (output, residual); their sum is the layer's pre-norm output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class M3Model(nn.Module):
    def __init__(self, cfg: M3Config, prefix: str = "model", quant_config=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            M3DecoderLayer(cfg, i, prefix=f"{prefix}.layers.{i}", quant_config=quant_config)
            for i in range(cfg.num_layers)
        )
        self.norm = GemmaNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, capture_layers=()):
        """``capture_layers``: layers whose *input* EAGLE3 reads, in the draft's order
        (repeats allowed; ``num_layers`` = the final pre-norm hidden state)."""
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        residual, seen = None, {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                # layer 0's input becomes its residual, which the norms then update in place
                seen[i] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        if len(self.layers) in capture_layers:
            seen[len(self.layers)] = hidden + residual
        return self.norm(hidden, residual)[0], [seen[i] for i in capture_layers]


class MiniMaxM3ForCausalLM(nn.Module):
    """Registered for both M3 architecture names by ``sglang_m3.plugin``."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        check_quantization(quant_config)
        self.config, self.quant_config = config, quant_config
        self.m3 = M3Config.from_hf(config)
        text_config = getattr(config, "text_config", config)
        self.model = M3Model(self.m3, quant_config=quant_config)
        keep_block_fp8_on_triton(self.model, quant_config)
        per_token_moe_activations(self.model, quant_config)
        if self.m3.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(self.m3.vocab_size, self.m3.hidden_size, prefix="lm_head")
        stream_head(self.lm_head)
        self.logits_processor = LogitsProcessor(text_config)
        self.capture_layers: tuple[int, ...] = ()
        # FP8 KV scales (value = fp8 x scale) per layer; 1.0 unless the checkpoint carries them.
        self.kv_scales = [{"k": 1.0, "v": 1.0} for _ in range(self.m3.num_layers)]
        # Set by post_load_weights once the weights are in place (a loader's full load, or SGLang's dummy /
        # sharded loaders); later load_weights calls are updates (SGLang's update_weights_from_*: any subset).
        self.weights_in_place = False

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_eagle3_layers_to_capture(self, layer_ids=None) -> None:
        """Called by SGLang's model runner with the draft's ``eagle_aux_hidden_state_layer_ids``."""
        self.capture_layers = aux_capture_inputs(layer_ids, self.m3.num_layers)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **_):
        hidden, aux = self.model(input_ids, positions, forward_batch, input_embeds, self.capture_layers)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux or None)

    def post_load_weights(self) -> None:
        """After the weights are in place (our ``load_weights`` calls it; SGLang's dummy and sharded loaders
        call it themselves, before quant methods process weights): on CUDA in half precision, sparse layers
        whose ``qkv_proj`` is unquantised or quantised row by row at load (``--quantization fp8``) project
        q / k / v and the index q / k with one GEMM, and in bf16 attention norms and rotates q / k with
        SGLang's fused kernel (built for bf16 only), which reads one cos/sin table of every position (fp32,
        shared by all layers). fp32 and CPU models keep the separate layers (the token-exact runs and their
        torch oracle). Once: a weight update (``load_weights`` again) writes through the fused views, and
        the cos/sin table (~256 MB at M3's 1M positions) would be built anew each time."""
        if self.weights_in_place:
            return
        self.weights_in_place = True
        weight = self.model.embed_tokens.weight
        if not (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)):
            return
        attn = [layer.self_attn for layer in self.model.layers]
        if weight.dtype == torch.bfloat16 and fused_norm_rope_fits(self.m3):
            use_fused_norm_rope(attn, attn[0].rope.cos_sin_table(self.m3.max_position_embeddings))
        for layer in attn:
            method = layer.qkv_proj.quant_method
            if isinstance(method, UnquantizedLinearMethod) or quantises_rows_alone(method):
                layer.fuse_qkv_index()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded, skipped = LoadedParts(), 0
        for name, tensor in weights:
            target = map_name(name)
            if target is None:
                skipped += 1
                continue
            if target.param == "lm_head.weight" and self.m3.tie_word_embeddings:
                continue
            if ".mlp.shared_experts." in target.param:
                mlp = self.model.layers[int(target.param.split(".")[2])].mlp
                if mlp.shared_experts is None:  # fused into FusedMoE as expert E
                    target = fused_shared_target(target, mlp.num_experts)
            if target.param.endswith(KV_SCALE):
                self._load_kv_scale(target, tensor)
                continue
            if target.param not in params:
                hint = ""
                if target.param.endswith(QUANT_SCALES) and self.quant_config is None:
                    hint = "; an FP8 checkpoint needs a quantization_config at the top level of config.json"
                raise ValueError(
                    f"checkpoint tensor {name!r} has no MiniMax-M3 parameter (mapped to {target.param!r}){hint}"
                )
            param = params[target.param]
            if tensor.dtype in FP8_DTYPES and param.dtype not in FP8_DTYPES:
                raise ValueError(
                    f"checkpoint tensor {name!r} is {tensor.dtype} but {target.param!r} is {param.dtype}: "
                    "FP8 weights need the checkpoint's quantization_config (quant_method fp8) to reach this layer"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            if EXPERT_PARAMS in target.param:
                _load_experts(loader, param, tensor, target, loaded)
                continue
            if target.shard is not None:
                loader(param, tensor, target.shard)
            else:
                loader(param, tensor)
            loaded.add(target.param, target.shard)
        if skipped:
            logger.info("sglang-m3: skipped %d vision/MTP tensors (text serving)", skipped)
        if not self.weights_in_place:  # the first load is the whole checkpoint; updates may be any part
            self._check_complete(loaded, params)
        self.post_load_weights()

    def _check_complete(self, loaded: LoadedParts, params) -> None:
        expected = set(params) - ({"lm_head.weight"} if self.m3.tie_word_embeddings else set())
        if self.quant_config is not None and not getattr(self.quant_config, "is_checkpoint_fp8_serialized", False):
            # scales an online method (--quantization fp8) computes after loading; an FP8 checkpoint brings its own
            expected = {name for name in expected if not name.endswith(QUANT_SCALES)}
        missing = loaded.missing(expected)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} MiniMax-M3 parameters or parts, e.g. {missing[:5]}")

    def _load_kv_scale(self, target, tensor: torch.Tensor) -> None:
        layer = int(target.param.split(".")[2])
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"checkpoint {target.param.replace(KV_SCALE, target.shard + '_scale')}={tensor.tolist()}: "
                "an FP8 KV scale must be one finite positive number per layer"
            )
        for which in target.shard:  # "k", "v" or "kv"
            self.kv_scales[layer][which] = value

    def kv_cache_scales(self) -> dict[int, tuple[float, float]]:
        """Per-layer ``(k_scale, v_scale)`` for quantised KV rows: the checkpoint's, else 1.0."""
        return {i: (s["k"], s["v"]) for i, s in enumerate(self.kv_scales)}


def _load_experts(loader, param, tensor: torch.Tensor, target, loaded: LoadedParts) -> None:
    """Routed-expert tensors through FusedMoE's loader, which shards them for TP / EP. It dispatches on
    the weight name (a name without "weight", like transformers' ``experts.gate_up_proj``, loads
    nothing), so our parameter's name is passed."""
    name = target.param
    # the released layout: one expert's w1 / w2 / w3 (or the fused shared expert's gate_up as "w13");
    # transformers' fused layout: every expert in one tensor, [E, 2I, H] or [E, H, I]
    experts = enumerate(tensor) if target.expert is None else [(target.expert, tensor)]
    for expert, weight in experts:
        if target.shard != "w13":
            pieces = [(target.shard, weight)]
        elif weight.dim() == 0:  # one per-tensor scale of gate and up together
            pieces = [("w1", weight), ("w3", weight)]
        else:
            pieces = list(zip(("w1", "w3"), weight.chunk(2, dim=0)))
        for shard, piece in pieces:
            loader(param, piece, name, shard, expert)
            loaded.add(name, shard, expert)


class MiniMaxM3SparseForConditionalGeneration(MiniMaxM3ForCausalLM):
    """The released VL architecture name, served text-only."""


class MiniMaxM3SparseForCausalLM(MiniMaxM3ForCausalLM):
    """The text-only architecture name."""


EntryClass = [MiniMaxM3SparseForConditionalGeneration, MiniMaxM3SparseForCausalLM]
