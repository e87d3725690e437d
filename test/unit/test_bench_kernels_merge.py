"""``scripts/bench_kernels.py --merge``: one call's ours-only and upstream-only passes joined into one table."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rec(kernel, batch, ours, up, note=""):
    return dict(kernel=kernel, dtype="bf16", batch=batch, context=8192, ours_us=ours, upstream_us=up, floor_us=0.7,
                ours_over_floor=None, speedup_vs_upstream=None, note=note)  # fmt: skip


def test_merge_fills_upstream_times_and_ratios(tmp_path):
    ours = [_rec("decode", 1, 10.0, None), _rec("verify", 1, 12.0, None), _rec("decode", 8, 20.0, None)]
    up = [_rec("decode", 1, None, 21.0), _rec("verify", 1, None, None), _rec("decode", 64, None, 90.0, "x")]
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    (tmp_path / "up.json").write_text(json.dumps(up))
    argv = [sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--out", str(tmp_path / "m"), "--merge"]
    subprocess.run([*argv, str(tmp_path / "ours.json"), str(tmp_path / "up.json")], check=True, timeout=120)
    got = {(r["kernel"], r["batch"]): r for r in json.loads((tmp_path / "m" / "kernels.json").read_text())}
    assert set(got) == {("decode", 1), ("verify", 1), ("decode", 8)}  # ours' cases only
    assert (got["decode", 1]["upstream_us"], got["decode", 1]["speedup_vs_upstream"]) == (21.0, 2.1)
    assert got["verify", 1]["upstream_us"] is None and got["decode", 8]["upstream_us"] is None
    assert "| decode | bf16 | 1 | 8192 | 10.0 | 21.0 |" in (tmp_path / "m" / "kernels.md").read_text()
