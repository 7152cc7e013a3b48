"""One top-K + lse call on peaked bf16 draft logits [bs, 15, 163840], for a profiler (ncu / nsys) to time
kernel by kernel: two warm-up calls first, then ``--calls`` profiled ones. Used by device/device_ncu.sh.

    python benchmarks/profile_topk.py [--bs 32] [--k 64] [--impl histogram] [--calls 1]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import topk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--impl", default="histogram")
    p.add_argument("--calls", type=int, default=1)
    a = p.parse_args(argv)
    logits = peaked_logits(a.bs, 15, 163840, seed=a.bs)
    ws = topk.TopKWorkspace(a.bs * 15, 163840, a.k, "cuda", impl=a.impl)
    for _ in range(2 + a.calls):
        topk.topk_logprobs(logits, a.k, workspace=ws)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
