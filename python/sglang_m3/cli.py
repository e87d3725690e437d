"""``sglang-m3``: the embedded-default demo and checkpoint helper.

``sglang-m3 demo`` builds (once, cached) the tiny MiniMax-M3 checkpoint and serves
a batch through stock ``sglang.Engine`` with this plugin: a short prompt and one
past the sparse-attention threshold, on CUDA when present, else CPU.
``sglang-m3 tiny-path`` prints the cached checkpoint's path (for
``python -m sglang.launch_server --model-path ...``; ``--fp8-block``: its block-FP8 copy);
``sglang-m3 draft-path`` prints the cached tiny EAGLE3 draft's path (``--speculative-draft-model-path``).
``sglang-m3 capacity`` prints weights per rank and KV token capacity for a config (default: the released M3).
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    # Past the tiny model's sparse threshold (block 16 x top-4 = 64 tokens): MSA drops blocks here.
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. " * 8,
]


def demo(args) -> int:
    import sglang as sgl
    import torch

    from .tiny import default_checkpoint

    path = default_checkpoint(args.name, args.variant)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"checkpoint: {path}\ndevice: {device}")
    engine = sgl.Engine(
        model_path=str(path),
        device=device,
        dtype="float32",
        disable_cuda_graph=True,
        log_level="warning",
        max_total_tokens=8192,
    )
    try:
        start = time.perf_counter()
        outs = engine.generate(PROMPTS, {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True})
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = 0
    for prompt, out in zip(PROMPTS, outs):
        meta = out["meta_info"]
        tokens += meta["completion_tokens"]
        print(f"\nprompt ({meta['prompt_tokens']} tokens): {prompt[:60]!r}...")
        print(f"output ({meta['completion_tokens']} tokens, random tiny weights): {out['text']!r}")
    print(f"\n{tokens} tokens in {elapsed:.2f} s through sglang.Engine + sglang-m3 (m3_msa backend)")
    return 0


def capacity(args) -> int:
    import json
    from importlib import resources

    from .config import M3Config
    from .sizing import capacity_table

    text = (
        open(args.config).read()
        if args.config
        else resources.files("sglang_m3.assets").joinpath("minimax-m3-config.json").read_text()
    )
    setups = []
    for setup in args.setups.split(","):
        tp, _, quant = setup.partition(":")
        setups.append((int(tp.removeprefix("tp")), None if quant in ("", "bf16") else quant))
    table = capacity_table(
        M3Config.from_hf(json.loads(text)), setups, args.kv_cache_dtypes.split(","), args.free_gib, args.mem_fraction
    )
    print(table)
    return 0


def main(argv=None) -> int:
    from .tiny.configs import DRAFT_TARGETS, TINY_CONFIGS

    parser = argparse.ArgumentParser(
        prog="sglang-m3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="serve the embedded tiny M3 through sglang.Engine")
    d.add_argument("--max-new-tokens", type=int, default=32)
    p = sub.add_parser("tiny-path", help="print the cached tiny checkpoint path (building it on first use)")
    for s in (d, p):
        s.add_argument("--name", default="m3-tiny", choices=sorted(TINY_CONFIGS))
        s.add_argument("--variant", default="vl", choices=["vl", "text"])
    p.add_argument(
        "--fp8-block",
        action="store_true",
        help="the block-FP8 copy instead (fp8 weights, 32x32 weight_scale_inv, quantization_config; 'vl' only)",
    )
    dp = sub.add_parser("draft-path", help="print the cached tiny EAGLE3 draft path (building it on first use)")
    dp.add_argument("--name", default="m3-tiny", choices=DRAFT_TARGETS)
    c = sub.add_parser("capacity", help="weights per rank and KV token capacity (default: the released M3)")
    c.add_argument("--config", default=None, help="an M3 config.json (default: the released one)")
    c.add_argument("--setups", default="tp8:bf16,tp4:fp8", help="comma list of tpN[:fp8]")
    c.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3,nvfp4")
    c.add_argument("--free-gib", type=float, default=139.0, help="GPU memory free before loading (H200: ~139)")
    c.add_argument("--mem-fraction", type=float, default=0.85, help="--mem-fraction-static")
    args = parser.parse_args(argv)
    if args.cmd == "capacity":
        return capacity(args)
    if args.cmd == "demo":
        return demo(args)
    if args.cmd == "draft-path":
        from .tiny.draft import default_draft

        print(default_draft(args.name))
        return 0
    if args.fp8_block:
        from .tiny.fp8 import default_fp8_checkpoint

        print(default_fp8_checkpoint(args.name, args.variant))
        return 0
    from .tiny import default_checkpoint

    print(default_checkpoint(args.name, args.variant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
