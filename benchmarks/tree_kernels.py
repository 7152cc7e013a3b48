"""The exact best-first tree: the sorted-list kernels (``build_trees_list1/2/4``, candidates in warp 0's
registers; what the launcher takes up to budget 256) against the shared-memory slot kernel
(``build_trees_kernel``), same run, on the top-K of peaked bf16 draft logits [bs, 15, 163840]; each a replayed
CUDA graph of one ``build_trees`` call. Also the CPU heapq path (``reference.build_trees``, the competitor the
GPU tree replaces) and the floor (the kernel's input and output bytes over the measured copy bandwidth; a
launch costs more). The two kernels' trees are checked identical, and the list's against the reference.

    python benchmarks/tree_kernels.py [--batches 1 8 32 64] [--budgets 16 64 128 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from sglang_kdtree.cli.bench_timing import copy_bandwidth, cpu_time_us, floor_us, graph_replay_us


def main(argv=None) -> int:
    import numpy as np
    import torch

    from sglang_kdtree import reference as ref
    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import topk, tree

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    default = tree.LIST_MAX_BUDGET
    rows = []
    for bs in a.batches:
        x = peaked_logits(bs, a.depth, a.vocab, seed=bs)
        roots = torch.arange(bs, dtype=torch.int64, device="cuda")
        for budget in a.budgets:
            lp, ids = topk.topk_logprobs(x, budget, check=True)
            lp, ids = lp.view(bs, a.depth, budget), ids.view(bs, a.depth, budget)
            out = tree._alloc_tree(bs, budget + 1, "cuda")
            flag = topk.new_error_flag("cuda")
            n = bs * a.depth * budget
            io_bytes = n * (4 + 8) + bs * (budget + 1) * 5 * 8
            row = {"bs": bs, "budget": budget, "kernel": tree._tree_kernel_name(budget),
                   "floor_us": floor_us(io_bytes, bw)}
            got = {}
            for name, limit in (("list", 256), ("slots", 0)):
                tree.LIST_MAX_BUDGET = limit
                try:
                    fn = lambda: tree.build_trees(lp, ids, budget, roots, out=out, error_flag=flag)
                    t = fn()
                    got[name] = [v.clone() for v in (t.tokens, t.parents, t.depths, t.ranks, t.scores, t.num_nodes)]
                    row[name] = graph_replay_us(fn, trials=5)
                finally:
                    tree.LIST_MAX_BUDGET = default
            assert all(torch.equal(u, v) for u, v in zip(got["list"], got["slots"])), f"bs {bs} B {budget}"
            assert int(flag.item()) == 0
            lp_np, ids_np, roots_np = lp.cpu().numpy(), ids.cpu().numpy(), roots.cpu().numpy()
            want = ref.build_trees(lp_np, ids_np, budget, roots_np)
            np.testing.assert_array_equal(got["list"][0].cpu().numpy(), want.tokens)
            np.testing.assert_array_equal(got["list"][1].cpu().numpy(), want.parents)
            row["cpu_heapq_us"] = cpu_time_us(lambda: ref.build_trees(lp_np, ids_np, budget, roots_np), trials=3)
            row["nodes_mean"] = float(got["list"][5].double().mean())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| bs | budget | launcher's kernel | list us | slots us | slots / list | CPU heapq us | floor us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bs']} | {r['budget']} | {r['kernel']} | {r['list']:.1f} | {r['slots']:.1f} | "
              f"{r['slots'] / r['list']:.2f}x | {r['cpu_heapq_us']:.0f} | {r['floor_us']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
