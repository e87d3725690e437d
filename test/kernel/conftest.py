"""Kernel-test set-up.

* Makes ``kernel/`` importable as ``sglang_m3_kernels`` when the package is not installed
  (a plain checkout), by loading it through importlib under that name.
* Triton's CPU interpreter is switched on by test/conftest.py (before Triton is imported).
  GPU parity tests carry ``@pytest.mark.gpu`` and are skipped there by test/conftest.py.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

if importlib.util.find_spec("sglang_m3_kernels") is None:
    _root = pathlib.Path(__file__).resolve().parents[2] / "kernel"
    _spec = importlib.util.spec_from_file_location(
        "sglang_m3_kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["sglang_m3_kernels"] = _mod
    _spec.loader.exec_module(_mod)
