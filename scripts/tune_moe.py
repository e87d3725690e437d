#!/usr/bin/env python3
"""Tile configs of SGLang's Triton fused MoE for MiniMax-M3's routed experts, chosen by timing on this GPU.

SGLang 0.5.17 ships no config for M3's expert shape (128 experts, hidden 6144, intermediate 3072 at TP1:
``E=128,N=3072``), so its fused MoE runs a default tile config. This script times candidate configs with
SGLang's own kernel (``fused_experts`` under ``override_config``, M3's SwiGLU-OAI gate: alpha 1.702,
limit 7, gate / up not interleaved, routed scaling 2.0) on random weights and uniformly random top-4
routing, and writes the fastest per token count in SGLang's format and file name
(``python/sglang_m3/moe_configs/triton_<version>/E=..,N=..,device_name=...json``), which ``plugin.py`` hands
SGLang ahead of its own directory. A count this run does not time keeps the entry the file already has (an
earlier run's), else gets SGLang's default, so the file covers every count of ``DECODE_AND_PREFILL`` and a run
with a short ``--batches`` adds to a file instead of resetting it.

Candidates: the ``--candidates`` configs SGLang itself ships most often for Hopper (H100 / H200 / H800 /
H20 files of the same dtype), plus SGLang's default and the file's present entry for each token count (a
re-run never writes a slower tile than the file had). Each config is compiled and
timed at every ``--batches`` token count: ``--reps`` calls (fewer above 512 tokens) captured in one CUDA graph,
replayed ``--iters`` times, the median replay over the calls (graphs as decode runs them, no launch gaps).
Triton compiles each config once per specialisation (the kernel's integer arguments, which depend on the expert
count through SGLang's block alignment); ``--compile-jobs`` processes, as many as the GPU's free memory holds
the experts' weights for, compile them all first, in parallel, into Triton's on-disk cache, so the timing loop
starts on compiled kernels.

    python3 scripts/tune_moe.py                      # BF16 experts, TP1
    python3 scripts/tune_moe.py --dtype fp8_w8a8     # --quantization fp8 (per-tensor fp8 weights)
    python3 scripts/tune_moe.py --fused-shared       # --enforce-shared-experts-fusion: expert E = the shared one
    python3 scripts/tune_moe.py --install R.json     # the table of a report written elsewhere, into --out-dir
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# the token counts the benchmarks run first (decode batches, verify rows, an 8K prefill chunk), so a
# --deadline keeps the ones that matter most
DECODE_AND_PREFILL = "1,8,32,64,4,128,256,8192,2,16,24,48,96,512,1024,2048,4096"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="an M3 config.json (default: the released one)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp8_w8a8"), default="bf16")
    p.add_argument(
        "--fused-shared", action="store_true", help="the shared expert fused in as expert E (E + 1 experts, top-k + 1)"
    )
    p.add_argument("--batches", default=DECODE_AND_PREFILL, help="token counts M to tune for")
    p.add_argument("--candidates", type=int, default=40)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--deadline", type=float, default=None, help="seconds; token counts not reached by then stay untimed"
    )
    p.add_argument("--compile-jobs", type=int, default=min(8, os.cpu_count() or 1), help="processes compiling first")
    p.add_argument("--compile-only", default=None, metavar="I/N", help=argparse.SUPPRESS)  # internal: worker I of N
    p.add_argument("--out-dir", default=str(REPO / "python" / "sglang_m3" / "moe_configs"))
    p.add_argument("--report", default="bench_results/tune_moe.json")
    p.add_argument("--install", default=None, metavar="REPORT", help="write a report's table into --out-dir; no GPU")
    return p.parse_args(argv)


def expert_shape(cfg, tp_size: int, ep_size: int) -> tuple[int, int, int]:
    """(local experts E, intermediate per rank N, hidden K) of one rank's FusedMoE (``parallel.py``)."""
    return cfg.num_experts // ep_size, cfg.moe_intermediate_size // (tp_size // ep_size), cfg.hidden_size


def config_key(config: dict) -> tuple:
    """A config as a tuple over ``CONFIG_KEYS``; None where it leaves a key to Triton (SGLang's unquantised
    default names no ``num_warps`` / ``num_stages``)."""
    return tuple(config.get(k) for k in CONFIG_KEYS)


