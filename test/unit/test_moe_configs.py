"""Fused-MoE tile configs tuned for M3 (``moe_configs/``, ``scripts/tune_moe.py``) reach SGLang's lookup
through the plugin's hook; shapes we have none for keep SGLang's choice."""

from __future__ import annotations

import json
import pathlib
import runpy

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TUNED = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}


@pytest.fixture
def sgl_configs(monkeypatch, tmp_path):
    """SGLang's config module with the plugin registered, on an 'H200', our configs in ``tmp_path``."""
    import triton
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sgl_configs
    from sglang.srt.server_args import ServerArgs
    from sglang_m3 import moe_configs, plugin
    from sglang_m3.tiny import default_checkpoint

    plugin.register()
    runtime_context.publish(ServerArgs(model_path=str(default_checkpoint("m3-tiny", "vl")), device="cpu"), role="test")
    monkeypatch.setattr(sgl_configs, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(moe_configs, "ROOT", tmp_path)
    plugin._moe_configs_for.cache_clear()
    path = moe_configs.config_path(sgl_configs.get_config_file_name(128, 3072, None), triton.__version__)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"1": TUNED, "64": dict(TUNED, BLOCK_SIZE_M=64)}))
    try:
        yield sgl_configs
    finally:
        plugin._moe_configs_for.cache_clear()
        runtime_context.reset_context()


def test_tuned_config_for_m3_shape_wins(sgl_configs):
    def pick(m):
        return sgl_configs.try_get_optimal_moe_config((128, 6144, 6144), (128, 6144, 3072), 4, None, m)

    assert pick(2) == TUNED and pick(50)["BLOCK_SIZE_M"] == 64  # nearest tuned token count, as SGLang picks


def test_per_channel_fp8_takes_the_per_tensor_files_tiles(sgl_configs):
    """Per-tensor FP8 experts run the runner's per-channel mode (``quant.per_token_moe_activations``):
    the lookup SGLang makes for it gets the ``dtype=fp8_w8a8`` file's tiles."""
    import triton
    from sglang_m3 import moe_configs

    fp8_tiles = dict(TUNED, BLOCK_SIZE_K=128)
    path = moe_configs.config_path(sgl_configs.get_config_file_name(128, 3072, "fp8_w8a8"), triton.__version__)
    path.write_text(json.dumps({"1": fp8_tiles}))

    def pick(per_channel):
        shapes = ((128, 6144, 6144), (128, 6144, 3072))
        return sgl_configs.try_get_optimal_moe_config(*shapes, 4, "fp8_w8a8", 1, per_channel_quant=per_channel)

    assert pick(True) == pick(False) == fp8_tiles


def test_other_shapes_keep_sglangs_choice(sgl_configs):
    got = sgl_configs.try_get_optimal_moe_config((128, 1024, 6144), (128, 6144, 512), 4, None, 2)
    assert got == sgl_configs.get_default_config(2, 128, 512, 6144, 4, None, False)


def test_tuner_candidates_and_table():
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sgl_configs
    from sglang_m3.config import M3Config

    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    root = pathlib.Path(sgl_configs.__file__).parent / "configs"
    for dtype in (None, "fp8_w8a8"):
        got = tune["shipped_candidates"](str(root), dtype, 12)
        assert len(got) == 12 and all(set(c) == set(tune["CONFIG_KEYS"]) for c in got)
    cfg = M3Config.from_hf(json.loads((REPO / "python/sglang_m3/assets/minimax-m3-config.json").read_text()))
    assert tune["expert_shape"](cfg, 1, 1) == (128, 3072, 6144)
    assert tune["expert_shape"](cfg, 8, 2) == (64, 768, 6144)
    slow, fast = (64, 64, 64, 1, 4, 3), (16, 32, 64, 1, 4, 3)
    # SGLang's unquantised default leaves num_warps / num_stages to Triton: written without them
    default = tune["config_key"]({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1})
    assert tune["best_per_batch"]({8: {slow: 2.0, fast: 1.0}}, {8: default}) == {"8": TUNED}
    assert tune["best_per_batch"]({1: {default: 1.0, slow: 2.0}}, {1: default}) == {"1": tune["as_config"](default)}
    assert tune["as_config"](default) == {k: TUNED[k] for k in list(TUNED)[:4]}
    # a token count --deadline left untimed keeps SGLang's default rather than the nearest tuned M's config
    assert tune["best_per_batch"]({8: {slow: 2.0, fast: 1.0}}, {8: default, 4096: slow}) == {
        "8": TUNED,
        "4096": tune["as_config"](slow),
    }


