#!/usr/bin/env python3
"""A real-width M3 on one GPU or a TP / EP group: sglang-m3 beside stock SGLang's own M3 path, in one run.

The released config.json cut to ``--dense-layers`` dense + ``--sparse-layers`` sparse MoE layers
(full width: hidden 6144, 64 q / 4 KV heads, 128 experts, vocabulary 200,064), ``--load-format
dummy``, ``--tp-size`` / ``--ep-size`` (1; floors are per rank), CUDA graphs; ``--fill 0.7`` takes
instead as many sparse layers as keep a rank's weights within 70 % of the GPU's memory (the multi-GPU
run's cut). Each implementation is its own process (``--impls``):

* ``ours``: sglang-m3 (the installed plugin);
* ``stock``: SGLang 0.5.17's own M3 path, as DESIGN section 9 says it runs on the H200 with the
  offline kit: ``attention_backend="triton"``, ``enable_multimodal=False``, and the plugin kept
  out with ``SGLANG_PLUGINS=<a name that matches nothing>``; its prefill graphs are captured only
  at the chunk sizes the measured prompts run (``--prefill-lens`` in ``PREFILL_CHUNK``-token chunks:
  8192 for an 8K or a 32K prompt), not at SGLang's ~60 default sizes, which took 407 s of start-up;
* ``ours:fp8`` / ``stock:fp8``: the same with ``--quantization fp8``;
* a ``+fused-shared`` suffix (``ours+fused-shared``): with ``--enforce-shared-experts-fusion``
  (the shared expert as FusedMoE's expert E instead of its own MLP);
* ``ours+one-stream``: the separate shared expert on the main stream (``SGLANG_M3_SHARED_EXPERT_STREAM=0``)
  instead of a side stream beside the routed experts;
* ``stock+tuned-moe``: stock with sglang-m3's tuned fused-MoE configs (``python/sglang_m3/moe_configs``)
  through ``SGLANG_MOE_CONFIG_DIR``, so that a comparison does not credit the plugin with tiles stock
  could use as well (SGLang ships none for M3's expert shapes).

Measured per implementation: decode TPOT at every ``--batches`` with ``--input-len`` prompts and
at ``--long-batches`` with ``--long-len`` prompts (streamed; the time per step while every request
of the batch is decoding, the batch admitted together: ``admit_together``), prefill latency of one
prompt per ``--prefill-lens``, each the median (low) of ``--repeats`` rounds (all kept in ``ms_repeats``: on a
shared machine one round can stand apart, as the first batch-1 row after start-up did on an H200), and,
at ``--profile-batches``, a torch-profiler trace of decode steps reduced to time per component.
Beside every TPOT: its HBM floor (``sglang_m3.sizing.decode_step_bytes`` over ``--hbm-tbps``, by default
this GPU's device-to-device copy bandwidth measured in the same run: ~4.3 TB/s on an H200, ~3.0 on an H100).

Routing (``--routing``): ``model`` keeps what the dummy weights' router picks, which is not random (the
rows of a batch share experts: at batch 32 and 64 both implementations ran under the floor, which counts
random routing's experts); ``uniform`` sets SGLang's benchmark switch ``SGLANG_SIMULATE_UNIFORM_EXPERTS``
in every engine, so that SGLang's ``TopK`` (which ours and stock's CUDA MoE both run) gives each token 4
experts at a random offset, 32 apart: each expert is missed by a token with probability 31/32, as under
random top-4 routing, so a batch touches the floor's expected expert count. CUDA half-precision models
only (fp32 and CPU models route in torch).

    python3 scripts/bench_scaled.py --out benchmarks/e2e_scaled.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import datetime
import gzip
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from sglang_m3.bench.stats import timed_rounds

RELEASED = pathlib.Path(__file__).resolve().parents[1] / "python/sglang_m3/assets/minimax-m3-config.json"
PREFILL_CHUNK = 8192  # SGLang's chunked_prefill_size on an H200, set explicitly for both implementations
NO_PLUGIN = "sglang-m3-kept-out"  # SGLANG_PLUGINS value that matches no installed plugin
UNIFORM_ROUTING_ENV = "SGLANG_SIMULATE_UNIFORM_EXPERTS"  # SGLang 0.5.17's benchmark-only TopK override
SIDE_STREAM_ENV = "SGLANG_M3_SHARED_EXPERT_STREAM"  # sglang_m3.model.mlp's (importing it would load SGLang)
# Start-up lines kept per impl: weights and KV per rank, token capacity, which fused-MoE configs ran
STARTUP_MARKS = ("sglang-m3 per rank", "Load weight end", "max_total_num_tokens", "MoE kernel config", "tuned for M3")
IMPL_FLAGS = {("fused-shared", False), ("one-stream", False), ("tuned-moe", True)}  # (flag, on stock)
# Kernel-name patterns -> component of a decode step (first match wins). torch's own gathers
# (``at::native::index_elementwise_kernel``, ``indexSelectSmallIndex``) are "other", not the MSA indexer.
TORCH_GATHERS = ("at::native::index", "at::native::(anonymous namespace)::indexselect")
COMPONENTS = (
    ("moe", ("fused_moe", "moe_", "topk_sigmoid", "align_block", "moe_sum", "_moe", "expert")),
    ("indexer", ("index", "topk", "select", "score")),
    ("norm", ("norm",)),  # before attention: flashinfer's norm kernels are named flashinfer::norm::...
    # "_fwd_": SGLang's Triton decode attention (_fwd_grouped_kernel_stage1, _fwd_kernel_stage2), stock's dense layers
    ("attention", ("attn", "attention", "msa", "decode_", "_fwd_", "merge", "flash", "kv_store", "store_kv")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "matmul", "splitk", "gemv")),
    ("sampling", ("softmax", "argmax", "sampl", "log_softmax", "logit")),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", default="stock,ours", help="comma list of ours, stock, ours:fp8, stock:fp8")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--dense-layers", type=int, default=1)
    p.add_argument("--sparse-layers", type=int, default=3)
    p.add_argument(
        "--fill",
        type=float,
        default=0.0,
        help="instead of --sparse-layers: as many sparse layers as keep a rank's weights within this fraction "
        "of the GPU's memory (e.g. 0.7; the heaviest of --impls' weight formats)",
    )
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--long-batches", default="1,8")
    p.add_argument("--long-len", type=int, default=65536)
    p.add_argument("--prefill-lens", default="8192,32768")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=timed_rounds, default=3, help="timed rounds per TPOT / prefill row (median_low)")
    p.add_argument("--profile-batches", default="1,32", help="decode steps traced at these batches ('' = none)")
    p.add_argument("--keep-traces", action="store_true", help="each profile's raw trace beside --out, too")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--model-path", default=None, help="an M3 checkpoint directory instead of the cut release")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hbm-tbps", type=float, default=0.0, help="HBM bandwidth of the floor (0: measure this GPU's)")
    add_routing_arg(p)
    p.add_argument("--out", default="bench_results/e2e_scaled.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one impl in this process
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)  # internal: the JSON-lines file it appends to
    args = p.parse_args(argv)
    check_routing(p, args)
    if args.fill and not (0 < args.fill <= 1 and args.device == "cuda" and args.model_path is None):
        p.error(f"--fill={args.fill}: a fraction in (0, 1] of this GPU's memory, with --device cuda, not --model-path")
    return args


def add_routing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routing", choices=("model", "uniform"), default="model", help="experts as the router picks, or uniform"
    )


def check_routing(p: argparse.ArgumentParser, args) -> None:
    if args.routing == "uniform" and (args.device != "cuda" or args.dtype == "float32"):
        p.error(
            f"--routing=uniform: SGLang simulates it in TopK, which runs for CUDA half-precision models only "
            f"(--device={args.device}, --dtype={args.dtype})"
        )


def engine_env(args) -> dict:
    """The environment of one engine process: this one's, and uniform routing if asked."""
    env = dict(os.environ)
    if args.routing == "uniform":
        env[UNIFORM_ROUTING_ENV] = "1"
    return env


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def cut_config(dense: int, sparse: int) -> dict:
    """The released config with its first ``dense`` dense layers and its first ``sparse`` sparse layers."""
    cfg = json.loads(RELEASED.read_text())
    cfg.pop("auto_map", None)
    text = cfg["text_config"]
    msa = text["sparse_attention_config"]
    msa = ast.literal_eval(msa) if isinstance(msa, str) else msa
    freq = msa["sparse_attention_freq"]
    keep = [i for i, s in enumerate(freq) if not s][:dense] + [i for i, s in enumerate(freq) if s][:sparse]
    text["num_hidden_layers"] = len(keep)
    text["moe_layer_freq"] = [text["moe_layer_freq"][i] for i in keep]
    for key in ("sparse_attention_freq", "sparse_disable_index_value"):
        msa[key] = [msa[key][i] for i in keep]
    text["sparse_attention_config"] = msa
    return cfg


