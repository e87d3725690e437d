"""MiniMax-M3 text backbone for SGLang (model code only; no registries here)."""
