"""Shared fixtures for end-to-end tests: cached tiny checkpoints, prompts, engines.

Engines take ~30 s to start on CPU, so each test module shares one (module scope)
and the OpenAI server is one per session.
"""

from __future__ import annotations

import pytest
from sglang_m3.tiny import default_checkpoint

# fp32 model and KV: token-exact comparisons need it (DESIGN section 5).
# sleep_on_idle: an idle scheduler must not spin on one of CI's two cores while references compute.
ENGINE_ARGS = dict(
    device="cpu", dtype="float32", disable_cuda_graph=True, log_level="error", max_total_tokens=8192, sleep_on_idle=True
)


@pytest.fixture(scope="package", autouse=True)
def _triton_env():
    """SGLang processes started here inherit this environment.

    * No Triton interpreter: test/kernel/conftest.py turns it on when collected; here it would
      run SGLang's own Triton kernels on CPU and hide a missing CPU path.
    * IEEE fp32 dots: Triton's fp32 ``tl.dot`` defaults to TF32 on GPUs, which would break the
      token-exact fp32 comparisons of the GPU tests (SGLang's fused MoE, our MSA kernels).
    * No TF32 in this process either: the transformers references run here, on the GPU in the
      GPU tests, and must compute in true fp32 like the engine.
    """
    import torch

    precision = torch.get_float32_matmul_precision()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.setenv("TRITON_F32_DEFAULT", "ieee")
        mp.setattr(torch.backends.cudnn, "allow_tf32", False)
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="session")
def tiny_vl():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="session")
def tiny_gqa_text():
    return default_checkpoint("m3-tiny-gqa", "text")


@pytest.fixture(scope="session")
def tiny_gqa_vl():
    return default_checkpoint("m3-tiny-gqa", "vl")


@pytest.fixture(scope="session")
def corpus_ids(tiny_vl):
    """A long token stream from the shipped corpus (both tiny checkpoints share the tokenizer)."""
    from importlib import resources

    from transformers import AutoTokenizer

    text = resources.files("sglang_m3").joinpath("assets/tokenizer_corpus.txt").read_text()
    return AutoTokenizer.from_pretrained(tiny_vl)(text).input_ids


def prompts_from(ids: list[int]) -> list[list[int]]:
    """Mixed lengths: below the sparse threshold (block 16 x top-4 = 64) and well past it.

    Defined with the tiny draft, which memorises the target's continuations of exactly these prompts."""
    from sglang_m3.tiny.prompts import corpus_prompts

    return corpus_prompts(ids)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_draft(tiny_vl):
    """The embedded tiny EAGLE3 draft for ``m3-tiny`` (distilled from it, cached)."""
    from sglang_m3.tiny.draft import default_draft

    return default_draft("m3-tiny")


@pytest.fixture(scope="session")
def tiny_gqa_draft(tiny_gqa_vl):
    """The tiny EAGLE3 draft for ``m3-tiny-gqa`` (8 query heads, as its target)."""
    from sglang_m3.tiny.draft import default_draft

    return default_draft("m3-tiny-gqa")


# One chain shape for every speculative test: 3 draft tokens, 4 verify rows.
SPEC_ARGS = dict(
    speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4
)


@pytest.fixture(scope="session")
def server_url(tiny_vl, tmp_path_factory):
    """``python -m sglang.launch_server`` on the tiny checkpoint; yields the OpenAI root URL."""
    yield from _serve(tiny_vl, tmp_path_factory, ["--enable-cache-report"])


@pytest.fixture(scope="session")
def spec_server_url(tiny_vl, tiny_draft, tmp_path_factory):
    """The same, serving through sglang-m3's EAGLE3 chain worker with the tiny draft."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SPEC_ARGS.items()]
    yield from _serve(tiny_vl, tmp_path_factory, [*flags, f"--speculative-draft-model-path={tiny_draft}"])


def _serve(model, tmp_path_factory, extra: list[str]):
    """Start a server detached (its own session and process group), so that no engine stopped in
    the test process takes it down, and stopping it takes its whole group."""
    import os
    import shlex
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--disable-cuda-graph",
        "--max-total-tokens",
        "8192",
        "--sleep-on-idle",
        "--log-level",
        "warning",
        *extra,
    ]
    launcher = f"setsid {shlex.join(cmd)} > {shlex.quote(str(log))} 2>&1 < /dev/null & echo $!"
    pid = int(subprocess.run(["sh", "-c", launcher], capture_output=True, text=True, check=True).stdout)

    def alive() -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    try:
        deadline = time.time() + 240
        while True:
            if not alive():
                raise RuntimeError(f"server exited:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server did not come up in 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
            try:
                os.killpg(pid, sig)  # setsid made the server its own process group
            except ProcessLookupError:
                break
            end = time.time() + wait
            while alive() and time.time() < end:
                time.sleep(0.5)
