"""Time our MSA kernels against upstream SGLang 0.5.17's M3 Triton kernels on one GPU.

Shape: the per-GPU slice of MiniMax-M3 under TP4 -- 16 query heads, 1 KV head, 1 index
head, head_dim 128, block (= page) 128, top-16, local 1 block. For every dtype (bf16 /
fp8 / nvfp4), batch and context it times, each as a CUDA-graph replay with the L2 flushed
by a 256 MB write before every replay (events bracket the replay only):

* ``indexer``   -- block scores + top-k selection (ours: ``msa_topk``; upstream:
  ``flash_decode_with_topk_idx`` with ``disable_index_value``),
* ``attention`` -- sparse attention over the selected pages (ours: ``msa_attention``;
  upstream: ``flash_decode_with_gqa_share_sparse``),
* ``decode``    -- both, one row per request,
* ``verify``    -- both, 1 + 3 rows per request at consecutive positions (ours); upstream's
  target-verify path is its extend path (``minimax_sparse_prefill``), timed the same way
  where it captures, else eagerly (noted in the record).

Layouts: bf16 = bf16 KV + bf16 index-K; fp8 = fp8 KV + fp8 index-K; nvfp4 = NVFP4 KV +
fp8 index-K (the hybrid pool's sparse layers). Upstream has no NVFP4 KV on Hopper.
HBM floor = bytes that must move / 4.3 TB/s (measured device copy rate, DESIGN section 9):
index-K of every context token once, the top-k pages of K and V per request, q and out.

Usage (GPU host; upstream on PYTHONPATH, see build-runtime.sh)::

    python3 scripts/bench_kernels.py --out benchmarks

Writes ``<out>/kernels.json`` (records) and ``<out>/kernels.md`` (table, command, date). Upstream's
first calls autotune for minutes: to fit a device call, time ours (``--no-upstream``) and upstream
(``--only-upstream --deadline S``) as two passes of one call and join them anywhere with
``--merge OURS_JSON UPSTREAM_JSON --out DIR`` (benchmarks/kernels.md shows the commands).
Needs the package installed (``pip install -e .``): it imports ``sglang_m3_kernels``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import torch

HBM_BPS = 4.3e12  # measured H200 device-to-device copy, bytes read + written per second
HQ, HKV, D, BLOCK, TOPK, LOCAL = 16, 1, 128, 128, 16, 1
SCALE = D**-0.5
KV_BYTES = {"bf16": 2 * D * 2, "fp8": 2 * D, "nvfp4": 2 * (D // 2 + D // 16)}  # K+V per token, 1 head
IDX_BYTES = {"bf16": 2 * D, "fp8": D, "nvfp4": D}  # nvfp4 pools keep an fp8 index-K


def _kernels():
    from sglang_m3_kernels import kv_quant, msa_index_topk, msa_sparse_attn

    return kv_quant, msa_index_topk.msa_topk, msa_sparse_attn.msa_attention


def _upstream():
    try:
        from sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx import flash_decode_with_topk_idx
        from sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse import flash_decode_with_gqa_share_sparse
        from sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse import minimax_sparse_prefill
    except Exception as err:  # noqa: BLE001
        print(f"upstream kernels unavailable: {err!r}")
        return None
    return flash_decode_with_topk_idx, flash_decode_with_gqa_share_sparse, minimax_sparse_prefill


class Problem:
    """One (dtype, batch, context) input set: shuffled pages, caches, rows for decode and verify."""

    def __init__(self, kvq, dtype, batch, ctx, seed=0, table_pages=0):
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(seed)
        self.dtype, self.batch, self.ctx = dtype, batch, ctx
        pages = -(-ctx // BLOCK)
        num_pages = batch * pages + 1
        perm = torch.randperm(num_pages, device=dev, generator=g)
        # a serving page table is as wide as the longest context (``table_pages``), not the batch's:
        # the columns past a row's pages hold page 0 and are never read
        width = max(pages, table_pages)
        self.page_table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        self.page_table[:, :pages] = perm[: batch * pages].view(batch, pages)
        slots = num_pages * BLOCK
        ik = torch.randn(slots, D, device=dev, generator=g, dtype=torch.bfloat16)
        self.idx_k = ik if dtype == "bf16" else kvq.fp8_quantize_ref(ik, 1.0)
        del ik
        self.kv = {}
        for name in ("k", "v"):
            x = torch.randn(slots, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)
            if dtype == "bf16":
                self.kv[name] = (x, None)
            elif dtype == "fp8":
                self.kv[name] = (kvq.fp8_quantize_ref(x, 1.0), None)
            else:
                data = torch.empty(slots, HKV, D // 2, dtype=torch.uint8, device=dev)
                sc = torch.empty(slots, HKV, D // 16, dtype=torch.float8_e4m3fn, device=dev)
                for lo in range(0, slots, 1 << 22):  # chunks keep the fp32 temporaries small
                    hi = min(slots, lo + (1 << 22))
                    kvq.kv_store(x[lo:hi], torch.arange(lo, hi, device=dev), data, scales=sc)
                self.kv[name] = (data, sc)
            del x
        self.rows = {}
        for mode, n in (("decode", 1), ("verify", 4)):
            req = torch.arange(batch, device=dev).repeat_interleave(n)
            pos = (ctx - n + torch.arange(n, device=dev)).repeat(batch)
            iq = torch.randn(batch * n, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)
            q = torch.randn(batch * n, HQ, D, device=dev, generator=g, dtype=torch.bfloat16)
            self.rows[mode] = (req, pos, iq, q)
        # upstream view: req_to_token [batch, ctx] slot ids of every token
        tok = torch.arange(width * BLOCK, device=dev)
        r2t = self.page_table.long()[:, tok // BLOCK] * BLOCK + tok % BLOCK
        self.req_to_token = (r2t if table_pages else r2t[:, :ctx]).to(torch.int32)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.slot_ids = torch.arange(batch, device=dev)

    def floor_us(self, kernel, rows_per_req):
        idx = self.batch * self.ctx * IDX_BYTES[self.dtype]
        sel = min(TOPK, -(-self.ctx // BLOCK)) * BLOCK * KV_BYTES[self.dtype] * self.batch
        qo = self.batch * rows_per_req * HQ * D * 2 * 2 + self.batch * rows_per_req * HKV * D * 2
        total = {"indexer": idx, "attention": sel, "decode": idx + sel, "verify": idx + sel}[kernel] + qo
        return total / HBM_BPS * 1e6


def time_graph(fn, iters, flush):
    """Median microseconds of CUDA-graph replays of ``fn``, L2 flushed before each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, iters, flush)


