"""Command line: ``python -m sglang_kdtree {doctor,bench}`` (``python -m sglang_kdtree <command> --help``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m sglang_kdtree", description="sglang-kdtree tools")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", add_help=False,
                   help="check what can break a deployment (SGLang version, plugin and patches, CuPy/GPU, kernel "
                        "compile, optionally the checkpoints); exits 1 naming the fix")
    sub.add_parser("bench", add_help=False,
                   help="isolated benchmark of the tree pipeline (CPU reference; GPU kernels where present)")
    args = p.parse_args(argv[:1])  # the command; its own parser reads the rest
    rest = argv[1:]
    if args.command == "doctor":
        from sglang_kdtree.cli.doctor import main as doctor_main

        return doctor_main(rest)
    from sglang_kdtree.cli.bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
