"""The tiny EAGLE3 draft's format and its slow reference forward (plain torch; never imports SGLang).

Format: SGLang's ``LlamaForCausalLMEagle3`` (one decoder layer whose q/k/v read ``cat(input_layernorm(embed),
hidden_norm(h))``, ``fc`` over three captured target hidden states, its own final norm and a ``draft_vocab_size``
lm_head with a ``d2t`` table). No ``embed_tokens``: the draft shares the target's embedding.

Captured layers (DESIGN section 7): ``eagle_aux_hidden_state_layer_ids`` names layer *outputs* ``l``; the
serving side captures them as the *inputs* of layers ``l + 1`` (``aux_capture_inputs``).

``draft_forward_ref`` is the slow reference of what SGLang computes; ``chain_acceptance`` replays greedy
chain speculation (K drafts + 1 bonus per verify) with it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import aux_capture_inputs

TINY_AUX_LAYER_IDS = (0, 1, 2)  # outputs of layers 0, 1, 2 == inputs of layers 1, 2, 3 of the 4-layer tiny M3
DRAFT_VOCAB_SIZE = 256
NUM_DRAFT_TOKENS = 3  # chain length the draft is trained and measured for
PREFIX = "midlayer."  # the decoder layer's tensor prefix; SGLang maps it to model.layers.0


def draft_config(target_cfg: dict, layer_ids=TINY_AUX_LAYER_IDS, draft_vocab_size: int = DRAFT_VOCAB_SIZE) -> dict:
    """The draft's ``config.json`` for a target text config (either spelling; a VL config's text_config is used)."""
    t = target_cfg.get("text_config", target_cfg)
    rope = t.get("rope_parameters") or {}
    rope_theta = float(t.get("rope_theta", rope.get("rope_theta", 10000.0)))
    aux_capture_inputs(layer_ids, t["num_hidden_layers"])  # validate against the target
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": t["hidden_size"],
        "head_dim": t["head_dim"],
        # The target's query heads (4 or 8): the pair splits at every TP size the target takes.
        "num_attention_heads": t["num_attention_heads"],
        # 2 KV heads, unlike m3-tiny's 1: the draft layer's own geometry inside the target's pool.
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "vocab_size": t["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": t["rms_norm_eps"],
        # Plain full-width NeoX RoPE as llama applies it (no partial_rotary_factor: M3's partial rope is the target's).
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": t["max_position_embeddings"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": t.get("bos_token_id"),
        "eos_token_id": t.get("eos_token_id"),
        "pad_token_id": t.get("pad_token_id"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the draft checkpoint holds, by name (``PREFIX`` = the decoder layer)."""
    hidden, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    layer = {
        "self_attn.q_proj.weight": (q, 2 * hidden),
        "self_attn.k_proj.weight": (kv, 2 * hidden),
        "self_attn.v_proj.weight": (kv, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "hidden_norm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    return {
        **{PREFIX + k: v for k, v in layer.items()},
        "fc.weight": (hidden, n_aux * hidden),
        "norm.weight": (hidden,),
        "lm_head.weight": (cfg["draft_vocab_size"], hidden),
    }


# Reference forward (slow, row by row): what SGLang's LlamaForCausalLMEagle3 computes for one sequence.


@dataclass
class Draft:
    config: dict
    tensors: dict[str, torch.Tensor]  # fp32; includes d2t (int64) and t2d (bool)

    def w(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def hot_ids(self) -> torch.Tensor:
        """Target id of each draft id (SGLang's ``hot_token_id``: ``d2t + arange``)."""
        d2t = self.tensors["d2t"]
        return d2t + torch.arange(d2t.shape[0])


def load_draft(path: str | os.PathLike) -> Draft:
    from safetensors.torch import load_file

    path = Path(path)
    tensors = load_file(path / "model.safetensors")
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    return Draft(json.loads((path / "config.json").read_text()), tensors)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm, ``x / rms(x) * w`` (llama's; not Gemma's ``1 + w``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style RoPE over the full head dim: halves ``(x1, x2)`` rotate by ``pos * theta^(-2i/d)``."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[..., None] * inv_freq  # [..., d/2]
    cos, sin = ang.cos(), ang.sin()  # pos broadcasts against x.shape[:-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def draft_forward_ref(draft: Draft, embed: torch.Tensor, input_ids, hidden, positions, cache=None):
    """One draft forward over new rows of ONE sequence: a draft extend (many rows) or a draft decode step (one row).

    ``embed``: the target's embedding table [vocab, H]. ``input_ids`` [T] target ids; ``hidden`` [T, 3H] captured
    target states ``cat(low, mid, high)`` (projected by ``fc``) or [T, H] the draft's own carried hidden state;
    ``positions`` [T]. ``cache``: (keys, values) [S, n_kv, hd] of earlier rows (post-RoPE), attended by every new
    row; each new row also attends to the new rows up to itself (causal).
    Returns ``(logits [T, draft_vocab], carried [T, H], token_ids [T] target ids, cache)``; ``carried`` is the
    pre-final-norm residual sum the next step consumes.
    """
    c, w = draft.config, draft.w
    eps, theta = c["rms_norm_eps"], c["rope_parameters"]["rope_theta"]
    n_h, n_kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    keys, values = (torch.zeros(0, n_kv, hd), torch.zeros(0, n_kv, hd)) if cache is None else cache  # [S, n_kv, hd]
    logits_rows, carried_rows = [], []
    for i in range(len(input_ids)):
        e = embed[int(input_ids[i])].float()
        h = hidden[i].float()
        if h.shape[-1] != e.shape[-1]:
            h = w("fc.weight") @ h
        residual = h
        x = torch.cat(
            [
                rms_norm(e, w(PREFIX + "input_layernorm.weight"), eps),
                rms_norm(h, w(PREFIX + "hidden_norm.weight"), eps),
            ]
        )
        pos = torch.as_tensor(positions[i])
        q = rope((w(PREFIX + "self_attn.q_proj.weight") @ x).view(n_h, hd), pos, theta)
        k = rope((w(PREFIX + "self_attn.k_proj.weight") @ x).view(n_kv, hd), pos, theta)
        v = (w(PREFIX + "self_attn.v_proj.weight") @ x).view(n_kv, hd)
        keys, values = torch.cat([keys, k[None]]), torch.cat([values, v[None]])
        heads = []
        for head in range(n_h):
            g = head // (n_h // n_kv)  # GQA: query head -> its KV head
            p = torch.softmax(keys[:, g] @ q[head] / math.sqrt(hd), dim=0)  # over every earlier row and this one
            heads.append(p @ values[:, g])
        residual = w(PREFIX + "self_attn.o_proj.weight") @ torch.cat(heads) + residual
        x = rms_norm(residual, w(PREFIX + "post_attention_layernorm.weight"), eps)
        gate, up = w(PREFIX + "mlp.gate_proj.weight") @ x, w(PREFIX + "mlp.up_proj.weight") @ x
        residual = w(PREFIX + "mlp.down_proj.weight") @ (F.silu(gate) * up) + residual
        carried_rows.append(residual)
        logits_rows.append(w("lm_head.weight") @ rms_norm(residual, w("norm.weight"), eps))
    logits = torch.stack(logits_rows)
    return logits, torch.stack(carried_rows), draft.hot_ids[logits.argmax(-1)], (keys, values)


def chain_acceptance(draft: Draft, embed, seq, aux, prompt_len: int, num_draft: int = NUM_DRAFT_TOKENS) -> list[int]:
    """Greedy chain speculation replayed on a target's greedy sequence; returns tokens committed per verify step.

    ``seq`` [L]: prompt + the target's greedy continuation; ``aux`` [L, 3H]: the target's captured states at each
    position. With greedy verify, draft k is accepted iff it equals the target's next greedy token, and the
    target's states at a position depend only on the tokens up to it, so one target pass serves every verify.
    After each verify with committed tokens ``seq[:m + 1]``, the draft has extended positions ``0..m-1`` (input
    ``seq[t + 1]``, state ``aux[t]``); its last row gives draft 1, then decode steps at positions ``m, m + 1, ..``
    feed back their own token and carried state. Each verify commits the accepted drafts plus one bonus token.
    """
    L = len(seq)
    _, carried, tokens, (keys, values) = draft_forward_ref(draft, embed, seq[1:], aux[: L - 1], torch.arange(L - 1))
    committed, m = [], prompt_len
    while m + num_draft < L:
        drafts, h, cache = [int(tokens[m - 1])], carried[m - 1 : m], (keys[:m], values[:m])
        for k in range(1, num_draft):
            _, h, tok, cache = draft_forward_ref(draft, embed, [drafts[-1]], h, [m - 1 + k], cache)
            drafts.append(int(tok[0]))
        accepted = 0
        while accepted < num_draft and drafts[accepted] == int(seq[m + 1 + accepted]):
            accepted += 1
        committed.append(accepted + 1)
        m += accepted + 1
    return committed
