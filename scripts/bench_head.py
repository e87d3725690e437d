"""Time M3's LM head at decode sizes: cuBLAS (what SGLang's logits processor runs) against our GEMV.

The head is 200,064 x 6144 bf16 (2.46 GB). For 1, 2 and 4 tokens it times ``torch.mm`` (cuBLAS) and
``sglang_m3_kernels.gemv`` as CUDA-graph replays of back-to-back calls over two copies of the weight
(each call reads its weight from HBM, not the L2), and states each as a ratio to the weight's bytes
over this GPU's device-to-device copy rate, measured in the same run as ``bench_scaled.py`` measures
the floors' (an eager 4 GiB copy; a memcpy node inside a CUDA graph copies ~20 % slower).
``--search`` also times every tile of ``TILES`` with and without programmatic dependent launch (what
chose ``DEFAULT_SETTINGS``).
Needs only torch, Triton and the package installed (``pip install -e .``); writes one JSON file::

    python3 scripts/bench_head.py --out benchmarks/head_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys

import torch

_spec = importlib.util.spec_from_file_location("bench_scaled", pathlib.Path(__file__).with_name("bench_scaled.py"))
scaled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaled)

# weight rows x k a program, warps, stages; rows x k <= 8192 (the fp32 accumulator would spill beyond)
TILES = [
    (bn, bk, w, st)
    for bn in (4, 8, 16, 32)
    for bk in (256, 512, 1024)
    for w in (4, 8)
    for st in (1, 2)
    if bn * bk <= 8192
]


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per replay of a CUDA graph of ``fn`` (after two eager warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--search", action="store_true", help="time every tile of TILES too")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import sglang_m3_kernels.gemv as G

    torch.manual_seed(0)
    rate = scaled.measure_hbm_tbps() * 1e12
    weights = [torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    floor_us = weights[0].numel() * 2 / rate * 1e6
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(m, args.vocab, device="cuda", dtype=torch.bfloat16) for _ in weights]
        ref = G.gemv_ref(x, weights[0]).float()

        def per_call(call) -> float:
            return graph_us(lambda: [call(w, o) for w, o in zip(weights, outs)]) / len(weights)

        def gemv_call(settings):
            G.gemv(x, weights[0], outs[0], settings=settings)
            err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2.0**-7:
                raise AssertionError(f"gemv {settings}: error {err:.2e} of the largest logit")
            return per_call(lambda w, o: G.gemv(x, w, o, settings=settings))

        row = {"tokens": m, "floor_us": round(floor_us, 1)}
        row["cublas_us"] = round(per_call(lambda w, o: torch.mm(x, w.t(), out=o)), 1)
        row["gemv_us"] = round(gemv_call(None), 1)
        row["gemv_settings"] = list(vars(G.DEFAULT_SETTINGS.get(m, G.GemvSettings())).values())
        if args.search:
            use_pdl, timed = G.use_pdl, []
            for tile in TILES:
                for pdl in (True, False):
                    G.use_pdl = lambda device, pdl=pdl: pdl and use_pdl(device)
                    timed.append((round(gemv_call(G.GemvSettings(*tile)), 1), list(tile), pdl))
            G.use_pdl = use_pdl
            row["search_best"] = sorted(timed)[:5]
        for key in ("cublas", "gemv"):
            row[f"{key}_x"] = round(row[f"{key}_us"] / floor_us, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    record = {
        "benchmark": "LM head at decode sizes: cuBLAS against sglang_m3_kernels.gemv",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 scripts/bench_head.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(),
        "copy_rate_tbps": round(rate / 1e12, 3),
        "shape": [args.vocab, args.hidden],
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
