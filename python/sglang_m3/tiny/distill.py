"""Training of the tiny EAGLE3 draft (``draft.py`` builds, caches and measures it).

The same math as ``eagle3.draft_forward_ref``, batched over sequences and unrolled over draft
steps (EAGLE3's training-time test: step k feeds the draft's own pre-norm state from step k - 1),
on the target's soft next-token distributions for general text plus hard greedy labels for the
probe prompts' continuations, which the draft memorises. Deterministic for a given machine:
fixed seeds, fixed thread count (set by the caller), no data-order randomness outside ``seed``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import aux_capture_inputs
from .eagle3 import NUM_DRAFT_TOKENS, PREFIX, rms_norm, rope, tensor_shapes
from .prompts import probe_prompts, training_prompts
from .target import greedy_continue, load_target, target_states

TRAIN_STEPS = 250
GEN_LEN = 64  # greedy continuation of each training prompt
PROBE_GEN_LEN = 72  # memorised continuation of each probe prompt: tests generate <= 64, plus a last chain of 3
_BATCH = 32
_LR = 3e-3
_PROBE_WEIGHT = 1.0  # weight of the probe loss (hard greedy labels) next to the general loss (soft labels)
_STEP_WEIGHT = 0.8  # loss weight of unrolled step k is 0.8**k (EAGLE3)


def _init_draft(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            t = torch.ones(shape)  # norm weights
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        params[name] = t.requires_grad_()
    return params


def _train_forward(p, cfg, embed, ids, aux, targets, valid, steps: int, return_logits=False, rows=None):
    """Loss over ``steps`` unrolled draft steps (EAGLE3 training-time test).

    Row t (t = 0..T-2) is a chain based at position t: step 0 reads ``ids[t + 1]`` and ``fc(aux[t])``; step k
    sits at position t + k, reads ``ids[t + k + 1]`` and step k-1's carried state, and attends to step 0's keys at
    positions <= t plus its own chain's steps 1..k. Step k is scored by cross-entropy against ``targets``
    [B, T, draft_vocab] at position t + k + 1: the target's distribution over the draft vocab (soft labels carry
    far more signal than the argmax alone; the tiny target's distributions are flat), or one-hot greedy labels.
    ``rows`` [B, Q]: the chain bases computed per sequence (default all); step 0's keys cover every row anyway.
    """
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    n_h, n_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B, T = ids.shape
    R = T - 1
    every = torch.arange(R)
    rows = every.expand(B, R) if rows is None else rows  # [B, Q]
    Q, rep = rows.shape[1], n_h // n_kv
    seq = torch.arange(B)[:, None]
    causal = (every[None, None, :] <= rows[:, :, None])[:, None]  # [B, 1, Q (query base), R (step-0 key)]

    def norm_cat(e, h):
        return torch.cat(
            [
                rms_norm(e, p[PREFIX + "input_layernorm.weight"], eps),
                rms_norm(h, p[PREFIX + "hidden_norm.weight"], eps),
            ],
            -1,
        )

    def kv(x, pos):  # [B, n, hd] heads repeated to n_h, [B, n_h, n, hd]
        k = rope((x @ p[PREFIX + "self_attn.k_proj.weight"].T).view(B, -1, n_kv, hd), pos[..., None], theta)
        v = (x @ p[PREFIX + "self_attn.v_proj.weight"].T).view(B, -1, n_kv, hd)
        return k.transpose(1, 2).repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)

    h_all = aux[:, :R] @ p["fc.weight"].T
    x_all = norm_cat(embed[ids[:, 1:]], h_all)
    k0, v0 = kv(x_all, every.expand(B, R))  # step 0 over every row: what later rows attend to
    h = h_all[seq, rows]
    chain_k, chain_v = [], []
    loss, total = 0.0, 0.0
    all_logits = []
    for step in range(steps):
        idx = (rows + step + 1).clamp(max=T - 1)
        residual = h
        x = x_all[seq, rows] if step == 0 else norm_cat(embed[ids[seq, idx]], h)
        pos = rows + step
        q = rope((x @ p[PREFIX + "self_attn.q_proj.weight"].T).view(B, Q, n_h, hd), pos[..., None], theta)
        q = q.transpose(1, 2)  # [B, n_h, Q, hd]
        if step > 0:
            k, v = kv(x, pos)
            chain_k.append(k)
            chain_v.append(v)
        scores = (q @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, n_h, Q, R]
        diag = [(q * ck).sum(-1, keepdim=True) for ck in chain_k]  # [B, n_h, Q, 1] each
        probs = torch.softmax(torch.cat([scores, *diag], -1) / math.sqrt(hd), -1)
        out = probs[..., :R] @ v0
        for j, cv in enumerate(chain_v):
            out = out + probs[..., R + j : R + j + 1] * cv
        out = out.transpose(1, 2).reshape(B, Q, n_h * hd)
        residual = out @ p[PREFIX + "self_attn.o_proj.weight"].T + residual
        x = rms_norm(residual, p[PREFIX + "post_attention_layernorm.weight"], eps)
        mlp = (F.silu(x @ p[PREFIX + "mlp.gate_proj.weight"].T) * (x @ p[PREFIX + "mlp.up_proj.weight"].T)) @ p[
            PREFIX + "mlp.down_proj.weight"
        ].T
        h = mlp + residual
        logits = rms_norm(h, p["norm.weight"], eps) @ p["lm_head.weight"].T
        if return_logits:
            all_logits.append(logits)
            continue
        mask = valid[step][seq, rows]
        soft = targets[seq, idx][mask]
        ce = -(soft * F.log_softmax(logits[mask], -1)).sum()
        weight = _STEP_WEIGHT**step
        loss = loss + weight * ce
        total += weight * int(mask.sum())
    if return_logits:
        return all_logits
    return loss / max(total, 1.0)


def _step_validity(ids: torch.Tensor, greedy: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """valid[k][b, t]: chain at base t, step k has a label inside the sequence and a greedy-consistent input.

    Step k >= 1 reads ``ids[t + k + 1]`` as the token step k-1 drafted; that is right only where the sequence
    itself follows the target's greedy choice there (``ids[p + 1] == greedy[p]``), i.e. in generated text.
    """
    B, T = ids.shape
    follows = torch.zeros(B, T, dtype=torch.bool)
    follows[:, 1:] = ids[:, 1:] == greedy[:, :-1]
    t = torch.arange(T)
    valid, ok = [], torch.ones(B, T, dtype=torch.bool)
    for k in range(steps):
        in_range = (t + k + 1 <= T - 1)[None, :]
        if k >= 1:
            ok = ok & follows[:, (t + k + 1).clamp(max=T - 1)]
        valid.append(ok & in_range)
    return valid


def _probe_data(model, text, inputs, prompts, gen_len: int):
    """The target's greedy continuations of ``prompts`` (one at a time: lengths differ), right-padded to one length.

    Returns ``(ids [P, T], aux [P, T, 3H], greedy [P, T], valid, rows [P, gen_len])``: ``rows`` are the chain
    bases speculation uses, the last prompt position onwards; ``valid[k][p, t]``: step k's label is inside the
    sequence. Generated text follows the greedy choice, so every step's input is what the draft chained.
    """
    seqs = [greedy_continue(model, torch.tensor([prompt]), gen_len)[0] for prompt in prompts]
    P, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(P, T, dtype=torch.long)
    aux = torch.zeros(P, T, sum(1 for _ in inputs) * text.embed_tokens.weight.shape[1])
    greedy = torch.zeros(P, T, dtype=torch.long)
    t = torch.arange(T)
    valid = [torch.zeros(P, T, dtype=torch.bool) for _ in range(NUM_DRAFT_TOKENS)]
    for p, (prompt, seq) in enumerate(zip(prompts, seqs)):
        L = len(seq)
        layer_in, logits = target_states(model, text, seq[None])
        ids[p, :L], greedy[p, :L] = seq, logits[0].argmax(-1)
        aux[p, :L] = torch.cat([layer_in[i][0] for i in inputs], -1)
        for k in range(NUM_DRAFT_TOKENS):
            valid[k][p] = t + k + 1 <= L - 1
    rows = torch.stack([torch.arange(gen_len) + len(prompt) - 1 for prompt in prompts])
    return ids, aux, greedy, valid, rows


def distill(target_dir: Path, cfg: dict, seed: int, train_steps: int, num_sequences: int | None) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    model, text = load_target(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    inputs = aux_capture_inputs(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], len(text.layers))
    seqs = greedy_continue(model, training_prompts(tokenizer)[:num_sequences], GEN_LEN)
    layer_in, logits = target_states(model, text, seqs)
    greedy = logits.argmax(-1)
    aux = torch.cat([layer_in[i] for i in inputs], -1)  # [S, T, 3H], low..high
    embed = text.embed_tokens.weight.detach().float()
    p_ids, p_aux, p_greedy, p_valid, p_rows = _probe_data(model, text, inputs, probe_prompts(tokenizer), PROBE_GEN_LEN)

    # Draft vocab: every token the probes' scored chains must produce first, then the target's most frequent
    # greedy choices on the general data (ties to the lower id); sorted by target id.
    labels = p_greedy[torch.arange(len(p_rows))[:, None], p_rows + 1]
    must = torch.bincount(labels.flatten(), minlength=cfg["vocab_size"])
    counts = torch.bincount(greedy.flatten(), minlength=cfg["vocab_size"])
    order = sorted(range(cfg["vocab_size"]), key=lambda i: (-int(must[i] > 0), -int(counts[i]), i))
    hot = torch.tensor(sorted(order[: cfg["draft_vocab_size"]]))
    targets = torch.softmax(logits[..., hot], -1)  # the target's distribution renormalised over the draft vocab
    valid = _step_validity(seqs, greedy, NUM_DRAFT_TOKENS)
    # Probes: hard labels (the greedy token is what acceptance needs); a label outside the draft vocab is unscored.
    to_draft = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
    to_draft[hot] = torch.arange(len(hot))
    p_label = to_draft[p_greedy]
    p_targets = F.one_hot(p_label.clamp(min=0), len(hot)).float()
    T = p_ids.shape[1]
    t = torch.arange(T)
    p_valid = [v & (p_label[:, (t + k + 1).clamp(max=T - 1)] >= 0) for k, v in enumerate(p_valid)]

    params = _init_draft(tensor_shapes(cfg), seed)
    with torch.no_grad():  # start from the target's head (its Gemma final norm scales by 1 + w)
        head = model.get_output_embeddings().weight.float()[hot] * (1 + text.norm.weight.float())
        params["lm_head.weight"].copy_(head)
    opt = torch.optim.Adam(list(params.values()), lr=_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / train_steps)))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(train_steps):
        batch = torch.randperm(seqs.shape[0], generator=gen)[:_BATCH]
        loss = _train_forward(
            params, cfg, embed, seqs[batch], aux[batch], targets[batch], [v[batch] for v in valid], NUM_DRAFT_TOKENS
        )
        loss = loss + _PROBE_WEIGHT * _train_forward(
            params, cfg, embed, p_ids, p_aux, p_targets, p_valid, NUM_DRAFT_TOKENS, rows=p_rows
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    out = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in params.items()}
    out["d2t"] = hot - torch.arange(len(hot))  # SGLang: target id = draft id + d2t[draft id]
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    out["t2d"] = t2d
    return out
