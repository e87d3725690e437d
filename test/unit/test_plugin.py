"""The entry point is installed and takes the released M3 names away from SGLang's built-in code."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("m3") == "sglang_m3.plugin:register"


def test_register_is_idempotent_and_resolves_both_arch_names():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins import load_plugins
    from sglang_m3 import plugin
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM

    load_plugins()
    plugin.register()  # a second call changes nothing
    for arch in ("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM"):
        cls, resolved = ModelRegistry.resolve_model_cls([arch])
        assert resolved == arch and issubclass(cls, MiniMaxM3ForCausalLM)
        assert cls.__module__.startswith("sglang_m3.")
    assert "m3_msa" in ATTENTION_BACKENDS