def fill_sparse_layers(dense: int, fraction: float, memory_bytes: int, tp: int, ep: int, quantizations) -> int:
    """The most sparse layers of the release whose cut (after ``dense`` dense layers) keeps one rank's weights
    (``sizing.rank_weights`` at ``--tp-size tp --ep-size ep``, the heaviest of ``quantizations``, None for
    BF16) within ``fraction`` of ``memory_bytes``: the multi-GPU run's "as many layers as fill ~70 % of memory"."""
    from sglang_m3.config import M3Config
    from sglang_m3.sizing import rank_weights

    def weights(sparse: int) -> int:
        cfg = M3Config.from_hf(cut_config(dense, sparse))
        return max(rank_weights(cfg, tp, ep, quantization=q).total for q in quantizations)

    budget = fraction * memory_bytes
    if weights(0) > budget:
        raise SystemExit(
            f"--fill={fraction}: {dense} dense layers alone take {weights(0) / 2**30:.1f} GiB a rank, over "
            f"{budget / 2**30:.1f} GiB ({fraction} of {memory_bytes / 2**30:.1f} GiB) at --tp-size={tp} --ep-size={ep}"
        )
    released = len(M3Config.from_hf(json.loads(RELEASED.read_text())).sparse_layer_ids)
    sparse = 0
    while sparse < released and weights(sparse + 1) <= budget:  # weights grow with every layer
        sparse += 1
    return sparse


