"""Pre-build, export and seed the SGLang JIT modules a CUDA server needs for the Kimi-shaped W4A16 target.

SGLang's plain CUDA path for compressed-tensors W4A16 MoE (``CompressedTensorsWNA16MoE``:
``process_weights_after_loading`` -> ``gptq_marlin_moe_repack``; ``apply_weights`` -> ``fused_marlin_moe``)
asks SGLang's JIT for these modules, each ~6 minutes of nvcc on the GPU machine:

* ``gptq_marlin_repack`` (``sglang.kernels.ops.quantization.gptq_marlin_repack``; at load);
* ``moe_wna16_marlin`` GEMM1 (gate/up): ``_jit_moe_wna16_marlin_module(bf16, is_ep=False, has_bias=False,
  expert_ids_are_sorted=True, zero_inactive_output=False, has_inactive_prefix_count=True)``;
* ``moe_wna16_marlin`` GEMM2 (down): the same with ``zero_inactive_output=True``.

``fused_marlin_moe`` passes ``is_ep = expert_map is not None``, ``expert_ids_are_sorted =
has_inactive_prefix_count = expert_map is None`` and ``zero_inactive_output=True`` only to the second GEMM;
``moe_wna16_marlin_gemm`` forwards ``expert_ids_are_sorted and not is_ep``. Without expert parallelism
(our servers) ``expert_map`` is None, hence the two specializations above. ``--which kdtree`` adds the one
specialization ``sglang_kdtree.moe`` uses under ``SGLANG_KDTREE_MOE=marlin`` (all flags False).

Usage (CPU build machine with nvcc, no GPU; nice it, it is long):

    CUDA_HOME=/usr/local/cuda-13.0 nice python tests/e2e/prebuild_jit.py --arch 9.0 --export .jitcache/sm90a

and on the GPU machine, before starting servers (same sglang / apache-tvm-ffi sources, checked per file):

    python tests/e2e/prebuild_jit.py --seed .jitcache/sm90a

Seeding runs SGLang's own ``load_jit`` through ``sglang_kdtree.moe.jit.seed_prebuilt`` (which replaces only
the nvcc step with a verified copy); modules that do not match (another JIT target than the export records,
or other sources) are compiled normally.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

#: fused_marlin_moe's two GEMM specializations without EP:
#: (is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count)
PLAIN_GEMM1 = (False, False, True, False, True)
PLAIN_GEMM2 = (False, False, True, True, True)


def builders(which: set[str], dtype_name: str = "bfloat16") -> list[tuple[str, object]]:
    """``(label, zero-argument callable)`` for every module asked for; each callable is SGLang's own getter."""
    import torch

    from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module
    from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module

    dtype = getattr(torch, dtype_name)
    out: list[tuple[str, object]] = []
    if which & {"repack", "plain", "kdtree"}:
        out.append(("gptq_marlin_repack", _jit_gptq_marlin_repack_module))
    if "plain" in which:
        out.append((f"moe_wna16_marlin{PLAIN_GEMM1} (plain GEMM1)",
                     lambda: _jit_moe_wna16_marlin_module(dtype, *PLAIN_GEMM1)))
        out.append((f"moe_wna16_marlin{PLAIN_GEMM2} (plain GEMM2)",
                     lambda: _jit_moe_wna16_marlin_module(dtype, *PLAIN_GEMM2)))
    if "glue" in which:  # the small JIT modules fused_marlin_moe also calls (bf16 activations, int32 top-k ids)
        from sglang.kernels.ops.activation.activation import activation_module
        from sglang.kernels.ops.moe.moe_align import _jit_moe_align_module
        from sglang.kernels.ops.moe.moe_align_single_token import _jit_align_single_token_module

        out.append(("activation(bf16) (silu_and_mul)", lambda: activation_module(dtype)))
        out.append(("moe_align_block_size(int32, inactive prefix count)",
                    lambda: _jit_moe_align_module(torch.int32, True, False, False)))
        out.append(("moe_align_single_token(inactive prefix count)", lambda: _jit_align_single_token_module(True)))
    if "kdtree" in which:
        from sglang_kdtree.moe import jit

        out.append((f"moe_wna16_marlin{jit.MARLIN_SPECIALIZATION} (kdtree)", jit.marlin_module_builders(dtype_name)[1]))
    return out


def export(dest: Path) -> list[str]:
    """Copy every built module (newest build of each module name) out of SGLang's JIT cache into ``dest`` as
    ``<module>.so`` + ``<module>.deps.json``, each one's JIT target recorded in ``moe.jit.MANIFEST`` (the layout
    ``moe.jit.seed_prebuilt`` reads: ``moe.jit.export_modules``)."""
    from sglang_kdtree.moe.jit import export_modules, jit_cache_dir

    newest: dict[str, Path] = {}
    for so in jit_cache_dir().glob("*/*/build-*/deps-*/*.so"):
        name = so.stem
        if name not in newest or so.stat().st_mtime > newest[name].stat().st_mtime:
            newest[name] = so
    return sorted(export_modules([so for _, so in sorted(newest.items())], dest))


def seed(source: Path, which: set[str]) -> list[str]:
    """Seed SGLang's JIT cache from ``source`` for every module of ``which``, through
    ``moe.jit.seed_prebuilt`` given this script's builders."""
    from sglang_kdtree.moe import jit

    return jit.seed_prebuilt(source, builders=[b for _, b in builders(which)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--which", default="plain,kdtree",
                        help="comma list of repack, plain (fused_marlin_moe's 2 GEMMs), glue (its small JIT modules: "
                             "activation, moe_align, single-token align), kdtree (default: plain,kdtree)")
    parser.add_argument("--arch", metavar="MAJOR.MINOR", help="build for this compute capability (no GPU here)")
    parser.add_argument("--seed", metavar="DIR", type=Path, help="first seed SGLang's cache from DIR")
    parser.add_argument("--no-build", action="store_true", help="only seed / export; do not build what is missing")
    parser.add_argument("--export", metavar="DIR", type=Path, help="finally copy the built modules to DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    which = {w.strip() for w in args.which.split(",") if w.strip()}
    unknown = which - {"repack", "plain", "glue", "kdtree"}
    if unknown:
        parser.error(f"unknown --which entries {sorted(unknown)}")
    arch = contextlib.nullcontext()
    if args.arch:
        from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

        major, minor = (int(v) for v in args.arch.split("."))
        arch = override_jit_cuda_arch(major, minor)
    report = {}
    with arch:
        if args.seed:
            start = time.perf_counter()
            report["seeded"] = seed(args.seed, which)
            report["seed_s"] = round(time.perf_counter() - start, 1)
        if not args.no_build:
            report["built"] = {}
            for label, build in builders(which):
                start = time.perf_counter()
                build()
                report["built"][label] = round(time.perf_counter() - start, 1)
                print(f"{label}: ready in {report['built'][label]} s", flush=True)
    if args.export:
        report["exported"] = export(args.export)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
