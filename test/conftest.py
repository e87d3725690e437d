"""Shared pytest set-up: the ``gpu`` marker skips without CUDA; Triton's CPU interpreter.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, so the
kernel tests run the Triton code on CPU: Triton fixes interpreted vs compiled per function
at decoration time, its own library functions included. test/e2e removes the variable for
the SGLang processes it starts.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