# Warm-up replays before timing, at least this many and this long: a fresh capture of a long index
# scan replays ~11 % slow for its first ~36 replays, then fast for good (docs/perf-notes.md).
# Serving replays a captured graph for hours, so the steady state is what is timed, ours and upstream's.
_WARM_REPLAYS, _WARM_SECONDS = 64, 0.05


def _time(run, iters, flush):
    done, start = 0, time.perf_counter()
    while done < _WARM_REPLAYS or time.perf_counter() - start < _WARM_SECONDS:
        for _ in range(16):
            flush.add_(1)
            run()
        torch.cuda.synchronize()
        done += 16
    return statistics.median(replay_times(run, iters, flush))


def replay_times(run, n, flush):
    """Microseconds of each of ``n`` calls of ``run``, the L2 flushed before each (no warm-up)."""
    times = []
    for _ in range(n):
        flush.add_(1)  # 256 MB read + write evicts the 60 MB L2
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return times


def index_path(p, msa_topk, mode):
    """Our top-k selection for ``mode`` rows of ``p``, as a zero-argument callable."""
    req, pos, iq, _ = p.rows[mode]
    return lambda: msa_topk(iq, p.idx_k, p.page_table, req, pos, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)


def attend(p, msa_attention, mode, block_ids):
    """Our sparse attention of ``mode`` rows of ``p`` over ``block_ids``."""
    req, pos, _, q = p.rows[mode]
    k, v = p.kv["k"], p.kv["v"]
    return msa_attention(
        q, k[0], v[0], p.page_table, req, pos, block_ids, block_size=BLOCK, scale=SCALE, k_scales=k[1], v_scales=v[1]
    )


