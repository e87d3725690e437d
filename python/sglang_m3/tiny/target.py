"""The tiny M3 target in transformers (fp32, CPU): load it, capture its layer inputs, continue greedily."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def load_target(target_dir: str | os.PathLike):
    """The tiny M3 in transformers, fp32 eager, and its text model (whose ``layers`` get hooked)."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    arch = json.loads((Path(target_dir) / "config.json").read_text())["architectures"][0]
    cls = mm.MiniMaxM3SparseForConditionalGeneration if "ConditionalGeneration" in arch else mm.MiniMaxM3VLForCausalLM
    model = cls.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    text = next(m for m in model.modules() if isinstance(m, mm.MiniMaxM3VLTextModel))
    return model, text


@torch.no_grad()
def target_states(model, text, ids: torch.Tensor):
    """``(layer_inputs [N + 1, B, T, H], logits [B, T, vocab])`` for token ids [B, T].

    ``layer_inputs[i]`` is the input of layer i (the residual stream SGLang captures); ``[N]`` is the last layer's
    output *before* the final norm. (transformers' ``output_hidden_states`` ends with the post-norm state, which
    no serving engine captures, so hooks are used instead.)
    """
    captured = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: captured.__setitem__(
                i, kwargs.get("hidden_states", args[0] if args else None)
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(text.layers)
    ]
    n = len(text.layers)
    hooks.append(text.layers[n - 1].register_forward_hook(lambda mod, args, out: captured.__setitem__(n, out)))
    try:
        logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([captured[i] for i in range(n + 1)]), logits.float()


@torch.no_grad()
def greedy_continue(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, T] prompts of equal length -> [B, T + new_tokens] with the target's greedy continuation."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return model.generate(ids, generation_config=cfg)
