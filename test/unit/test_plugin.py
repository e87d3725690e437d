"""The entry point is installed, takes the released M3 names away from SGLang's built-in code, and fails loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest


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


def test_every_hook_applied_and_cpu_hooks_only_without_cuda():
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_m3 import plugin, sglang_compat

    plugin.register()
    hooks = plugin._hooks()
    for target, hook, _ in hooks:
        assert sglang_compat.hook_in_place(target, hook, HookRegistry), target
    targets = {t for t, _, _ in hooks}
    cpu_targets = {
        sglang_compat.PAGED_ALLOC_EXTEND,
        sglang_compat.PAGED_ALLOC_DECODE,
        sglang_compat.GET_LAST_LOC,
        sglang_compat.ASSIGN_REQ_TO_TOKEN_POOL,
        sglang_compat.SUPPORT_TRITON,
        sglang_compat.SPEC_CPU_NO_OVERLAP,
        sglang_compat.RESOLVE_SPEC_EXTRAS,
    }
    if torch.cuda.is_available():
        assert not cpu_targets & targets
    else:
        assert cpu_targets <= targets


def test_a_hook_that_did_not_apply_stops_start_up():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_m3 import sglang_compat

    def hook(original, *args, **kwargs):
        return original(*args, **kwargs)

    bogus = "sglang.srt.no_such_module.no_such_function"
    with pytest.raises(SystemExit, match=r"hook\(s\) not applied on SGLang 0\.5\.17.*no_such_module\.no_such_function"):
        sglang_compat.check_hooks_applied([(bogus, hook, HookType.AROUND)], HookRegistry)
    # a real target that resolves, but patched with another function than ours, does not pass either
    target = "sglang.srt.utils.common.support_triton"
    with pytest.raises(SystemExit, match="support_triton"):
        sglang_compat.check_hooks_applied([(target, hook, HookType.AROUND)], HookRegistry)


def test_register_stops_when_a_hook_target_is_gone(monkeypatch):
    """Through register()'s own path: SGLang's HookRegistry logs the failure, register() stops the process."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_m3 import plugin

    def hook(original, *args, **kwargs):
        return original(*args, **kwargs)

    bogus = "sglang.srt.managers.scheduler.Scheduler.no_such_method"
    # a private copy of SGLang's registry so the bogus hook does not outlive the test
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list, {k: list(v) for k, v in HookRegistry._hooks.items()}))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_hooks", lambda: [(bogus, hook, HookType.AROUND)])
    with pytest.raises(SystemExit, match=r"Scheduler\.no_such_method"):
        plugin.register()


def test_register_turns_an_error_into_system_exit(monkeypatch):
    from sglang_m3 import plugin

    def broken():
        raise KeyError("attn_backend_wrapper")

    monkeypatch.setattr(plugin, "_hooks", broken)
    with pytest.raises(SystemExit, match=r"registration with SGLang failed: KeyError\('attn_backend_wrapper'\)"):
        plugin.register()


def test_version_mismatch_names_both_versions_and_the_escape_hatch():
    from sglang_m3.sglang_compat import ALLOW_VERSION_ENV, PINNED_SGLANG, check_sglang_version

    assert ALLOW_VERSION_ENV == "SGLANG_M3_ALLOW_SGLANG_VERSION" and PINNED_SGLANG == "0.5.17"
    check_sglang_version("0.5.17", {})
    with pytest.raises(SystemExit, match=r"SGLang 0\.5\.23 != 0\.5\.17.*SGLANG_M3_ALLOW_SGLANG_VERSION=1"):
        check_sglang_version("0.5.23", {})
    with pytest.raises(SystemExit, match=r"0\.5\.23 != 0\.5\.17"):
        check_sglang_version("0.5.23", {ALLOW_VERSION_ENV: "0"})
    check_sglang_version("0.5.23", {ALLOW_VERSION_ENV: "1"})  # at the user's risk
    with pytest.raises(SystemExit, match=r"SGLANG_M3_ALLOW_SGLANG_VERSION='yes': expected 0 or 1"):
        check_sglang_version("0.5.17", {ALLOW_VERSION_ENV: "yes"})


def test_register_checks_the_installed_version(monkeypatch):
    import sglang
    from sglang_m3 import plugin, sglang_compat

    monkeypatch.setattr(sglang, "__version__", "0.4.0")
    monkeypatch.delenv(sglang_compat.ALLOW_VERSION_ENV, raising=False)
    with pytest.raises(SystemExit, match=r"SGLang 0\.4\.0 != 0\.5\.17"):
        plugin.register()
    monkeypatch.setenv(sglang_compat.ALLOW_VERSION_ENV, "1")
    plugin.register()  # hooks are still checked, and they apply


def test_sglang_loader_does_not_swallow_the_stop(tmp_path):
    """SGLang's load_plugins() catches Exception around register(); SystemExit ends the process with our message."""
    probe = "import sglang; sglang.__version__ = '0.4.0'\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\n"
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_M3_ALLOW_SGLANG_VERSION", "SGLANG_PLUGINS")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "sglang-m3: installed SGLang 0.4.0 != 0.5.17" in out.stderr


def test_out_of_vocabulary_ids_are_refused_naming_the_first():
    from sglang_m3.admission import check_input_ids

    check_input_ids([0, 5, 511], 512)
    check_input_ids(None, 512)  # input_embeds requests carry no ids
    with pytest.raises(ValueError, match=r"input_ids\[2\]=512: outside the model's vocabulary \[0, 512\)"):
        check_input_ids([3, 4, 512, 9000], 512)
    with pytest.raises(ValueError, match=r"input_ids\[1\]=-1: outside"):
        check_input_ids([3, -1], 512)
