"""Greedy accept over bf16 or fp32 logits: the cluster geometry swept (blocks per request, threads, loads in flight).

``sglang_kdtree/kernels/tree_accept.cu``'s lazy greedy walk reads one vocabulary row per accepted step, split over a
cluster of GREEDY_CLUSTER blocks. A variant ``CxTxL`` is compiled with ``-D`` overrides of GREEDY_CLUSTER (C) and
GREEDY_LOADS (L) (the launch bound GREEDY_THREADS is 512, or T when larger), launched with T threads per block,
checked against ``reference.accept_greedy`` (accepted paths identical), and timed as a CUDA graph of back-to-back
calls (device time); "default" is the launcher's own choice (``gpu.accept._greedy_threads``). Trees: real best-first
trees (budget N - 1, depth 15); targets are steered down a random path per request. The floor is the rows read
(tau per request, V elements each) over the measured copy bandwidth. A CUDA server's target logits are fp32
(``--dtype fp32``).

    python benchmarks/accept_sweep.py [--batches 1,8,32,64] [--variants 8x512x4,4x512x4] [--dtype bf16|fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from sglang_kdtree import reference as ref
from sglang_kdtree.cli.bench_timing import capture_graph, copy_bandwidth, cuda_time_us, floor_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_accept import DEPTH, make_case  # noqa: E402  (bench_accept.py's trees and steered targets)

VOCAB = 163840


def variant_kernel(cluster, threads, loads, dtype="bf16"):
    from sglang_kdtree.gpu import runtime

    opts = (f"-DGREEDY_CLUSTER={cluster}", f"-DGREEDY_LOADS={loads}", f"-DGREEDY_THREADS={max(threads, 512)}")
    name = "accept_greedy_f32" if dtype == "fp32" else "accept_greedy_bf16"
    return runtime.load_module("tree_accept.cu", opts).get_function(name)


def main(argv=None):
    import torch

    from sglang_kdtree.gpu import accept as gacc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,8,12,16,24,32,64")
    ap.add_argument("--width", type=int, default=65)
    ap.add_argument("--variants", default="default,8x512x4,8x384x4,8x256x4,8x256x8")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    names = args.variants.split(",")
    rows = []
    for bs in [int(x) for x in args.batches.split(",")]:
        trees, tgt = make_case(bs, args.width)
        expect = ref.accept_greedy(trees, tgt, max_depth=DEPTH)
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()

        class G:
            tokens, parents, num_nodes = dev(trees.tokens), dev(trees.parents), dev(trees.num_nodes)

        logits = torch.empty((bs * args.width, VOCAB), dtype=dtype, device="cuda").normal_()
        logits[torch.arange(bs * args.width, device="cuda"), dev(tgt).reshape(-1)] = 10.0
        row = {"bs": bs, "tau": float(expect.accept_lens.mean()),
               "floor_us": floor_us(float(expect.accept_lens.sum()) * VOCAB * logits.element_size(), bw)}
        for name in names:
            saved = gacc._kernel, gacc._GREEDY_CLUSTER, gacc._greedy_threads
            if name != "default":  # CxTxL
                c, t, l = (int(x) for x in name.split("x"))
                fn = variant_kernel(c, t, l, args.dtype)
                gacc._kernel = lambda _name, fn=fn: fn
                gacc._GREEDY_CLUSTER, gacc._greedy_threads = c, (lambda _bs, t=t: t)
            try:
                out = gacc.accept_greedy(G, logits, DEPTH)
                ok = np.array_equal(out.accepted.cpu().numpy(), expect.accepted)
                graph = capture_graph(lambda: gacc.accept_greedy(G, logits, DEPTH, out=out), repeat=20)[0]
                row[name] = cuda_time_us(graph.replay, calls=20, trials=7, warmup=2) if ok else float("nan")
                if not ok:
                    print(f"  MISMATCH bs {bs} variant {name}")
            except Exception as exc:  # a variant that cannot launch (cluster too large) is reported, not fatal
                print(f"  bs {bs} variant {name}: {type(exc).__name__}: {str(exc)[:160]}")
                row[name] = float("nan")
            finally:
                gacc._kernel, gacc._GREEDY_CLUSTER, gacc._greedy_threads = saved
        rows.append(row)
        print(json.dumps(row), flush=True)
        del logits
        torch.cuda.empty_cache()
    print(f"\n{args.dtype} logits")
    print("\n| bs | tau | floor us | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['bs']} | {r['tau']:.2f} | {r['floor_us']:.1f} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
