"""Kernel-test set-up.

* Makes ``kernel/`` importable as ``sglang_m3_kernels`` when the package is not installed
  (a plain checkout), by loading it through importlib under that name.
* Without CUDA, switches Triton to its CPU interpreter (``TRITON_INTERPRET=1``) before the
  kernels are imported, so the small interpreter tests can run the Triton code on CPU.
  GPU parity tests carry ``@pytest.mark.gpu`` and are skipped there by test/conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("sglang_m3_kernels") is None:
    _root = pathlib.Path(__file__).resolve().parents[2] / "kernel"
    _spec = importlib.util.spec_from_file_location(
        "sglang_m3_kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["sglang_m3_kernels"] = _mod
    _spec.loader.exec_module(_mod)