def test_untimed_counts_keep_the_files_entries(tmp_path):
    """A re-run with a short --batches (say 256 verify rows) adds to the file: the counts it leaves untimed keep
    the file's entries, counts the file lacks get SGLang's default."""
    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    slow, fast, default = (64, 64, 32, 8, None, None), (16, 32, 64, 1, 4, 3), (128, 128, 64, 1, 4, 3)
    path = tmp_path / "E=128,N=3072,device_name=NVIDIA_H200.json"
    assert tune["present_entries"](path) == {}
    path.write_text(json.dumps({"1": TUNED, "256": tune["as_config"](slow)}))
    present = tune["present_entries"](path)
    assert present == {1: tune["config_key"](TUNED), 256: slow}
    untimed = {1: default, 256: default, 8192: default} | present
    table = tune["best_per_batch"]({256: {fast: 1.0, slow: 2.0}}, untimed)
    assert table == {"1": TUNED, "256": TUNED, "8192": tune["as_config"](default)}


def test_install_rebuilds_the_file_from_a_report(tmp_path):
    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    name = "E=128,N=3072,device_name=NVIDIA_H200.json"
    counts = tune["token_counts"]([])
    table = {str(m): TUNED if m < 64 else {k: TUNED[k] for k in list(TUNED)[:4]} for m in counts}
    report = tmp_path / "report.json"
    report.write_text(json.dumps(dict(file=f"/elsewhere/moe_configs/triton_3_6_0/{name}", table=table)))
    out = tune["install"](str(report), str(tmp_path / "configs"))
    assert out == tmp_path / "configs" / "triton_3_6_0" / name and json.loads(out.read_text()) == table
    report.write_text(json.dumps(dict(file=name)))
    with pytest.raises(SystemExit, match="has no 'table'"):
        tune["install"](str(report), str(tmp_path / "configs"))
    report.write_text(json.dumps(dict(file=name, table={"1": TUNED})))
    with pytest.raises(SystemExit, match="lacks token counts"):
        tune["install"](str(report), str(tmp_path / "configs"))


def test_install_gives_untimed_token_counts_sglangs_default(tmp_path):
    """A run of decode counts alone: the prefill counts get SGLang's default, not the nearest decode tile."""
    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    name = "E=128,N=3072,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
    shape = dict(E=128, N=3072, K=6144, top_k=4, dtype="fp8_w8a8", tp=1, ep=1)
    report = tmp_path / "report.json"
    report.write_text(json.dumps(dict(file=name, shape=shape, table={"1": TUNED, "8": TUNED})))
    got = json.loads(tune["install"](str(report), str(tmp_path / "configs")).read_text())
    assert [int(m) for m in got] == tune["token_counts"]([1, 8]) and got["1"] == got["8"] == TUNED
    defaults = tune["sglang_defaults"](shape, [8192, 256])
    assert got["8192"] == tune["as_config"](defaults[8192]) and got["256"] == tune["as_config"](defaults[256])
    assert got["8192"]["BLOCK_SIZE_M"] > TUNED["BLOCK_SIZE_M"]  # a prefill tile, not the decode one


def test_install_keeps_the_files_entries_for_untimed_counts(tmp_path):
    """Two runs elsewhere, each timing some counts, installed one after the other: both runs' timings stay."""
    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    name = "E=128,N=3072,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json"
    counts = tune["token_counts"]([])
    other = {k: TUNED[k] for k in list(TUNED)[:4]}
    first = {str(m): TUNED if m in (1, 8) else other for m in counts}
    second = {str(m): TUNED if m in (32, 64) else other for m in counts}
    report = tmp_path / "report.json"
    for table, timed in ((first, ("1", "8")), (second, ("32", "64"))):
        report.write_text(json.dumps(dict(file=name, table=table, per_batch={m: {} for m in timed})))
        got = json.loads(tune["install"](str(report), str(tmp_path / "configs")).read_text())
    assert {m for m, config in got.items() if config == TUNED} == {"1", "8", "32", "64"}
    assert got["8192"] == other


def test_committed_configs_cover_the_tuned_token_counts():
    """Every committed file: SGLang's format, every token count the tuner runs, complete configs."""
    from sglang_m3 import moe_configs

    tune = runpy.run_path(str(REPO / "scripts" / "tune_moe.py"), run_name="tune_moe")
    files = sorted(moe_configs.ROOT.glob("triton_*/E=*.json"))
    assert files, "no tuned config committed"
    counts = sorted(int(m) for m in tune["DECODE_AND_PREFILL"].split(","))
    for path in files:
        table = json.loads(path.read_text())
        assert sorted(int(m) for m in table) == counts, path.name
        for config in table.values():
            assert set(tune["CONFIG_KEYS"][:4]) <= set(config) <= set(tune["CONFIG_KEYS"]), path.name
            assert all(isinstance(v, int) and v > 0 for v in config.values()), path.name
