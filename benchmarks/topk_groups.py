"""Histogram top-K + logsumexp: one group per thread (8192-column chunks) against two (``*_g2``, 16384-column
chunks), same run, on peaked bf16 draft logits [bs, 15, 163840]; each a replayed CUDA graph of one
``topk_logprobs`` call. Also what the launcher picks by default (``topk.HIST_G2_MIN_BLOCKS``) and the HBM floor
(the logits' bytes over the measured copy bandwidth).

    python benchmarks/topk_groups.py [--batches 1 8 16 32 64] [--ks 64 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from sglang_kdtree.cli.bench_timing import copy_bandwidth, floor_us, graph_replay_us

NEVER = 1 << 62


def main(argv=None) -> int:
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import topk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[64, 512])
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    default = topk.HIST_G2_MIN_BLOCKS
    rows = []
    for bs in a.batches:
        x = peaked_logits(bs, a.depth, a.vocab, seed=bs)
        n = bs * a.depth
        for k in a.ks:
            ws = topk.TopKWorkspace(n, a.vocab, k, "cuda", impl="histogram")
            out = (torch.empty(n * k, device="cuda"), torch.empty(n * k, dtype=torch.int64, device="cuda"))
            flag = topk.new_error_flag("cuda")
            row = {"bs": bs, "k": k, "floor_us": floor_us(x.numel() * 2, bw)}
            ids = {}
            for name, thr in (("one group", NEVER), ("two groups", 0), ("default", default)):
                topk.HIST_G2_MIN_BLOCKS = thr
                try:
                    fn = lambda: topk.topk_logprobs(x, k, workspace=ws, out=out, error_flag=flag)
                    ids[name] = fn()[1].clone()
                    row[name] = graph_replay_us(fn, trials=5)
                finally:
                    topk.HIST_G2_MIN_BLOCKS = default
            assert torch.equal(ids["one group"], ids["two groups"]), f"bs {bs} k {k}: the two kernels differ"
            assert int(flag.item()) == 0
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| bs | K | one group us | two groups us | ratio | default us | floor us | % floor (best) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = min(r["one group"], r["two groups"])
        print(f"| {r['bs']} | {r['k']} | {r['one group']:.1f} | {r['two groups']:.1f} | "
              f"{r['one group'] / r['two groups']:.2f}x | {r['default']:.1f} | {r['floor_us']:.1f} | "
              f"{100 * r['floor_us'] / best:.0f} % |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