def make_model_dir(args) -> pathlib.Path:
    """config.json of the cut model + the embedded tiny M3's tokenizer files (ids are sent directly)."""
    from sglang_m3.tiny import default_checkpoint

    out = pathlib.Path(tempfile.mkdtemp(prefix="m3-scaled-"))
    (out / "config.json").write_text(json.dumps(cut_config(args.dense_layers, args.sparse_layers), indent=1))
    for f in pathlib.Path(default_checkpoint("m3-tiny", "vl")).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids (distinct per seed: no radix-cache hits)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab // 100, vocab - 1) for _ in range(length)] for _ in range(n)]


def stream_sampling(new: int, shape: dict | None = None) -> dict:
    """The measured requests' sampling: ``new`` tokens each, no early stop; greedy unless ``shape`` (sampling
    fields such as ``temperature`` / ``top_p``) says otherwise."""
    return {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True, **(shape or {})}


async def _stream(
    engine, ids: list[int], new: int, marks: list | None = None, shape: dict | None = None
) -> list[tuple[float, int]]:
    """``(arrival time, completion tokens so far)`` per streamed chunk of one request."""
    sampling = stream_sampling(new, shape)
    marks = [] if marks is None else marks
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
        marks.append((time.perf_counter(), chunk["meta_info"]["completion_tokens"]))
    return marks


# KV tokens per request beyond prompt + output under ``admit_together``: the measured request recomputes
# its cached prompt's last page (128 tokens, the MSA block) beside the cached copy, and SGLang admits a
# request only with room for its new tokens; 8 tokens of slack admitted 63 of 64 requests at batch 64
# (H100, 2026-12-06), the 64th after the others had finished.
ADMIT_SLACK = 256


def admit_together(engine, prompts: list[list[int]]) -> None:
    """Prefill every prompt once (one new token each), so that the measured round finds them in the radix
    cache and the scheduler admits the whole batch in its first step or two (each request's last page).
    Without it chunked prefill admits one 8K prompt a step while the first requests already decode: at
    batch 64 their last tokens came before the last request's first (EAGLE3, H100, 2026-12-06)."""
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})


def full_batch_window(marks: list[list[tuple]]) -> tuple[float, float]:
    """From the last request's first mark to the first request's last (marks: ``(time, ...)`` per streamed
    chunk, one list a request); raises when a request started only after another had ended."""
    start = max(m[0][0] for m in marks)
    end = min(m[-1][0] for m in marks)
    if end <= start:
        raise RuntimeError("no full-batch window: a request's first chunk came after another's last")
    return start, end


