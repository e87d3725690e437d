"""``python -m sglang_m3.tiny build DIR [--name N] [--variant vl|text] [--seed S]``, ``path [--name N]``,
``build-draft DIR [--target TARGET_DIR] [--seed S]`` or ``draft-path [--name m3-tiny|m3-tiny-gqa]``."""

from __future__ import annotations

import argparse

from .build import build_checkpoint, default_checkpoint
from .configs import DRAFT_TARGETS, TINY_CONFIGS
from .draft import build_draft, default_draft


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_m3.tiny", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="write a tiny MiniMax-M3 checkpoint into DIR")
    build.add_argument("dir")
    path = sub.add_parser("path", help="print the cached checkpoint's path, building it on first use")
    for p in (build, path):
        p.add_argument("--name", default="m3-tiny", choices=sorted(TINY_CONFIGS))
        p.add_argument("--variant", default="vl", choices=["vl", "text"])
    build.add_argument("--seed", type=int, default=0)
    build_draft_cmd = sub.add_parser("build-draft", help="distil a tiny EAGLE3 draft for a tiny M3 into DIR")
    build_draft_cmd.add_argument("dir")
    build_draft_cmd.add_argument("--target", help="the tiny M3 checkpoint (default: the cached m3-tiny)")
    build_draft_cmd.add_argument("--seed", type=int, default=0)
    draft_path = sub.add_parser("draft-path", help="print the cached draft's path, building it on first use")
    draft_path.add_argument("--name", default="m3-tiny", choices=DRAFT_TARGETS)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        print(build_checkpoint(args.dir, args.name, args.variant, args.seed))
    elif args.cmd == "path":
        print(default_checkpoint(args.name, args.variant))
    elif args.cmd == "build-draft":
        print(build_draft(args.dir, args.target or default_checkpoint("m3-tiny", "vl"), args.seed))
    else:
        print(default_draft(args.name))


if __name__ == "__main__":
    main()
