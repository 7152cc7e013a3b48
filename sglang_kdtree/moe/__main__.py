"""``python -m sglang_kdtree.moe``: pre-build, export or seed the Marlin MoE JIT kernels in SGLang's cache
(``$SGLANG_JIT_CACHE_DIR``), in that order: ``--seed DIR``, ``--warmup``, ``--export DIR``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

from sglang_kdtree.moe.jit import ensure_marlin_kernels, export_prebuilt, jit_cache_dir, marlin_kernels_cached
from sglang_kdtree.moe.jit import seed_prebuilt

#: (flag, argparse keywords) of every option
_OPTIONS = (
    ("--seed", dict(metavar="DIR", help="first seed the cache from modules exported with --export on another "
                                        "machine")),
    ("--warmup", dict(action="store_true",
                      help="compile (or load) the Marlin repack + MoE modules; ~6 min of nvcc when not cached")),
    ("--arch", dict(metavar="MAJOR.MINOR", help="build for this compute capability instead of the local GPU's "
                                                "(e.g. 9.0 on a build machine without a GPU; needs nvcc)")),
    ("--export", dict(metavar="DIR", help="finally copy the built modules to DIR (for --seed)")),
)


def _arch_override(arch: str | None):
    """SGLang's JIT target override for ``MAJOR.MINOR``, or a no-op without one."""
    if not arch:
        return contextlib.nullcontext()
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    major, minor = (int(v) for v in arch.split("."))
    return override_jit_cuda_arch(major, minor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kdtree.moe",
        description="Pre-build, export or seed the Marlin MoE JIT kernels (SGLang's cache: $SGLANG_JIT_CACHE_DIR).")
    for flag, options in _OPTIONS:
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    arch = _arch_override(args.arch)
    print(f"JIT cache: {jit_cache_dir()} ({'has' if marlin_kernels_cached() else 'no'} Marlin MoE build)")
    with arch:
        if args.seed:
            start = time.perf_counter()
            seeded = seed_prebuilt(args.seed)
            print(f"seeded from {args.seed}: {seeded or 'nothing (compiled instead)'} "
                  f"in {time.perf_counter() - start:.1f} s")
        if args.warmup:
            seconds = ensure_marlin_kernels("bfloat16")
            print(f"Marlin MoE kernels ready in {seconds:.1f} s")
    if args.export:
        print(f"exported to {args.export}: {export_prebuilt(args.export)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
