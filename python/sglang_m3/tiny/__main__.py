"""``python -m sglang_m3.tiny build DIR [--name N] [--variant vl|text] [--seed S]``, or ``path [--name N]``."""

from __future__ import annotations

import argparse

from .build import build_checkpoint, default_checkpoint
from .configs import TINY_CONFIGS


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
    args = parser.parse_args(argv)
    if args.cmd == "build":
        print(build_checkpoint(args.dir, args.name, args.variant, args.seed))
    else:
        print(default_checkpoint(args.name, args.variant))


if __name__ == "__main__":
    main()