def decode_tpot(engine, prompts: list[list[int]], new: int, shape: dict | None = None) -> float:
    """Seconds per decode step while every request of the batch decodes (admitted together): from the last
    request's first token to the first request's last token, over the mean number of tokens a request got
    in that window."""
    admit_together(engine, prompts)
    streams = (_stream(engine, p, new, shape=shape) for p in prompts)
    marks = engine.loop.run_until_complete(asyncio.gather(*streams))
    start, end = full_batch_window(marks)
    steps = [sum(1 for t, _ in m if start < t <= end) for m in marks]
    if min(steps) < 4:
        raise RuntimeError(f"no full-batch decode window (steps {steps}): raise --output-len")
    tokens = [max(n for t, n in m if t <= end) - max(n for t, n in m if t <= start) for m in marks]
    return (end - start) / (sum(tokens) / len(tokens))


def prefill_latency(engine, length: int, seed: int, vocab: int) -> float:
    start = time.perf_counter()
    engine.generate(input_ids=_prompts(1, length, seed, vocab), sampling_params={"max_new_tokens": 1})
    return time.perf_counter() - start


def trace_streams(engine, streams, marks, trace_dir: pathlib.Path, activity: str, steps: int, ready: int = 4):
    """Run ``streams`` (coroutines appending to ``marks``, one list each) and trace ``steps`` decode steps
    of theirs; returns the trace's path.

    The profiler is started once every stream has ``ready`` chunks: started with the batch, it would
    also record the prefill kernels still running on the GPU while the scheduler launches the first
    decode step (overlap scheduling)."""
    from sglang.srt.managers.io_struct import ProfileReq, ProfileReqType

    async def run():
        tasks = [asyncio.ensure_future(s) for s in streams]
        while min(len(m) for m in marks) < ready:
            await asyncio.sleep(0.002)
        req = ProfileReq(
            req_type=ProfileReqType.START_PROFILE,
            output_dir=str(trace_dir),
            num_steps=steps,
            activities=[activity],
            profile_by_stage=True,
            profile_stages=["decode"],
        )
        await engine.tokenizer_manager.start_profile(req)
        await asyncio.gather(*tasks)

    trace_dir.mkdir(parents=True, exist_ok=True)
    engine.loop.run_until_complete(run())
    for _ in range(60):  # the scheduler writes the trace after the last traced step
        traces = sorted(trace_dir.glob("*.trace.json.gz"))
        if traces:
            time.sleep(2)
            decode = [t for t in traces if "DECODE" in t.name]  # profile_by_stage names the stage
            return (decode or traces)[-1]
        time.sleep(1)
    raise RuntimeError(f"no trace written under {trace_dir}")


def profile_decode(
    engine,
    batch: int,
    length: int,
    vocab: int,
    trace_dir: pathlib.Path,
    activity: str,
    steps: int = 8,
    keep: pathlib.Path | None = None,
) -> dict:
    """Trace ``steps`` decode steps at ``batch`` and reduce the trace to ms per step per component."""
    marks = [[] for _ in range(batch)]
    prompts = _prompts(batch, length, 99 + batch, vocab)
    admit_together(engine, prompts)
    streams = [_stream(engine, p, 4 * steps + 16, m) for p, m in zip(prompts, marks)]
    trace = trace_streams(engine, streams, marks, trace_dir, activity, steps)
    if keep is not None:  # the raw trace beside the results, for a reader who wants every kernel
        shutil.copy(trace, keep)
    return summarise_trace(trace, steps)


def component(name: str) -> str:
    """The decode-step component a kernel's name belongs to."""
    low = name.lower()
    if low.removeprefix("void ").startswith(TORCH_GATHERS):
        return "other"
    return next((c for c, keys in COMPONENTS if any(k in low for k in keys)), "other")