def full_path(p, ours, mode):
    """Our whole path for ``mode`` rows of ``p``: top-k selection, then sparse attention."""
    _, msa_topk, msa_attention = ours
    select = index_path(p, msa_topk, mode)
    return lambda: attend(p, msa_attention, mode, select())


def warm_up(p, ours, n):
    """Run the decode path ``n`` times on a fresh case before anything is timed: the steady
    state of a pool that is written once and read for hours. The slow first replays of a fresh
    capture (docs/perf-notes.md) are what ``_time``'s warm-up replays are for.
    """
    full = full_path(p, ours, "decode")
    for _ in range(n):
        full()
    torch.cuda.synchronize()


def bench_case(p, ours, up, iters, flush, up_verify=True, time_ours=True):
    _, msa_topk, msa_attention = ours
    recs = []

    def rec(kernel, rows_per_req, ours_us, up_us, note=""):
        floor = p.floor_us(kernel, rows_per_req)
        recs.append(
            dict(
                kernel=kernel,
                dtype=p.dtype,
                batch=p.batch,
                context=p.ctx,
                ours_us=None if ours_us is None else round(ours_us, 2),
                upstream_us=None if up_us is None else round(up_us, 2),
                floor_us=round(floor, 2),
                ours_over_floor=None if ours_us is None else round(ours_us / floor, 2),
                speedup_vs_upstream=None if up_us is None or ours_us is None else round(up_us / ours_us, 2),
                note=note,
            )
        )
        print(
            f"{kernel:9s} {p.dtype:5s} b={p.batch:<3d} ctx={p.ctx:<7d} "
            f"ours {'-' if ours_us is None else f'{ours_us:8.1f}'} us  "
            f"upstream {'-' if up_us is None else f'{up_us:8.1f}'} us  floor {floor:7.1f} us  {note}",
            flush=True,
        )

    for mode in ("decode", "verify"):
        _, _, iq, q = p.rows[mode]
        indexer = index_path(p, msa_topk, mode)
        ids = indexer()

        def attention(mode=mode, ids=ids):
            return attend(p, msa_attention, mode, ids)

        full = full_path(p, ours, mode)
        t_full = time_graph(full, iters, flush) if time_ours else None
        up_full = note = None
        if up is not None and p.dtype != "nvfp4" and (mode == "decode" or up_verify):
            try:
                up_full, note = _upstream_full(up, p, mode, iters, flush)
            except Exception as err:  # noqa: BLE001
                note = f"upstream failed: {type(err).__name__}: {str(err)[:80]}"
                traceback.print_exc()
        rec(mode, 1 if mode == "decode" else 4, t_full, up_full, note or "")
        if mode == "decode":
            t_idx = time_graph(indexer, iters, flush) if time_ours else None
            t_att = time_graph(attention, iters, flush) if time_ours else None
            up_idx = up_att = None
            if up is not None and p.dtype != "nvfp4":
                try:
                    up_idx = time_graph(lambda: _up_indexer(up, p, iq), iters, flush)
                    up_ids = ids.permute(1, 0, 2).contiguous()
                    up_att = time_graph(lambda: _up_attention(up, p, q, up_ids), iters, flush)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            rec("indexer", 1, t_idx, up_idx)
            rec("attention", 1, t_att, up_att)
    return recs


