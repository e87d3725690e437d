"""Tile configs of SGLang's Triton fused MoE tuned for MiniMax-M3's routed experts.

SGLang 0.5.17 ships none for M3's expert shapes (``E=128,N=3072`` at TP1), so without these
its fused MoE runs a default config. ``scripts/tune_moe.py`` writes them on a GPU, in SGLang's
own format and file names (``triton_<version>/E=..,N=..,device_name=...json``);
``plugin.py``'s hook on SGLang's config lookup returns ours where one exists for the asked
shape, device and Triton version, and SGLang's otherwise. (SGLang's one knob,
``SGLANG_MOE_CONFIG_DIR``, replaces its whole directory, hiding the configs it ships for
every other model.)
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent


def config_path(file_name: str, triton_version: str, root: pathlib.Path | None = None) -> pathlib.Path:
    return (root or ROOT) / f"triton_{triton_version.replace('.', '_')}" / file_name


def lookup(file_name: str, triton_version: str, root: pathlib.Path | None = None) -> dict[int, dict] | None:
    """``{tokens: config}`` from our file for SGLang's ``file_name``, or None when we have none."""
    path = config_path(file_name, triton_version, root)
    if not path.is_file():
        return None
    return {int(m): config for m, config in json.loads(path.read_text()).items()}
