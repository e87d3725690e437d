"""A tiny EAGLE3 draft for the tiny M3, distilled from the target's own greedy outputs, deterministically.

Format: SGLang's ``LlamaForCausalLMEagle3`` (one decoder layer whose q/k/v read ``cat(input_layernorm(embed),
hidden_norm(h))``, ``fc`` over three captured target hidden states, its own final norm and a ``draft_vocab_size``
lm_head with a ``d2t`` table). No ``embed_tokens``: the draft shares the target's embedding.

Captured layers (DESIGN section 7): ``eagle_aux_hidden_state_layer_ids`` names layer *outputs* ``l``; the
serving side captures them as the *inputs* of layers ``l + 1`` (``aux_capture_inputs``).

Everything here is plain torch + transformers: it runs before SGLang starts and never imports it.
``draft_forward_ref`` is the slow reference of what SGLang computes; ``chain_acceptance`` replays greedy
chain speculation (K drafts + 1 bonus per verify) with it.

The tiny target is random, so nothing a small draft learns transfers to new text (~1.05 tokens per verify on
held-out prompts). To exercise multi-token acceptance end to end, the draft also memorises the target's greedy
continuations of ``probe_prompts`` (the e2e tests' prompts and the acceptance bench's GSM8K head) from the
target's hidden states: all 3 drafts are accepted there.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import aux_capture_inputs

DRAFT_BUILD_VERSION = 2  # bump when the output of build_draft for a given (target, seed) changes
DRAFT_TARGETS = ("m3-tiny",)  # tiny targets with enough layers for TINY_AUX_LAYER_IDS
TINY_AUX_LAYER_IDS = (0, 1, 2)  # outputs of layers 0, 1, 2 == inputs of layers 1, 2, 3 of the 4-layer tiny M3
DRAFT_VOCAB_SIZE = 256
NUM_DRAFT_TOKENS = 3  # chain length the draft is trained and measured for
_THREADS = 2  # fixed intra-op thread count: same reduction order on every run of a machine
_PROMPT_LEN = 20
_GEN_LEN = 64
_HELD_OUT = 8  # the last problems of the corpus are never trained on
_TRAIN_STEPS = 250
_PROBE_GEN_LEN = 72  # memorised continuation of each probe prompt: tests generate <= 64, plus a last chain of 3
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
        "num_attention_heads": 4,
        # 2 KV heads, unlike the tiny target's 1: the draft layer's own geometry inside the target's pool.
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


# ---------------------------------------------------------------------------------------------------------------
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


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm, ``x / rms(x) * w`` (llama's; not Gemma's ``1 + w``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
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
                _rms_norm(e, w(PREFIX + "input_layernorm.weight"), eps),
                _rms_norm(h, w(PREFIX + "hidden_norm.weight"), eps),
            ]
        )
        pos = torch.as_tensor(positions[i])
        q = _rope((w(PREFIX + "self_attn.q_proj.weight") @ x).view(n_h, hd), pos, theta)
        k = _rope((w(PREFIX + "self_attn.k_proj.weight") @ x).view(n_kv, hd), pos, theta)
        v = (w(PREFIX + "self_attn.v_proj.weight") @ x).view(n_kv, hd)
        keys, values = torch.cat([keys, k[None]]), torch.cat([values, v[None]])
        heads = []
        for head in range(n_h):
            g = head // (n_h // n_kv)  # GQA: query head -> its KV head
            p = torch.softmax(keys[:, g] @ q[head] / math.sqrt(hd), dim=0)  # over every earlier row and this one
            heads.append(p @ values[:, g])
        residual = w(PREFIX + "self_attn.o_proj.weight") @ torch.cat(heads) + residual
        x = _rms_norm(residual, w(PREFIX + "post_attention_layernorm.weight"), eps)
        gate, up = w(PREFIX + "mlp.gate_proj.weight") @ x, w(PREFIX + "mlp.up_proj.weight") @ x
        residual = w(PREFIX + "mlp.down_proj.weight") @ (F.silu(gate) * up) + residual
        carried_rows.append(residual)
        logits_rows.append(w("lm_head.weight") @ _rms_norm(residual, w("norm.weight"), eps))
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


# ---------------------------------------------------------------------------------------------------------------
# Target side (transformers, fp32, CPU).


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


def _problems() -> list[tuple[str, str]]:
    """(question, answer) pairs of the GSM8K problems in the tokenizer corpus."""
    text = resources.files("sglang_m3").joinpath("assets/tokenizer_corpus.txt").read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    out = []
    for block in body.split("\n\n"):
        lines = [line for line in block.strip().splitlines() if line]
        if lines:
            out.append((lines[0], "\n".join(lines[1:])))
    return out


def chat_prompt(tokenizer, question: str | list[dict]) -> list[int]:
    """Token ids of a chat (one user turn, or a message list) with the generation prompt, as SGLang's
    ``/v1/tokenize`` renders it: the chat template to text, then encoded without extra special tokens."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------------------------------------------------------