def busy_parts(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """GPU busy time (us) per component of ``kernels`` (``(start, duration, name)``, sorted by start):
    where kernels overlap (a side stream, a kernel launched programmatically before the one ahead of it
    ends, its wait then inside its duration) each instant goes to the kernel that started first, so the
    parts add up to the time the GPU was busy. Every component with a kernel has a part, 0 where wholly
    overlapped."""
    per = {}
    edge = kernels[0][0] if kernels else 0.0
    for ts, dur, name in kernels:
        part = component(name)
        per[part] = per.get(part, 0.0) + max(0.0, ts + dur - max(ts, edge))  # what no earlier kernel covers
        edge = max(edge, ts + dur)
    return per


def summarise_trace(path: pathlib.Path, steps: int) -> dict:
    """ms per step: GPU busy time per component (``busy_parts``), and host gaps (the span no kernel ran
    in): they add up to the step; ``kernels`` (each kernel's launches and summed durations per step) can
    add up to more where kernels overlap.
    Also kernel launches per step per component (at small batches the step's many short kernels are much
    of it)."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return {"error": "no kernel events in the trace"}
    per = {name: 0.0 for name, _ in COMPONENTS} | {"other": 0.0} | busy_parts(kernels)
    launches = dict.fromkeys(per, 0)
    top, count = {}, {}
    for ts, dur, name in kernels:
        launches[component(name)] += 1
        top[name] = top.get(name, 0.0) + dur
        count[name] = count.get(name, 0) + 1
    span = max(ts + dur for ts, dur, _ in kernels) - kernels[0][0]
    out = {k: v / 1e3 / steps for k, v in per.items()}
    out["host_gaps"] = (span - sum(per.values())) / 1e3 / steps
    out["step"] = span / 1e3 / steps
    ranked = sorted(top.items(), key=lambda x: -x[1])  # longest first
    out["top_kernels"] = {k[:90]: round(v / 1e3 / steps, 4) for k, v in ranked[:12]}
    out["launches_per_step"] = {k: v / steps for k, v in launches.items()} | {"total": len(kernels) / steps}
    # every kernel of the step: [name, launches a step, us a step] (which launches to fuse)
    out["kernels"] = [[k[:90], count[k] / steps, round(v / steps, 2)] for k, v in ranked]
    return out


def moe_config_dir() -> pathlib.Path:
    """A directory laid out as SGLANG_MOE_CONFIG_DIR wants it (``configs/triton_<version>/<file>``) over
    sglang-m3's tuned configs."""
    from sglang_m3 import moe_configs

    root = pathlib.Path(tempfile.mkdtemp(prefix="m3-moe-configs-"))
    (root / "configs").symlink_to(moe_configs.ROOT, target_is_directory=True)
    return root


def engine_base_args(args, load_format: str, tokens: int, batches: list[int], mem_fraction_static: float) -> dict:
    """``sgl.Engine`` arguments both benchmark scripts share: token ids in and out, KV for ``tokens`` plus
    slack, decode graphs only at the measured ``batches`` (a shorter start-up), 8K prefill chunks, and room
    for the largest batch to run at once (SGLang caps an EAGLE engine at 48 running requests unless told:
    ``arg_groups/speculative_hook.py``; at batch 64 the last 16 waited for the first to finish)."""
    return dict(
        model_path=args.model_dir,
        load_format=load_format,
        device=args.device,
        dtype=args.dtype,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        disable_cuda_graph=args.device != "cuda",
        skip_tokenizer_init=True,
        kv_cache_dtype=args.kv_cache_dtype,
        max_total_tokens=tokens + 4096,
        cuda_graph_bs_decode=sorted(set(batches)),
        max_running_requests=max(batches, default=1),
        chunked_prefill_size=PREFILL_CHUNK,
        mem_fraction_static=mem_fraction_static,
        log_level="info",
    )


def prefill_chunks(args) -> list[int]:
    """Token counts of the chunks the measured prefills run in (``chunked_prefill_size`` = ``PREFILL_CHUNK``)."""
    lens = _ints(args.prefill_lens)
    return sorted({min(n, PREFILL_CHUNK) for n in lens} | {n % PREFILL_CHUNK for n in lens} - {0}) or [PREFILL_CHUNK]


def run_one(args) -> None:
    """One implementation in this process; one JSON object per line appended to ``--results`` (not stdout,
    where the engine's processes log too and can split a line)."""
    import sglang as sgl
    import torch
    from sglang_m3.config import M3Config

    spec, _, flag = args.one.partition("+")
    impl, _, quant = spec.partition(":")
    vocab = M3Config.from_hf(json.loads((pathlib.Path(args.model_dir) / "config.json").read_text())).vocab_size
    batches, long_batches = _ints(args.batches), _ints(args.long_batches)
    need = max(
        [b * (args.input_len + args.output_len + ADMIT_SLACK) for b in batches]
        + [b * (args.long_len + args.output_len + ADMIT_SLACK) for b in long_batches]
        + [max(_ints(args.prefill_lens) or [0]) + 16]
    )
    engine_args = engine_base_args(args, "dummy", need, batches + long_batches, mem_fraction_static=0.85)
    if quant:
        engine_args["quantization"] = quant
    if flag == "fused-shared":
        engine_args["enforce_shared_experts_fusion"] = True
    if impl == "stock":
        engine_args.update(attention_backend="triton", enable_multimodal=False)
        engine_args["cuda_graph_bs_prefill"] = prefill_chunks(args)
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_args)

    def emit(**record):
        with open(args.results, "a") as f:
            f.write(json.dumps(dict(impl=args.one, **record)) + "\n")

    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    emit(kind="startup", seconds=time.perf_counter() - t0, device=device)
    try:
        warm = _prompts(2, min(4096, args.input_len), 1, vocab)
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        for context, sizes in ((args.input_len, batches), (args.long_len, long_batches)):
            for b in sizes:
                prompts = _prompts(b, context, context + b, vocab)
                ms = [1e3 * decode_tpot(engine, prompts, args.output_len) for _ in range(args.repeats)]
                emit(kind="tpot", batch=b, context=context, ms=statistics.median_low(ms), ms_repeats=ms)
                engine.flush_cache()
        for n in _ints(args.prefill_lens):
            prefill_latency(engine, n, 3000 + n, vocab)  # warm-up at this length
            engine.flush_cache()
            ms = []
            for r in range(args.repeats):  # a fresh prompt each round: no radix-cache hit
                ms.append(1e3 * prefill_latency(engine, n, 4000 + n + r, vocab))
                engine.flush_cache()
            emit(kind="prefill", batch=1, context=n, ms=statistics.median_low(ms), ms_repeats=ms)
        for b in _ints(args.profile_batches):
            tag = f"{args.one.replace(':', '-').replace('+', '-')}-b{b}"
            out = pathlib.Path(args.out)
            keep = out.with_name(f"{out.stem}.{tag}.trace.json.gz") if args.keep_traces else None
            trace_dir = pathlib.Path(tempfile.gettempdir()) / "m3-traces" / tag
            activity = "GPU" if args.device == "cuda" else "CPU"
            emit(
                kind="profile",
                batch=b,
                context=args.input_len,
                ms_per_step=profile_decode(engine, b, args.input_len, vocab, trace_dir, activity, keep=keep),
            )
            engine.flush_cache()
    finally:
        engine.shutdown()


