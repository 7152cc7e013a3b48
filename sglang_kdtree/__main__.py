"""Command line: ``python -m sglang_kdtree {doctor,bench}``."""

from __future__ import annotations

import argparse
import os
import sys


def doctor() -> int:
    """Report the SGLang version, whether ``kdtree`` resolves after ``load_plugins()``, and the GPU state.

    Exit status 0 when the plugin is usable by SGLang (GPU problems are reported, since CPU-only machines are
    legitimate for tests), 1 otherwise.
    """
    ok = True
    try:
        from importlib.metadata import version

        sg_version = version("sglang")
    except Exception as exc:
        print(f"sglang:            NOT INSTALLED ({exc})")
        return 1
    from sglang_kdtree import __version__

    expected = "0.5.23"
    print(f"sglang-kdtree:     {__version__}")
    print(f"sglang:            {sg_version}" + ("" if sg_version == expected else f"  (expected {expected}!)"))
    ok &= sg_version == expected
    try:
        from sglang.srt.plugins import load_plugins
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        load_plugins()
        algo = SpeculativeAlgorithm.from_string("kdtree")
        print(f"kdtree resolves:   yes ({type(algo).__module__}.{type(algo).__name__})")
    except Exception as exc:
        print(f"kdtree resolves:   NO ({type(exc).__name__}: {exc})")
        print(f"                   why: {_why_plugin_did_not_load()}")
        ok = False
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"GPU:               none ({reason}); GPU kernels unavailable, CPU reference only")
    else:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        print(f"GPU:               {props['name'].decode()} (sm_{props['major']}{props['minor']}), CuPy {cupy.__version__}")
        try:
            kernel = cupy.RawKernel(
                r'extern "C" __global__ void add_one(int* x) { x[threadIdx.x] += 1; }', "add_one"
            )
            x = cupy.arange(32, dtype=cupy.int32)
            kernel((1,), (32,), (x,))
            assert int(x.sum()) == sum(range(1, 33))
            print("kernel compile:    ok (NVRTC)")
        except Exception as exc:
            print(f"kernel compile:    FAILED ({type(exc).__name__}: {exc})")
            ok = False
    print("status:            " + ("OK" if ok else "PROBLEMS FOUND (see above)"))
    return 0 if ok else 1


def _why_plugin_did_not_load() -> str:
    """SGLang's load_plugins() only logs a failing plugin; find the cause and say it."""
    from importlib.metadata import entry_points

    if not [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kdtree"]:
        return "no 'kdtree' entry point in group sglang.srt.plugins: sglang-kdtree is not installed in this environment"
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and "kdtree" not in [name.strip() for name in allowed.split(",")]:
        return f"SGLANG_PLUGINS={allowed!r} does not list 'kdtree'"
    try:
        from sglang_kdtree import plugin

        plugin.register()
    except Exception as exc:
        return f"register() raised {type(exc).__name__}: {exc}"
    return "register() succeeds when called directly; check SGLang's log for the plugin loader's message"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m sglang_kdtree", description="sglang-kdtree tools")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the installation: SGLang version, plugin registration, GPU")
    sub.add_parser("bench", help="isolated benchmark of the tree pipeline (CPU reference; GPU where present)",
                   add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.command == "doctor":
        if rest:
            p.error(f"doctor takes no arguments, got {rest}")
        return doctor()
    from sglang_kdtree.bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
