"""transformers references for the parity tests.

transformers 5.12.1 (the version sglang 0.5.17 pins) shares one MSA block selection
across index heads; later releases and every serving engine select per index head
(= per KV group), which is what sglang-m3 implements (DESIGN section 2).
``per_group_indexer()`` patches 5.12.1's indexer into the per-group rule: each
index head keeps its own top-k and each query head attends with its group's mask.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm


def _per_group_forward(self, hidden_states, position_embeddings, past_key_values, position_ids):
    batch, q_len, _ = hidden_states.shape
    idx_q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
    idx_k = self.k_norm(self.k_proj(hidden_states).view(batch, q_len, 1, self.head_dim)).transpose(1, 2)
    cos, sin = position_embeddings
    idx_q, idx_k = mm.apply_rotary_pos_emb(idx_q, idx_k, cos[..., : self.head_dim], sin[..., : self.head_dim])
    if past_key_values is not None:
        idx_k = past_key_values.layers[self.layer_idx].update_index(idx_k)
    k_len = idx_k.shape[2]
    num_blocks = -(-k_len // self.block_size)
    scores = torch.matmul(idx_q.float(), idx_k.float().transpose(-1, -2))  # [B, H, Sq, Sk]
    future = torch.arange(k_len, device=scores.device)[None, None, None, :] > position_ids[:, None, :, None]
    scores = F.pad(
        scores.masked_fill(future, float("-inf")), (0, num_blocks * self.block_size - k_len), value=float("-inf")
    )
    block_scores = scores.view(batch, self.num_heads, q_len, num_blocks, self.block_size).amax(-1)  # per head
    q_block = position_ids // self.block_size
    for i in range(self.local_blocks):
        local = (q_block - i).clamp(min=0)[:, None, :, None].expand(-1, self.num_heads, -1, 1)
        block_scores.scatter_(-1, local, float("inf"))
    top_scores, top_idx = block_scores.topk(min(self.topk_blocks, num_blocks), dim=-1)
    return top_idx.masked_fill(top_scores == float("-inf"), -1)  # [B, H, Sq, k]


def _per_group_mask(self, block_indices, attention_mask, key_length, dtype, device, position_ids):
    batch, heads, q_len, _ = block_indices.shape
    num_blocks = -(-key_length // self.block_size)
    safe = block_indices.masked_fill(block_indices < 0, num_blocks)
    keep = torch.zeros(batch, heads, q_len, num_blocks + 1, dtype=torch.bool, device=device)
    keep.scatter_(-1, safe, True)
    keep = keep[..., :num_blocks].repeat_interleave(self.block_size, dim=-1)[..., :key_length]  # [B, H, Sq, Sk]
    future = torch.arange(key_length, device=device)[None, None, None, :] > position_ids[:, None, :, None]
    keep = keep & ~future
    q_heads = self.config.num_attention_heads
    keep = keep.repeat_interleave(q_heads // heads, dim=1)  # each query head uses its KV group's selection
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


@contextlib.contextmanager
def per_group_indexer():
    saved = mm.MiniMaxM3VLIndexer.forward, mm.MiniMaxM3VLIndexer.build_block_mask
    mm.MiniMaxM3VLIndexer.forward, mm.MiniMaxM3VLIndexer.build_block_mask = _per_group_forward, _per_group_mask
    try:
        yield
    finally:
        mm.MiniMaxM3VLIndexer.forward, mm.MiniMaxM3VLIndexer.build_block_mask = saved


def load_hf(path, variant: str):
    """fp32 eager transformers model for a tiny checkpoint ('vl' or 'text').

    Eager experts too: transformers' default ``grouped_mm`` experts call ``torch._grouped_mm``,
    which takes no float64 and on a GPU is not the plain fp32 product the oracle must be."""
    cls = mm.MiniMaxM3SparseForConditionalGeneration if variant == "vl" else mm.MiniMaxM3VLForCausalLM
    model, info = cls.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    return model.eval(), info


@torch.no_grad()
def prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every position, ``[len(ids) - 1]``."""
    logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@torch.no_grad()
def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.generate(torch.tensor([ids], device=model.device), generation_config=cfg)[0, len(ids) :].tolist()
