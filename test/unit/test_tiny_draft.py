"""The tiny EAGLE3 draft: deterministic build, SGLang-loadable names and config, captured-layer convention.

The tiny M3 has random weights: its greedy next token is nearly context-chaotic (top-1 probability ~2.6%,
the current token alone predicts it ~11% of the time), so a 1-layer draft accepts few tokens on new text. It
memorises the target's continuations of the probe prompts (the e2e tests' and the acceptance bench's) instead.
The acceptance bounds below are what this recipe reaches deterministically (fixed seeds and thread count).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from sglang_m3.tiny import default_checkpoint
from sglang_m3.tiny import draft as D
from sglang_m3.tiny import eagle3 as E
from sglang_m3.tiny import prompts as P
from sglang_m3.tiny import target as T
from sglang_m3.tiny.distill import _train_forward

RELEASED_CONFIG = Path(__file__).resolve().parents[2] / "python" / "sglang_m3" / "assets" / "minimax-m3-config.json"
# Mean tokens per verify (3 drafts + 1 bonus, max 4), build version 2. Measured: corpus probes 4.0 (4 prompts),
# GSM8K probes 4.0 (8 prompts), held-out 1.043; captures shifted by one layer 1.25 / 1.48 on the GSM8K probes.
CORPUS_MIN = GSM8K_MIN = 3.5
HELD_OUT_MIN = 1.02
SHIFT_MARGIN = 1.5  # a wrong capture falls at least this far below the right one


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def target():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="module")
def draft():
    return D.default_draft("m3-tiny")


def test_build_is_deterministic(tmp_path, target):
    # Short recipe (same data path and trainer, fewer prompts and steps) so two builds stay cheap.
    a = D.build_draft(tmp_path / "a", target, train_steps=5, num_sequences=16)
    b = D.build_draft(tmp_path / "b", target, train_steps=5, num_sequences=16)
    assert _digest(a) == _digest(b)


def test_config_is_an_sglang_eagle3_llama_config(draft):
    from transformers import LlamaConfig

    raw = json.loads((draft / "config.json").read_text())
    cfg = LlamaConfig.from_pretrained(draft)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (1, 64, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 128)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.tie_word_embeddings) == (512, 256, False)
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.max_position_embeddings == 8192
    assert getattr(cfg, "partial_rotary_factor", 1) == 1  # full RoPE (SGLang's LlamaAttention default)
    assert cfg.eagle_config == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    with safe_open(draft / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {k: v for k, v in shapes.items() if k not in ("d2t", "t2d")} == E.tensor_shapes(raw)
    assert not any("embed_tokens" in k for k in shapes)  # shared with the target
    hot = d2t + torch.arange(256)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.sum() == 256
    assert bool((hot[1:] > hot[:-1]).all()) and bool(t2d[hot].all())


def test_sglang_load_weights_maps_every_tensor(draft):
    """Run SGLang's own LlamaForCausalLMEagle3.load_weights on a stand-in that only records loads."""
    eagle3 = pytest.importorskip("sglang.srt.models.llama_eagle3")
    hidden, q, kv, inter = 64, 128, 64, 128
    params = {  # LlamaForCausalLMEagle3's parameters for this config (embed_tokens comes from the target)
        "model.embed_tokens.weight": (512, hidden),
        "model.fc.weight": (hidden, 3 * hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (256, hidden),
        "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, q),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, inter),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.hidden_norm.weight": (hidden,),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
    }
    loaded = []

    class Param:
        def __init__(self, name):
            self.name = name

        def weight_loader(self, param, weight, shard=None):
            loaded.append((self.name, shard, tuple(weight.shape)))

    class StandIn:
        def named_parameters(self):
            return [(n, Param(n)) for n in params]

    stand_in = StandIn()
    with safe_open(draft / "model.safetensors", "pt") as f:
        weights = [(k, f.get_tensor(k)) for k in f.keys()]
    eagle3.LlamaForCausalLMEagle3.load_weights(stand_in, weights)
    assert stand_in.hot_token_id.shape == (256,)
    sharded = {(n, s) for n, s, _ in loaded}
    assert {("model.layers.0.self_attn.qkv_proj.weight", s) for s in "qkv"} <= sharded
    assert {("model.layers.0.mlp.gate_up_proj.weight", s) for s in (0, 1)} <= sharded
    assert {n for n, _, _ in loaded} == set(params) - {"model.embed_tokens.weight"}
    assert len(loaded) == len(weights) - 2  # every tensor but d2t / t2d went to a parameter


def test_reference_matches_training_forward(draft, target):
    """draft_forward_ref (row by row, cached) and the batched training forward agree on a draft extend."""
    d = E.load_draft(draft)
    model, text = T.load_target(target)
    ids = T.greedy_continue(model, torch.tensor([list(range(40, 60))]), 12)
    layer_in, _ = T.target_states(model, text, ids)
    aux = torch.cat([layer_in[i] for i in (1, 2, 3)], -1)
    embed = text.embed_tokens.weight.float()
    logits_ref, carried, _, cache = E.draft_forward_ref(d, embed, ids[0, 1:], aux[0, :-1], torch.arange(31))
    params = {k: v for k, v in d.tensors.items() if k not in ("d2t", "t2d")}
    valid = [torch.ones(1, 32, dtype=torch.bool)]
    (logits_train,) = _train_forward(params, d.config, embed, ids, aux, None, valid, 1, return_logits=True)
    torch.testing.assert_close(logits_train[0], logits_ref, rtol=1e-4, atol=1e-4)
    # A decode step on a cache prefix equals the extend row at that position when fed the same inputs.
    prefix = (cache[0][:10], cache[1][:10])
    step, *_ = E.draft_forward_ref(d, embed, ids[0, 11:12], aux[0, 10:11], [10], prefix)
    torch.testing.assert_close(step[0], logits_ref[10], rtol=1e-5, atol=1e-5)


def test_probe_prompts_are_the_tests_and_the_benchs(target):
    """The memorised prompts: the e2e corpus prompts and the acceptance bench's zero-shot GSM8K renderings."""
    from sglang_m3.bench.client import BenchError
    from sglang_m3.bench.datasets import load_gsm8k
    from sglang_m3.bench.gsm8k import build_messages
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    ids = P.corpus_ids(tok)
    lengths = [len(p) for p in P.corpus_prompts(ids)]
    assert P.probe_prompts(tok)[:4] == P.corpus_prompts(ids) and lengths == [9, 50, 200, 317]
    gsm = P.gsm8k_prompts(tok)
    assert P.probe_prompts(tok)[4:] == gsm and len(gsm) == 8
    # What SGLang's /v1/tokenize returns for the bench's messages: template text, encoded without added specials.
    text = tok.apply_chat_template(build_messages(P.GSM8K_TEST_HEAD[0], []), add_generation_prompt=True, tokenize=False)
    assert gsm[0] == tok.encode(text) and text.endswith("<|im_start|>assistant\n")
    try:
        test = load_gsm8k(None, "test")
    except BenchError:
        pytest.skip("no GSM8K test split here")
    assert P.GSM8K_TEST_HEAD == tuple(r["question"] for r in test[: len(P.GSM8K_TEST_HEAD)])


def test_acceptance_and_captured_layer_convention(draft, target):
    """3 greedy drafts per verify: the memorised probe prompts accept long chains, held-out prompts stay sane,
    and the right captured layers clearly beat both off-by-one captures."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    corpus = D.measure_acceptance(draft, target, P.corpus_prompts(P.corpus_ids(tok)))
    gsm8k = D.measure_acceptance(draft, target, P.gsm8k_prompts(tok))
    held_out = D.measure_acceptance(draft, target)
    missing_plus_one = D.measure_acceptance(draft, target, P.gsm8k_prompts(tok), layer_inputs=(0, 1, 2))
    double_plus_one = D.measure_acceptance(draft, target, P.gsm8k_prompts(tok), layer_inputs=(2, 3, 4))
    assert corpus.length >= CORPUS_MIN, corpus
    assert gsm8k.length >= GSM8K_MIN, gsm8k
    assert held_out.length >= HELD_OUT_MIN, held_out
    for shifted in (missing_plus_one, double_plus_one):  # ids taken as inputs / ids [1, 2, 3] as outputs
        assert shifted.length <= gsm8k.length - SHIFT_MARGIN, (gsm8k, shifted)


def test_gqa_pair_accepts_long_chains_on_the_corpus_probes():
    """``m3-tiny-gqa``'s draft (8 query heads, for the TP8 tests) memorises its target's continuations of
    the e2e prompts too, so ``test_tensor_parallel``'s EAGLE3 runs accept several drafts a verify.
    Measured: 4.0 (build version 2)."""
    from transformers import AutoTokenizer

    target, draft = default_checkpoint("m3-tiny-gqa", "vl"), D.default_draft("m3-tiny-gqa")
    assert json.loads((draft / "config.json").read_text())["num_attention_heads"] == 8
    corpus = P.corpus_prompts(P.corpus_ids(AutoTokenizer.from_pretrained(target)))
    acceptance = D.measure_acceptance(draft, target, corpus)
    assert acceptance.length >= CORPUS_MIN, acceptance