# Probe prompts: the prompts the tests and the acceptance benchmark speculate on. The draft is trained on the
# target's greedy continuation of each (memorised: the tiny target is random, nothing else transfers).

# The first GSM8K *test* questions (openai/grade-school-math test.jsonl, lines 1-8), verbatim: the acceptance
# bench's default prompts. Kept here so a build needs no dataset (test_tiny_draft checks them against the file).
GSM8K_TEST_HEAD = (
    "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
    "How much in dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
    "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in repairs.  "
    "This increased the value of the house by 150%.  How much profit did he make?",
    "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does "
    "he run a week?",
    "Every day, Wendi feeds each of her chickens three cups of mixed chicken feed, containing seeds, mealworms and "
    "vegetables to help keep them healthy.  She gives the chickens their feed in three separate meals. In the "
    "morning, she gives her flock of chickens 15 cups of feed.  In the afternoon, she gives her chickens another "
    "25 cups of feed.  How many cups of feed does she need to give her chickens in the final meal of the day if "
    "the size of Wendi's flock is 20 chickens?",
    "Kylar went to the store to buy glasses for his new apartment. One glass costs $5, but every second glass "
    "costs only 60% of the price. Kylar wants to buy 16 glasses. How much does he need to pay for them?",
    "Toulouse has twice as many sheep as Charleston. Charleston has 4 times as many sheep as Seattle. How many "
    "sheep do Toulouse, Charleston, and Seattle have together if Seattle has 20 sheep?",
    "Carla is downloading a 200 GB file. Normally she can download 2 GB/minute, but 40% of the way through the "
    "download, Windows forces a restart to install updates, which takes 20 minutes. Then Carla has to restart "
    "the download from the beginning. How load does it take to download the file?",
)


def corpus_ids(tokenizer) -> list[int]:
    """The shipped tokenizer corpus as one token stream (the e2e tests' ``corpus_ids`` fixture)."""
    text = resources.files("sglang_m3").joinpath("assets/tokenizer_corpus.txt").read_text(encoding="utf-8")
    return tokenizer(text).input_ids


def corpus_prompts(ids: list[int]) -> list[list[int]]:
    """The e2e tests' prompts cut from :func:`corpus_ids`. Mixed lengths: below the sparse threshold
    (block 16 x top-4 = 64) and well past it."""
    return [ids[:9], ids[100:150], ids[300:500], ids[700:1017]]


def gsm8k_prompts(tokenizer, count: int = len(GSM8K_TEST_HEAD)) -> list[list[int]]:
    """The acceptance bench's default prompts: GSM8K test questions, zero-shot (``build_messages(q, [])``), chat
    template with the generation prompt and no ``chat_template_kwargs`` (the bench sends none by default)."""
    from ..bench.gsm8k import build_messages  # pure python, no sglang

    return [chat_prompt(tokenizer, build_messages(q, [])) for q in GSM8K_TEST_HEAD[:count]]


def probe_prompts(tokenizer) -> list[list[int]]:
    """Every prompt the draft memorises the target's continuation of: the e2e corpus prompts, then GSM8K."""
    return corpus_prompts(corpus_ids(tokenizer)) + gsm8k_prompts(tokenizer)


def held_out_prompts(tokenizer, count: int = 4) -> list[list[int]]:
    """Chat prompts from corpus problems the draft never trained on."""
    return [chat_prompt(tokenizer, q) for q, _ in _problems()[-_HELD_OUT:][:count]]


def _training_prompts(tokenizer) -> torch.Tensor:
    """[S, _PROMPT_LEN]: per training problem, the tail of its chat prompt and the head of its answer text."""
    rows = []
    for question, answer in _problems()[:-_HELD_OUT]:
        chat = chat_prompt(tokenizer, question)
        plain = tokenizer(answer).input_ids
        if len(chat) >= _PROMPT_LEN:
            rows.append(chat[-_PROMPT_LEN:])
        if len(plain) >= _PROMPT_LEN:
            rows.append(plain[:_PROMPT_LEN])
    return torch.tensor(rows)


@contextlib.contextmanager
def _fixed_threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


