"""Shared pytest set-up: the ``gpu`` marker skips without CUDA; repo paths for kernels."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