def _up_indexer(up, p, iq):
    _, topk_idx, _ = up[0](
        q=iq,
        sink=None,
        k_cache=p.idx_k.unsqueeze(1),
        v_cache=None,
        req_to_token=p.req_to_token,
        seq_lens=p.seq_lens,
        max_seqlen=p.ctx,
        slot_ids=p.slot_ids,
        block_size=BLOCK,
        topk=TOPK,
        init_blocks=0,
        local_blocks=LOCAL,
        disable_index_value=True,
        page_size=BLOCK,
        k_scale=None if p.dtype == "bf16" else 1.0,
    )
    return topk_idx


def _up_attention(up, p, q, topk_idx):
    scales = {} if p.dtype == "bf16" else dict(k_scale=1.0, v_scale=1.0)
    return up[1](
        q,
        None,
        p.kv["k"][0],
        p.kv["v"][0],
        p.req_to_token,
        p.seq_lens,
        p.slot_ids,
        BLOCK,
        topk_idx,
        sm_scale=SCALE,
        **scales,
    )


def _upstream_full(up, p, mode, iters, flush):
    req, pos, iq, q = p.rows[mode]
    if mode == "decode":
        try:
            return time_graph(lambda: _up_attention(up, p, q, _up_indexer(up, p, iq)), iters, flush), ""
        except Exception as err:  # noqa: BLE001  (JIT radix top-k needs nvcc + tvm_ffi at run time)
            if os.environ.get("SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX") == "0":
                raise
            print(f"upstream JIT radix top-k failed ({err!r}); using its Triton top-k from now on")
            os.environ["SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX"] = "0"
            torch.cuda.synchronize()
            return time_graph(
                lambda: _up_attention(up, p, q, _up_indexer(up, p, iq)), iters, flush
            ), "upstream Triton top-k"
    n = 4
    cu = torch.arange(0, p.batch * n + 1, n, dtype=torch.int32, device="cuda")
    prefix = p.seq_lens - n
    scales = {} if p.dtype == "bf16" else dict(k_scale=1.0, v_scale=1.0, idx_k_scale=1.0)

    def run():
        return up[2](
            q,
            p.kv["k"][0],
            p.kv["v"][0],
            None,
            iq,
            p.idx_k.unsqueeze(1),
            None,
            None,
            p.req_to_token,
            p.slot_ids,
            cu,
            p.seq_lens,
            prefix,
            n,
            p.ctx,
            1,
            BLOCK,
            TOPK,
            0,
            LOCAL,
            disable_index_value=True,
            seqlens_cpu=[n] * p.batch,
            **scales,
        )

    try:
        return time_graph(run, iters, flush), "upstream: extend path"
    except Exception as err:  # noqa: BLE001
        torch.cuda.synchronize()
        return _time(run, iters, flush), f"upstream: extend path, eager ({type(err).__name__} under capture)"


def write_outputs(records, out_dir, argv):
    out_dir.mkdir(parents=True, exist_ok=True)
    order = {k: i for i, k in enumerate(("bf16", "fp8", "nvfp4", "decode", "verify", "indexer", "attention"))}
    records = sorted(records, key=lambda r: (order[r["dtype"]], r["batch"], r["context"], order[r["kernel"]]))
    (out_dir / "kernels.json").write_text(json.dumps(records, indent=1))
    lines = [
        "# MSA kernel benchmark (H200, TP4 per-GPU shape)",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'that of the merged runs'}; "
        f"torch {torch.__version__}.",
        "",
        f"Command: `python3 {' '.join(argv)}`",
        "",
        "16 q heads, 1 KV head, 1 index head, head_dim 128, block 128, top-16. CUDA-graph replay, "
        "L2 flushed before each replay, median. floor = bytes that must move / 4.3 TB/s. "
        "upstream = SGLang 0.5.17 Triton kernels (no NVFP4 KV on Hopper).",
        "",
        "| kernel | dtype | batch | context | ours us | upstream us | floor us | ours/floor | upstream/ours | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        cell = {
            k: "-" if r[k] is None else r[k]
            for k in ("ours_us", "upstream_us", "ours_over_floor", "speedup_vs_upstream")
        }
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['batch']} | {r['context']} | {cell['ours_us']} | "
            f"{cell['upstream_us']} | {r['floor_us']} | {cell['ours_over_floor']} | {cell['speedup_vs_upstream']} | "
            f"{r['note']} |"
        )
    (out_dir / "kernels.md").write_text("\n".join(lines) + "\n")


