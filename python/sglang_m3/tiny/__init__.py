"""The embedded default: tiny, deterministic MiniMax-M3 checkpoints generated on demand.

``python -m sglang_m3.tiny build DIR [--name m3-tiny] [--variant vl|text]`` writes one;
``default_checkpoint(name, variant)`` builds it once into the cache and returns its path.

Modules, each importing only those listed before it:

* ``configs``, ``tokenizer``: the tiny shapes; the trained BPE tokenizer and chat template.
* ``build``: the target checkpoint (build, cache).
* ``fp8``: its block-FP8 copy (fp8 weights, ``weight_scale_inv``, ``quantization_config``; ``default_fp8_checkpoint``).
* ``eagle3``: the tiny EAGLE3 draft's format and slow reference forward.
* ``target``: the target in transformers (layer-input capture, greedy continuation).
* ``prompts``: the prompts the draft is trained, probed and measured on (the tests' probe prompts).
* ``distill``: the draft's training.
* ``draft``: build, cache and measure the draft (``default_draft``).
"""

from .build import build_checkpoint, default_checkpoint
from .configs import TINY_CONFIGS

__all__ = ["TINY_CONFIGS", "build_checkpoint", "default_checkpoint"]