def as_config(key: tuple) -> dict:
    return {k: v for k, v in zip(CONFIG_KEYS, key) if v is not None}


def shipped_candidates(config_root: str, dtype: str | None, limit: int) -> list[dict]:
    """The ``limit`` configs that SGLang's Hopper files for ``dtype`` (None: unquantised) use most often."""
    count = collections.Counter()
    for path in glob.glob(os.path.join(config_root, "triton_*", "*.json")):
        name = os.path.basename(path)
        if not any(gpu in name for gpu in ("H100", "H200", "H800", "H20")) or "_down" in name:
            continue
        if "block_shape" in name or "per_channel" in name or ("dtype=" in name) != (dtype is not None):
            continue
        if dtype is not None and f"dtype={dtype}" not in name:
            continue
        for config in json.loads(pathlib.Path(path).read_text()).values():
            if all(k in config for k in CONFIG_KEYS):  # older files leave num_warps / num_stages out
                count[config_key(config)] += 1
    return [as_config(key) for key, _ in count.most_common(limit)]


def one_rank_groups() -> None:
    """SGLang's distributed state for one process (gloo, world size 1)."""
    import socket

    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    initialize_model_parallel(1)


def best_per_batch(timings: dict[int, dict[tuple, float]], untimed: dict[int, tuple]) -> dict[str, dict]:
    """SGLang's file format: ``{"M": config}`` with each token count's fastest config; a token count left
    untimed (``--deadline``, or not in ``--batches``) gets ``untimed[M]`` (the file's present entry, else
    SGLang's default), where SGLang's lookup would otherwise take the nearest tuned M's config."""
    return {
        str(m): as_config(min(timings[m], key=timings[m].get) if timings.get(m) else untimed[m])
        for m in sorted(untimed)
    }


def present_entries(path: pathlib.Path) -> dict[int, tuple]:
    """The configs a file already written for this shape holds, by token count (none without a file)."""
    if not path.exists():
        return {}
    return {int(m): config_key(config) for m, config in json.loads(path.read_text()).items()}


def token_counts(batches: list[int]) -> list[int]:
    """The token counts a config file covers: the timed ones and every count of ``DECODE_AND_PREFILL``.
    SGLang looks a batch up at the nearest count in the file, so a file of decode counts alone would hand
    an 8K prefill chunk the 128-token tile (an 8K prefill on such a file ran 1.7x stock's on the H200)."""
    return sorted(set(batches) | {int(m) for m in DECODE_AND_PREFILL.split(",")})


def publish_sglang_context() -> None:
    """SGLang's MoE code (its default configs too) reads its runtime settings from a published context:
    the defaults, for a stand-alone process (``--install`` runs on a machine without a GPU)."""
    import torch
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from sglang_m3.tiny import default_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(model_path=str(default_checkpoint("m3-tiny", "vl")), device=device)
    runtime_context.publish(args, role="tune_moe")


def sglang_defaults(shape: dict, counts: list[int]) -> dict[int, tuple]:
    """SGLang's default config at each token count for a report's ``shape`` (E, N, K, top_k, dtype)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sgl_configs

    dtype = shape["dtype"] if shape["dtype"] != "bf16" else None
    E, N, K, top_k = (shape[k] for k in ("E", "N", "K", "top_k"))
    return {m: config_key(sgl_configs.get_default_config(m, E, N, K, top_k, dtype, False)) for m in counts}


def install(report_path: str, out_dir: str) -> pathlib.Path:
    """The config file a tuning run wrote, rebuilt from its report (its name and ``table``), into ``out_dir``.
    A token count the run did not time (not in the report's ``per_batch``) keeps the entry the file in
    ``out_dir`` already has (the run, on another machine's copy of the tree, may not have seen it); counts
    that neither holds get SGLang's default."""
    report = json.loads(pathlib.Path(report_path).read_text())
    if "table" not in report:
        raise SystemExit(f"--install {report_path}: the report has no 'table' (written by an older tune_moe.py)")
    table = {int(m): config for m, config in report["table"].items()}
    out = pathlib.Path(out_dir) / pathlib.Path(report["file"]).parent.name / pathlib.Path(report["file"]).name
    timed = {int(m) for m in report.get("per_batch", table)}
    table |= {m: as_config(key) for m, key in present_entries(out).items() if m not in timed}
    missing = [m for m in token_counts(list(table)) if m not in table]
    if missing:
        if "shape" not in report:
            raise SystemExit(f"--install {report_path}: the table lacks token counts {missing}, the report a 'shape'")
        publish_sglang_context()
        table |= {m: as_config(key) for m, key in sglang_defaults(report["shape"], missing).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(m): table[m] for m in sorted(table)}, indent=1) + "\n")
    return out


