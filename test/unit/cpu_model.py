"""The tiny M3 built in this process on CPU, on SGLang's parallel state for one rank (gloo): the model's
own classes and loader, no engine. For tests of what the model builds and loads."""

from __future__ import annotations

import contextlib
import socket

import torch
from safetensors import safe_open


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@contextlib.contextmanager
def one_rank(model_path):
    """SGLang's distributed and model-parallel state for one rank, and its runtime context."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )
    parallel_state.initialize_model_parallel(1)
    runtime_context.publish(ServerArgs(model_path=str(model_path), device="cpu"), role="test")
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        runtime_context.reset_context()


def build_model(path, dtype: torch.dtype, tensors: dict[str, torch.Tensor] | None = None):
    """``MiniMaxM3ForCausalLM`` from the checkpoint at ``path`` (its ``quantization_config`` applied),
    loaded with ``tensors`` (default: the checkpoint's). Inside ``one_rank``."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    with set_default_torch_dtype(dtype):
        model = MiniMaxM3ForCausalLM(config, quant_config=qc and Fp8Config.from_config(qc))
    model.load_weights((checkpoint_tensors(path) if tensors is None else tensors).items())
    return model
