"""Engine-side helpers shared by the end-to-end modules."""

from __future__ import annotations

import os
import time

import psutil
import torch

LOGPROB_ATOL = 1e-4  # fp32 on both sides; only reduction order may differ
NEW_TOKENS = 40
# Mean |log-prob error| vs fp32 KV on the tiny model (measured on CPU and on the H200 alike:
# FP8 0.151, hybrid 0.170): FP8 has 3 mantissa bits, the hybrid puts NVFP4 on sparse layers only.
KV_ERROR_BOUNDS = {"fp8_e4m3": 0.4, "nvfp4": 0.5}


def stop_engine(engine, timeout_s: float = 60.0) -> None:
    """Stop one engine and only its processes.

    ``Engine.shutdown()`` kills every child process of the calling process, so in a test process
    holding several engines it also kills the others' schedulers; their subprocess watchdogs then
    SIGQUIT the test process and SGLang's handler SIGKILLs it (pytest ends with exit 137). Here the
    engine's own watchdog is stopped first, then its scheduler and detokenizer trees are killed.
    """
    watchdog = engine.tokenizer_manager._subprocess_watchdog
    watchdog.stop()
    procs = []
    for proc in watchdog._processes:
        try:
            root = psutil.Process(proc.pid)
            procs += [*root.children(recursive=True), root]
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, f"engine processes still alive after {timeout_s} s: {[p.pid for p in alive]}"
    for proc in watchdog._processes:
        proc.join(timeout=timeout_s)  # reap, so no zombie stays behind
    if engine.send_to_rpc is not None:
        engine.send_to_rpc.close(linger=0)
        engine.send_to_rpc = None


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) from the engine, ``[len(ids) - 1]``."""
    out = engine.generate(
        input_ids=[ids],
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return torch.tensor([lp for lp, _, _ in out[0]["meta_info"]["input_token_logprobs"][1:]])


def engine_greedy(engine, prompts: list[list[int]], new: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations of a batch, EOS ignored so every prompt yields ``new`` tokens."""
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    )
    return [o["output_ids"] for o in outs]


def engine_output_logprobs(engine, prompts: list[list[int]], new: int = 12) -> tuple[list[list[float]], list[dict]]:
    """Greedy continuations' own log-probs per prompt (``new`` tokens, EOS ignored), and the raw outputs."""
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs], outs


def greedy_of(model_path, prompts, engine_args: dict, new: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations from an engine started for this call alone. A CPU engine of several TP ranks
    binds each rank to one core: SGLang binds CPU ranks through ``SGLANG_CPU_OMP_THREADS_BIND`` when TP
    exceeds the NUMA nodes (set only while the engine starts; its processes inherit it)."""
    import sglang as sgl

    env = os.environ.copy()
    tp_size = engine_args.get("tp_size", 1)
    if engine_args.get("device") == "cpu" and tp_size > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(tp_size))
    try:
        engine = sgl.Engine(model_path=str(model_path), **engine_args)
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        return engine_greedy(engine, prompts, new)
    finally:
        stop_engine(engine)


def run_per_kv_dtype(model_path, kv_dtypes, prompts, engine_args, new: int = NEW_TOKENS) -> dict:
    """``{kv_dtype: (prompt log-probs per prompt, greedy outputs)}``, one engine at a time."""
    import sglang as sgl

    results = {}
    for kv_dtype in kv_dtypes:
        engine = sgl.Engine(model_path=str(model_path), kv_cache_dtype=kv_dtype, **engine_args)
        try:
            results[kv_dtype] = ([engine_logprobs(engine, p) for p in prompts], engine_greedy(engine, prompts, new))
        finally:
            stop_engine(engine)
    return results


def used_tokens_settle_to_zero(engine, timeout_s: float = 60.0) -> bool:
    """Poll the scheduler's load snapshot (published periodically, so it may lag) until no KV slot is in use."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = engine.loop.run_until_complete(engine.tokenizer_manager.get_loads(include=["core"]))[0]
        if load.num_used_tokens == 0 and load.num_running_reqs == 0:
            return True
        time.sleep(1.0)
    return False