HBM_PROBE = """
import torch
x = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    y.copy_(x)
end.record()
torch.cuda.synchronize()
print(2 * 10 * x.numel() / (start.elapsed_time(end) / 1e3) / 1e12)
"""


def _probe(code: str) -> float:
    """The last number ``code`` prints, run in its own process so that no CUDA context stays beside the
    engines."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def measure_hbm_tbps() -> float:
    """TB/s of a 4 GiB device-to-device copy (bytes read + written): the floor's bandwidth measured on the
    card the TPOTs ran on."""
    return _probe(HBM_PROBE)


def gpu_memory_bytes() -> int:
    """GPU 0's total memory (``--fill``'s budget)."""
    return int(_probe("import torch; print(torch.cuda.get_device_properties(0).total_memory)"))


def resolve_hbm_tbps(args) -> None:
    """``--hbm-tbps 0``: this GPU's, measured (on CPU, where floors mean nothing, the H200's 4.3)."""
    if not args.hbm_tbps:
        args.hbm_tbps = measure_hbm_tbps() if args.device == "cuda" else 4.3
        print(f"HBM bandwidth of the floors: {args.hbm_tbps:.2f} TB/s", flush=True)


def impl_quantization(impl: str) -> str | None:
    """``--quantization`` of an ``--impls`` entry: ``"fp8"`` for ``ours:fp8+fused-shared``, None for ``stock``."""
    return impl.partition("+")[0].partition(":")[2] or None


def floors(args, model_dir: pathlib.Path, records: list[dict]) -> None:
    """Add ``floor_ms`` (and ``vs_floor``) to every TPOT record of an unquantised or fp8 run: the bytes one
    rank must move at ``--tp-size`` / ``--ep-size`` (the ranks move theirs at once; the all-reduces are
    not counted)."""
    import torch
    from sglang_m3.config import M3Config
    from sglang_m3.mem.layout import bytes_per_token, layout_for
    from sglang_m3.parallel import rank_heads
    from sglang_m3.sizing import decode_step_bytes, rank_weights

    cfg = M3Config.from_hf(json.loads((model_dir / "config.json").read_text()))
    kv_heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, args.tp_size, 0).kv_heads
    kv = bytes_per_token(cfg, layout_for(args.kv_cache_dtype, torch.bfloat16), kv_heads=kv_heads)
    for r in records:
        if r["kind"] != "tpot":
            continue
        quant = impl_quantization(r["impl"])
        weights = rank_weights(cfg, args.tp_size, args.ep_size, quantization=quant)
        parts = decode_step_bytes(cfg, r["batch"], r["context"], kv, weights)
        r["floor_ms"] = sum(parts.values()) / (args.hbm_tbps * 1e12) * 1e3
        r["floor_parts_gb"] = {k: round(v / 1e9, 3) for k, v in parts.items()}
        r["vs_floor"] = r["ms"] / r["floor_ms"]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one:
        run_one(args)
        return {}
    impls = args.impls.split(",")
    for impl in impls:
        flag = impl.partition("+")[2]
        if flag and (flag, impl.startswith("stock")) not in IMPL_FLAGS:
            known = ", ".join(f"{'stock' if on_stock else 'ours'}+{f}" for f, on_stock in sorted(IMPL_FLAGS))
            raise SystemExit(f"--impls: unknown {impl!r} (flags: {known})")
    resolve_hbm_tbps(args)
    if args.fill:
        quants = {impl_quantization(impl) for impl in impls}
        args.sparse_layers = fill_sparse_layers(
            args.dense_layers, args.fill, gpu_memory_bytes(), args.tp_size, args.ep_size, quants
        )
        print(f"--fill={args.fill}: {args.dense_layers} dense + {args.sparse_layers} sparse layers", flush=True)
    model_dir = pathlib.Path(args.model_path) if args.model_path else make_model_dir(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records, startup_lines = [], {}
    for impl in impls:
        env = engine_env(args)
        if impl.startswith("stock"):
            env["SGLANG_PLUGINS"] = NO_PLUGIN
        if impl.endswith("+one-stream"):
            env[SIDE_STREAM_ENV] = "0"
        config_dir = moe_config_dir() if impl.endswith("+tuned-moe") else None
        if config_dir is not None:
            env["SGLANG_MOE_CONFIG_DIR"] = str(config_dir)
        # beside --out while the impl runs, so a run cut short still leaves what it measured
        results = out.with_name(f"{out.stem}.{impl.replace(':', '-')}.partial.jsonl")
        results.write_text("")
        cmd = [sys.executable, __file__, "--one", impl, "--model-dir", str(model_dir), "--results", str(results)]
        cmd += argv
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if config_dir is not None:
            shutil.rmtree(config_dir)  # the link only, not what it points to
        for line in results.read_text().splitlines():
            records.append(json.loads(line))
            print(line, flush=True)
        results.unlink()
        for line in proc.stdout.splitlines():
            if any(mark in line for mark in STARTUP_MARKS):
                startup_lines.setdefault(impl, []).append(line.strip()[-400:])
        if proc.returncode:
            print(proc.stdout[-6000:], file=sys.stderr)
            print(f"{impl}: exit {proc.returncode}", file=sys.stderr)
        floors(args, model_dir, records)
        _write(out, args, argv, records, startup_lines)
    if not args.model_path:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"wrote {out}")
    return json.loads(out.read_text())


def _write(out: pathlib.Path, args, argv: list[str], records: list[dict], startup_lines: dict) -> None:
    stock = {(r["batch"], r["context"], r["kind"]): r["ms"] for r in records if r["impl"] == "stock" and "ms" in r}
    for r in records:
        key = (r.get("batch"), r.get("context"), r["kind"])
        if r["impl"] != "stock" and key in stock:
            r["vs_stock"] = r["ms"] / stock[key]
    summary = dict(
        benchmark="e2e_scaled",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python3 scripts/bench_scaled.py " + " ".join(argv),
        model=args.model_path
        or f"released M3 config cut to {args.dense_layers} dense + {args.sparse_layers} sparse layers, dummy weights",
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        repeats=args.repeats,
        routing=args.routing,
        kv_cache_dtype=args.kv_cache_dtype,
        hbm_tbps=args.hbm_tbps,
        startup_lines=startup_lines,
        records=records,
    )
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
