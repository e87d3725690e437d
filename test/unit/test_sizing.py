"""Per-rank weight bytes from the config against the released tensor list, and how they shard."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import pytest
from sglang_m3.config import M3Config
from sglang_m3.sizing import GIB, decode_step_bytes, rank_weights, token_capacity

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASED = ROOT / "python/sglang_m3/assets/minimax-m3-config.json"
TENSORS = ROOT / "docs/minimax-m3-tensors.md"
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@pytest.fixture(scope="module")
def released() -> M3Config:
    return M3Config.from_hf(json.loads(RELEASED.read_text()))


def _expand(name: str, num_layers: int) -> int:
    """How many tensors a row of the table names: ``{a-b}`` ranges, ``{x,y}`` lists, ``N`` = every layer."""
    count = num_layers if ".N." in name else 1
    for group in re.findall(r"\{([^}]*)\}", name):
        if re.fullmatch(r"\d+-\d+", group):
            lo, hi = map(int, group.split("-"))
            count *= hi - lo + 1
        else:
            count *= len(group.split(","))
    return count


def released_text_bytes(num_layers: int) -> int:
    """Bytes of the language model's tensors in the released checkpoint, from docs/minimax-m3-tensors.md."""
    total = 0
    for line in TENSORS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("language_model."):
            continue
        shape = [int(x) for x in re.findall(r"\d+", cells[1])]
        total += _expand(cells[0], num_layers) * math.prod(shape) * DTYPE_BYTES[cells[2]]
    return total


def test_tp1_weights_match_the_released_tensor_list(released):
    expected = released_text_bytes(released.num_layers)
    assert expected > 790 * GIB  # the table was read (793.9 GiB of text weights)
    router = sum(released.moe_layers) * released.hidden_size * released.num_experts
    assert rank_weights(released, dtype_bytes=4).router == router * 4  # the released fp32 router
    got = rank_weights(released).total - router * 2  # a bf16 model splits it into 3 bf16 parts: 6 bytes, not 4
    assert abs(got - expected) / expected < 1e-4  # norm vectors are left out


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (8, 1), (8, 2), (8, 8)])
def test_ranks_together_hold_the_model_once_except_replicas(released, tp, ep):
    one, rank = rank_weights(released), rank_weights(released, tp, ep)
    for part in ("embed", "head", "dense_mlp", "shared_experts", "experts"):
        assert getattr(rank, part) * tp == getattr(one, part), part
    assert rank.router == one.router  # replicated on every rank
    # 4 KV heads: up to TP4 they split; at TP8 each lives on two ranks, so q splits 8-way and k/v 4-way
    kv = 2 * released.hidden_size * released.head_dim * released.num_layers * released.num_kv_heads * 2  # k, v; bf16
    assert rank.attention * tp == one.attention + (kv * (tp // 4 - 1) if tp > 4 else 0)


def test_fp8_halves_the_projections_only(released):
    bf16, fp8 = rank_weights(released, 4), rank_weights(released, 4, quantization="fp8")
    for part in ("attention", "indexer", "dense_mlp", "shared_experts", "experts"):
        assert getattr(fp8, part) * 2 == getattr(bf16, part), part
    for part in ("embed", "head", "router"):
        assert getattr(fp8, part) == getattr(bf16, part), part
    # an FP8 checkpoint's indexer is not quantised (only --quantization fp8 puts it in the qkv GEMM)
    checkpoint = rank_weights(released, 4, quantization="fp8", fp8_checkpoint=True)
    assert checkpoint.indexer == bf16.indexer
    assert checkpoint.total - checkpoint.indexer == fp8.total - fp8.indexer


def test_decode_step_reads_the_head_once_tied_or_not(released):
    """The floor's weights are all but the routed experts and the embedding (B rows only): a tied embedding
    is the head, read whole, so tying the same shapes moves the same bytes."""
    kv = {"dense_layer": 0, "sparse_layer": 0, "index_k": 0}
    tied = dataclasses.replace(released, tie_word_embeddings=True)
    untied_step = decode_step_bytes(released, 1, 8192, kv, rank_weights(released))
    tied_step = decode_step_bytes(tied, 1, 8192, kv, rank_weights(tied))
    assert rank_weights(tied).head == 0
    assert tied_step == untied_step


def test_token_capacity():
    assert token_capacity(100 * GIB, 0.9, 50 * GIB, 1 << 20) == 40 * 1024
    assert token_capacity(100 * GIB, 0.5, 60 * GIB, 1 << 20) == 0


def test_every_tensor_row_counted():
    rows = [line for line in TENSORS.read_text().splitlines() if line.startswith("| language_model.")]
    names = [r.split("|")[1].strip() for r in rows]
    assert len(names) == len(set(names)) == 19
    assert all(_expand(n, 60) >= 1 for n in names)
    assert _expand("language_model.model.layers.{3-59}.block_sparse_moe.experts.{0-127}.{w1,w3}.weight", 60) == (
        57 * 128 * 2
    )


def test_readme_capacity_table_is_what_the_cli_prints(capsys):
    from sglang_m3.cli import main

    assert main(["capacity"]) == 0
    table = capsys.readouterr().out.strip()
    assert table.count("\n") == 3 and "| TP8 bf16 | 99.7 GiB |" in table
    assert table in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_draft_shards_like_the_target(released, tp):
    """A 4-KV-head real-width draft (``scripts/bench_spec.py``'s) at TP: heads, MLP and head split; its
    KV heads replicated past TP4 (one per rank at TP8, as the target's); ``fc`` on every rank."""
    import runpy

    from sglang_m3.config import DraftConfig
    from sglang_m3.sizing import draft_weight_bytes

    bench = runpy.run_path(str(ROOT / "scripts" / "bench_spec.py"), run_name="bench_spec")
    draft = DraftConfig.from_dict(bench["real_width_draft_config"](json.loads(RELEASED.read_text())))
    one, rank = draft_weight_bytes(draft, own_embed=True), draft_weight_bytes(draft, own_embed=True, tp=tp)
    assert rank["fc"] == one["fc"] and rank["head"] * tp == one["head"] and rank["embed"] * tp == one["embed"]
    h, hd = draft.hidden_size, draft.head_dim
    kv_rank = max(draft.num_kv_heads // tp, 1)
    qkv_o = 2 * h * (draft.num_heads // tp + 2 * kv_rank) * hd + draft.num_heads // tp * hd * h
    assert rank["layer"] == (qkv_o + 3 * h * draft.intermediate_size // tp) * 2
