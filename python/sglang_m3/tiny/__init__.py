"""The embedded default: tiny, deterministic MiniMax-M3 checkpoints generated on demand.

``python -m sglang_m3.tiny build DIR [--name m3-tiny] [--variant vl|text]`` writes one;
``default_checkpoint(name, variant)`` builds it once into the cache and returns its path.
"""

from .build import build_checkpoint, default_checkpoint
from .configs import TINY_CONFIGS

__all__ = ["TINY_CONFIGS", "build_checkpoint", "default_checkpoint"]
