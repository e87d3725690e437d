"""Time M3's FP8 linears at a few tokens: SGLang's FP8 linear against our weight-only FP8 GEMV.

The layers are SGLang's own (``ReplicatedLinear`` with ``Fp8Config()``: the BF16 weight quantised row by
row at load, as ``--quantization fp8`` makes it), at the shapes of one real-width TP1 layer: the sparse
layers' fused q / k / v / index projection, the attention output, the dense MLP's and the shared
expert's gate-up and down. ``sglang`` is the layer's forward as SGLang ships it (per-token activation
quantisation + CUTLASS w8a8 GEMM); ``gemv`` the same layer with ``sglang_m3.quant.fp8_gemv_for_few_tokens``
applied (``sglang_m3_kernels.fp8_gemv``), and ``--sweep`` adds the GEMV's other tile shapes.

Each case is a CUDA graph that calls enough copies of the layer (distinct weights) back to back to read
>= 4x the L2; its replay time over the copies, the median of ``--repeats`` timed batches of replays, is
set beside the weight bytes over the device-copy rate measured in the same run (``vs_bytes``).

Usage (GPU host, SGLang importable)::

    python3 scripts/bench_fp8_gemv.py --tokens 1,4,8,16 --out benchmarks/fp8_gemv.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import socket
import statistics
import subprocess
import sys

import torch

HIDDEN, HEAD, HEADS, KV_HEADS, INDEX_HEADS = 6144, 128, 64, 4, 4
SHAPES = {  # name: (N, K) at TP1
    "qkv_index": ((HEADS + 2 * KV_HEADS + INDEX_HEADS + 1) * HEAD, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD),
    "dense_gate_up": (2 * 12288, HIDDEN),
    "dense_down": (HIDDEN, 12288),
    "shared_gate_up": (2 * 3072, HIDDEN),
    "shared_down": (HIDDEN, 3072),
}
SWEEP = [  # (block_n, block_k, num_warps, num_stages)
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (16, 1024, 4, 3),
    (16, 256, 2, 6),
    (32, 256, 4, 4),
    (32, 512, 8, 3),
    (64, 256, 8, 3),
]


def one_rank() -> None:
    """SGLang's distributed and model-parallel state for one rank (its linears ask for their TP group)."""
    from sglang.srt.distributed import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    parallel_state.initialize_model_parallel(1)


def fp8_layers(n: int, k: int, copies: int) -> list:
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    layers = []
    for _ in range(copies):
        with torch.device("cuda"), set_default_torch_dtype(torch.bfloat16):
            layer = ReplicatedLinear(k, n, bias=False, quant_config=Fp8Config(), prefix="proj")
        layer.weight.data.normal_(0, k**-0.5)
        layer.quant_method.process_weights_after_loading(layer)
        layers.append(layer)
    return layers


def time_graph(fn, repeats: int, replays: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of ``fn`` (warmed up first)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3 * replays):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def copy_tbps() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_graph(lambda: y.copy_(x), repeats=5, replays=5)
    return 2 * (1 << 31) / (ms / 1e3) / 1e12


def time_shape(name: str, token_counts: list[int], args, tbps: float, l2: int) -> list[dict]:
    from sglang_m3 import quant
    from sglang_m3_kernels.fp8_gemv import fp8_gemv

    n, k = SHAPES[name]
    copies = max(2, math.ceil(4 * l2 / (n * k)))
    layers = fp8_layers(n, k, copies)
    floor_ms = n * k / (tbps * 1e12 / 2) * 1e3  # the weight read once (the copy rate counts read + write)
    records = []

    def record(tokens: int, case: str, fn) -> None:
        ms = time_graph(fn, args.repeats) / copies
        records.append(dict(shape=name, n=n, k=k, tokens=tokens, case=case, us=ms * 1e3, vs_bytes=ms / floor_ms))
        print(json.dumps(records[-1]), flush=True)

    def gemv(x, bn, bk, warps, stages):
        for layer in layers:
            w, scale = layer.weight.t(), layer.weight_scale.reshape(-1)
            fp8_gemv(x, w, scale, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)

    inputs = {t: torch.randn(t, k, device="cuda", dtype=torch.bfloat16) for t in token_counts}
    for tokens, x in inputs.items():
        record(tokens, "sglang", lambda: [layer(x) for layer in layers])
        for cfg in SWEEP if args.sweep else []:
            record(tokens, "gemv_n{}_k{}_w{}_s{}".format(*cfg), lambda: gemv(x, *cfg))
    quant.fp8_gemv_for_few_tokens(torch.nn.ModuleList(layers))  # what the model does under --quantization fp8
    for tokens, x in inputs.items():
        record(tokens, "gemv", lambda: [layer(x) for layer in layers])
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,8,16", help="comma-separated token counts (each <= 16)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--sweep", action="store_true", help="also time the GEMV's other tile shapes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("fp8_gemv.json"))
    args = p.parse_args()
    one_rank()
    tbps = copy_tbps()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy rate {tbps:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
    records = []
    for name in args.shapes.split(","):
        records += time_shape(name, [int(t) for t in args.tokens.split(",")], args, tbps, l2)
        torch.cuda.empty_cache()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(
        json.dumps(
            dict(
                benchmark="fp8_gemv",
                command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                commit=commit,
                device_name=torch.cuda.get_device_name(),
                copy_tbps=tbps,
                records=records,
            ),
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