def merge_records(ours_json, up_json):
    """Ours' records with upstream's times (from a separate pass on the same machine) filled in."""
    key = lambda r: (r["kernel"], r["dtype"], r["batch"], r["context"])  # noqa: E731
    up = {key(r): r for r in json.loads(up_json.read_text())}
    records = json.loads(ours_json.read_text())
    for r in records:
        u = up.get(key(r))
        if u is None or u["upstream_us"] is None:
            continue
        r["upstream_us"], r["note"] = u["upstream_us"], u["note"]
        if r["ours_us"]:
            r["speedup_vs_upstream"] = round(u["upstream_us"] / r["ours_us"], 2)
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # a folder of its own: kernels.md here is the table alone, benchmarks/kernels.md the table with its notes
    ap.add_argument("--out", default="bench_results/kernels")
    ap.add_argument("--dtypes", default="bf16,fp8,nvfp4")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="8192,32768,131072,524288")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-gib", type=float, default=60.0, help="skip cases whose caches exceed this")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-upstream-verify", action="store_true", help="skip upstream's (slow) extend path for verify")
    ap.add_argument("--only-upstream", action="store_true", help="time upstream's kernels only")
    ap.add_argument("--deadline", type=float, default=0, help="start no new case after this many seconds")
    ap.add_argument("--warmup", type=int, default=200, help="decode-path executions on each fresh case before timing")
    ap.add_argument(
        "--table-pages",
        type=int,
        default=0,
        help="page-table width in pages, as serving sizes it for the longest context (M3's 1M: 8192); 0: the context's",
    )
    ap.add_argument(
        "--merge",
        nargs=2,
        metavar=("OURS_JSON", "UPSTREAM_JSON"),
        help="no timing: join an --no-upstream run and an --only-upstream run of the same call into --out",
    )
    args = ap.parse_args()
    if args.merge:
        write_outputs(merge_records(*map(pathlib.Path, args.merge)), pathlib.Path(args.out), sys.argv)
        return
    t0 = time.time()
    ours = _kernels()
    up = None if args.no_upstream else _upstream()
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    records = []
    cases = [
        (ctx, dtype, batch)
        for ctx in map(int, args.contexts.split(","))
        for dtype in args.dtypes.split(",")
        for batch in map(int, args.batches.split(","))
    ]  # longest contexts last: a timeout cuts those
    for ctx, dtype, batch in cases:
        gib = batch * ctx * (IDX_BYTES[dtype] + KV_BYTES[dtype] + (2 * D * 2)) / 2**30  # + bf16 temp
        if gib > args.max_gib:
            print(f"skip {dtype} b={batch} ctx={ctx}: {gib:.0f} GiB")
            continue
        if args.deadline and time.time() - t0 > args.deadline:
            print(f"deadline: not run {dtype} b={batch} ctx={ctx}")
            continue
        p = Problem(ours[0], dtype, batch, ctx, table_pages=args.table_pages)
        warm_up(p, ours, args.warmup)
        case = bench_case(
            p, ours, up, args.iters, flush, up_verify=not args.no_upstream_verify, time_ours=not args.only_upstream
        )
        records += [dict(r, table_pages=p.page_table.shape[1]) for r in case]
        print(f"[{time.time() - t0:.0f} s]", flush=True)
        del p
        torch.cuda.empty_cache()
        dirs = [pathlib.Path(args.out).resolve()]
        if os.environ.get("OUT"):  # the device tool's return folder, unless --out already lies in it
            env_out = pathlib.Path(os.environ["OUT"]).resolve()
            if env_out not in (dirs[0], *dirs[0].parents):
                dirs.append(env_out)
        for d in dirs:
            write_outputs(records, d, sys.argv)


if __name__ == "__main__":
    main()