def compile_in_parallel(args, argv, per_job: int) -> None:
    """``--compile-jobs`` copies of this run with ``--compile-only I/N`` (as many as the free GPU memory
    holds at ``per_job`` bytes each), each compiling its share of the configs into Triton's disk cache."""
    import torch

    tic = time.perf_counter()
    n = max(1, min(args.compile_jobs, torch.cuda.mem_get_info()[0] // per_job))
    worker = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--compile-only"]
    codes = [job.wait() for job in [subprocess.Popen([*worker, f"{i}/{n}"]) for i in range(n)]]
    print(f"compiled in {time.perf_counter() - tic:.0f} s by {n} processes, exit codes {codes}", flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.install:
        print(f"wrote {install(args.install, args.out_dir)}")
        return {}
    import torch
    import triton
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts, get_config_file_name, override_config
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sgl_configs
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang_m3.config import M3Config
    from sglang_m3.moe_configs import config_path

    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py times SGLang's Triton fused MoE: it needs a CUDA GPU")
    # SGLang's MoE code places its output through the TP group (symmetric-memory allocation): a one-rank
    # group, no communication.
    publish_sglang_context()
    one_rank_groups()
    path = pathlib.Path(args.config or REPO / "python" / "sglang_m3" / "assets" / "minimax-m3-config.json")
    cfg = M3Config.from_hf(json.loads(path.read_text()))
    E, N, K = expert_shape(cfg, args.tp_size, args.ep_size)
    shared = int(args.fused_shared)  # the fused shared expert: one more expert, chosen by every token
    if shared and args.ep_size != 1:
        raise SystemExit("--fused-shared: SGLang fuses the shared expert only without expert parallelism")
    E, top_k = E + shared, cfg.top_k + shared
    fp8 = args.dtype == "fp8_w8a8"
    config_dtype = args.dtype if fp8 else None  # SGLang's dtype selector of config files
    dev = torch.device("cuda")
    wdtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    tic = time.perf_counter()
    if args.compile_jobs > 1 and not args.compile_only:  # before this process takes its share of the memory
        compile_in_parallel(args, argv, per_job=3 * E * N * K * wdtype.itemsize + (4 << 30))
    torch.manual_seed(0)
    if args.compile_only:  # the values do not matter for compiling
        w1, w2 = torch.empty(E, 2 * N, K, device=dev, dtype=wdtype), torch.empty(E, K, N, device=dev, dtype=wdtype)
    else:
        w1 = (torch.randn(E, 2 * N, K, device=dev, dtype=torch.bfloat16) * 0.02).to(wdtype)
        w2 = (torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02).to(wdtype)
    quant = {}
    if fp8:  # per-tensor scale per expert, dynamic activation scales: what --quantization fp8 runs
        ones = torch.ones(E, device=dev, dtype=torch.float32)
        quant = dict(use_fp8_w8a8=True, w1_scale=ones, w2_scale=ones.clone())
    runner = MoeRunnerConfig(
        num_experts=cfg.num_experts + shared,
        num_local_experts=E,
        top_k=top_k,
        activation="silu",
        is_gated=True,
        inplace=False,
        routed_scaling_factor=cfg.routed_scaling_factor,
        gemm1_alpha=cfg.swiglu_alpha,
        gemm1_clamp_limit=cfg.swiglu_limit,
        gate_up_interleaved=False,
    )
    root = os.path.join(os.path.dirname(sgl_configs.__file__), "configs")
    candidates = [config_key(c) for c in shipped_candidates(root, config_dtype, args.candidates)]
    batches = [int(x) for x in args.batches.split(",") if x]
    timings: dict[int, dict[tuple, float]] = {}
    failed: dict[tuple, str] = {}
    # SGLang's default config at each M
    shape = dict(E=E, N=N, K=K, top_k=top_k, dtype=args.dtype, tp=args.tp_size, ep=args.ep_size)
    defaults = sglang_defaults(shape, token_counts(batches))
    out = config_path(get_config_file_name(E, N, config_dtype), triton.__version__, pathlib.Path(args.out_dir))
    untimed = defaults | present_entries(out)

    def routed(m: int):
        """``m`` random tokens and their routing: uniformly random top-k of all experts; another EP rank's experts
        are -1 (skipped), as FusedMoE gives them; the fused shared expert is every token's last."""
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(m, cfg.num_experts, device=dev).topk(cfg.top_k, dim=-1).indices
        ids = torch.where(ids < E - shared, ids, torch.full_like(ids, -1))
        if shared:
            ids = torch.cat((ids, torch.full_like(ids[:, :1], cfg.num_experts)), dim=1)
        return x, StandardTopKOutput(torch.rand(m, top_k, device=dev), ids.to(torch.int32), None)

    if args.compile_only:  # worker I of N: run its share of the configs once at every M, for Triton's cache
        i, n = (int(v) for v in args.compile_only.split("/"))
        mine = sorted(set(candidates) | set(defaults.values()) | set(untimed.values()), key=str)[i::n]
        for m in batches:
            x, topk = routed(m)
            for key in (k for k in mine if k in candidates or k in (defaults[m], untimed[m])):
                try:
                    with override_config(as_config(key)):
                        fused_experts(x, w1, w2, topk, runner, **quant)
                except Exception:  # noqa: BLE001 -- the timing loop records the failure
                    pass
        torch.cuda.synchronize()
        return {}
    out.parent.mkdir(parents=True, exist_ok=True)
    table = best_per_batch(timings, untimed)
    for m in batches:
        if args.deadline is not None and time.perf_counter() - tic > args.deadline:
            print(f"M={m}: past --deadline, the file's entry (else SGLang's default) kept", flush=True)
            continue
        x, topk = routed(m)
        timings[m] = {}
        reps = max(1, min(args.reps, args.reps * 512 // m))  # large prefill chunks: fewer calls per graph
        for key in candidates + [defaults[m], untimed[m]]:
            if key in failed or key in timings[m]:
                continue
            call = lambda: fused_experts(x, w1, w2, topk, runner, **quant)  # noqa: B023,E731
            try:
                with override_config(as_config(key)):
                    call()  # compile
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(reps):
                            call()
                times = []
                for _ in range(args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / reps)
                timings[m][key] = statistics.median(times)
                del graph
            except Exception as exc:  # noqa: BLE001 -- e.g. shared memory exceeded: the config is out
                failed[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not timings[m]:
            raise SystemExit(f"M={m}: no candidate config ran; first failures: {sorted(set(failed.values()))[:3]}")
        best, dflt = min(timings[m].values()), timings[m].get(defaults[m], float("nan"))
        at = time.perf_counter() - tic
        print(f"M={m}: best {best * 1e3:.1f} us, SGLang's default {dflt * 1e3:.1f} us ({at:.0f} s)", flush=True)
        table = best_per_batch(timings, untimed)
        out.write_text(json.dumps(table, indent=1) + "\n")  # after every M: a run cut short keeps what it timed
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        triton=triton.__version__,
        shape=shape,
        file=str(out),
        seconds=time.perf_counter() - tic,
        candidates=len(candidates),
        failed=len(failed),
        failures=sorted(set(failed.values()))[:5],
        per_batch={
            str(m): dict(
                best_us=min(t.values()) * 1e3, default_us=t.get(defaults[m], float("nan")) * 1e3, config=table[str(m)]
            )
            for m, t in timings.items()
        },
        untuned=[m for m in batches if m not in timings],
        table=table,  # the file's contents, so a report fetched without the file still carries them
    )
    pathlib.Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.report).write_text(json.dumps(report, indent=1))
    print(f"wrote {out} and {args.report}")
    return report


if __name__ == "__main__":
    main()