_README = """# Tiny EAGLE3 draft for the tiny MiniMax-M3 ({target})

Generated by `python -m sglang_m3.tiny build-draft` (sglang_m3.tiny.draft, build version {version}, seed {seed}).
SGLang `LlamaForCausalLMEagle3` format: one decoder layer (4 query / 2 KV heads x {head_dim}), `fc` over the
target's layer outputs {layer_ids} (captured as the inputs of layers {inputs}), draft vocab {draft_vocab} with
`d2t`/`t2d`, no embedding (shared with the target). Distilled on the target's own greedy continuations of
GSM8K-style prompts (fp32, CPU), {steps} Adam steps unrolled over {k} draft steps, and trained to memorise the
target's greedy continuations ({probe_len} tokens) of the probe prompts (`probe_prompts`: the e2e tests' corpus
prompts and the acceptance bench's first {gsm8k} zero-shot GSM8K test questions). Random-weight target: the
text is meaningless; the acceptance length is the signal, long chains on the probe prompts, ~1 elsewhere.
"""


def build_draft(out_dir, target_dir, seed: int = 0, train_steps: int = _TRAIN_STEPS, num_sequences=None) -> Path:
    """Distil a tiny EAGLE3 draft for the tiny M3 at ``target_dir``; write config.json, model.safetensors, README.

    ``train_steps`` / ``num_sequences`` (training prompts used, default all) exist for quick tests only.
    """
    from safetensors.torch import save_file

    target_dir, out = Path(target_dir), Path(out_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    cfg = draft_config(target_cfg)
    with _fixed_threads(_THREADS):
        from .distill import distill

        tensors = distill(target_dir, cfg, seed, train_steps, num_sequences)
    expected = tensor_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in tensors.items() if k in expected} == expected
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    layer_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    t = target_cfg.get("text_config", target_cfg)
    (out / "README.md").write_text(
        _README.format(
            target=target_dir.name,
            version=DRAFT_BUILD_VERSION,
            seed=seed,
            head_dim=cfg["head_dim"],
            layer_ids=layer_ids,
            inputs=list(aux_capture_inputs(layer_ids, t["num_hidden_layers"])),
            draft_vocab=cfg["draft_vocab_size"],
            steps=train_steps,
            k=NUM_DRAFT_TOKENS,
            probe_len=_PROBE_GEN_LEN,
            gsm8k=len(GSM8K_TEST_HEAD),
        )
    )
    return out


def default_draft(name: str = "m3-tiny") -> Path:
    """Path of the cached draft for ``default_checkpoint(name)``, building both on first use (atomic)."""
    from .build import BUILD_VERSION, cache_root, cached, default_checkpoint

    if name not in DRAFT_TARGETS:
        raise ValueError(f"no tiny draft for {name!r}; choose from {list(DRAFT_TARGETS)}")
    target = default_checkpoint(name, "vl")
    final = cache_root() / f"{name}-eagle3-t{BUILD_VERSION}-v{DRAFT_BUILD_VERSION}"
    return cached(final, lambda tmp: build_draft(tmp, target))


@dataclass
class Acceptance:
    length: float  # mean tokens committed per verify: accepted drafts + 1 bonus
    verifies: int


@torch.no_grad()
def measure_acceptance(draft_dir, target_dir, prompts=None, new_tokens: int = 48, layer_inputs=None) -> Acceptance:
    """Greedy chain speculation (``NUM_DRAFT_TOKENS`` drafts) on ``prompts`` (default: 4 held-out chat prompts).

    ``layer_inputs`` overrides which target layer inputs feed the draft (default: the draft config's, through
    ``aux_capture_inputs``); index N is the last layer's pre-norm output.
    """
    from transformers import AutoTokenizer

    with _fixed_threads(_THREADS):
        draft = load_draft(draft_dir)
        model, text = load_target(target_dir)
        if prompts is None:
            prompts = held_out_prompts(AutoTokenizer.from_pretrained(target_dir))
        if layer_inputs is None:
            ids = draft.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            layer_inputs = aux_capture_inputs(ids, len(text.layers))
        embed = text.embed_tokens.weight.float()
        committed = []
        for prompt in prompts:
            seq = greedy_continue(model, torch.tensor([prompt]), new_tokens + NUM_DRAFT_TOKENS)[0]
            layer_in, _ = target_states(model, text, seq[None])
            aux = torch.cat([layer_in[i][0] for i in layer_inputs], -1)
            committed += chain_acceptance(draft, embed, seq, aux, len(prompt))
    return Acceptance(sum(committed) / len(committed), len(committed))
