"""Triton kernels for MiniMax-M3 sparse attention, each beside its PyTorch reference; no SGLang imports."""
