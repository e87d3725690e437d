"""Server-argument declarations for M3 checkpoints, and the start-up refusals.

SGLang calls ``m3_server_overrides(server_args, hf_config)`` from its model
override registry while it resolves ``ServerArgs`` (in the launcher, before any
worker starts), so a config or flag this plugin cannot serve stops the server
with a message naming the field and the value.
"""

from __future__ import annotations

from typing import Any

from .config import M3Config, check_page_size
from .mem.layout import check_kv_cache_dtype

# ServerArgs fills these in for CPU before model overrides run, so they are not the user's choice.
_DEVICE_DEFAULT_BACKENDS = {"cpu": ("intel_amx", "torch_native")}


def m3_server_overrides(server_args: Any, hf_config: Any) -> dict:
    cfg = M3Config.from_hf(hf_config)  # refuses unsupported configs
    page_size = check_page_size(server_args.page_size, cfg.msa)
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(server_args, field, None)
        if value not in (None, "m3_msa", *_DEVICE_DEFAULT_BACKENDS.get(server_args.device, ())):
            raise ValueError(f"--{field.replace('_', '-')}={value!r}: MiniMax-M3 runs on sglang-m3's 'm3_msa' backend")
    if server_args.tp_size != 1:
        raise ValueError(f"--tp-size={server_args.tp_size}: sglang-m3 serves MiniMax-M3 with tp_size=1 only (for now)")
    check_kv_cache_dtype(server_args.kv_cache_dtype)
    if server_args.speculative_algorithm is not None:
        raise ValueError(
            f"--speculative-algorithm={server_args.speculative_algorithm!r}: not supported by sglang-m3 yet"
        )
    return {"attention_backend": "m3_msa", "page_size": page_size}
