"""KV compaction of an MLA pool (61 layers x [slots, 1, 576] bf16, Kimi-K2 / DeepSeek-V3 geometry):
ours (sglang_kdtree/kernels/kv_compact.cu, all layers in one launch) vs the per-layer indexed copy of SGLang's
MLATokenToKVPool.move_kv_cache (`kv[tgt] = kv[src]` for each layer, all tau pairs) and vs the bandwidth
floor: bytes that must move (read + write of every row whose slot changes, every layer) over the
device-to-device copy bandwidth measured in the same run.

Paths: tau - 1 accepted nodes drawn uniformly from a verify window of N = 257 rows, slots a random
permutation of the pool (page size 1). Timing: CUDA events around back-to-back calls (eager) and a CUDA
graph of them (device time).

    python benchmarks/bench_compact.py [--json out.json] [--batches 1,32,128] [--taus 4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_accept import cuda_torch_or_skip, fmt, maybe_graph, measured_bandwidth, time_calls, write_rows  # noqa: E402

from sglang_kdtree.cli.bench_timing import floor_us  # noqa: E402

LAYERS = 61
ROW = 576
WIDTH = 257
SLOTS = 65536


def make_plan(bs, tau, seed=0):
    from sglang_kdtree import reference as ref

    rng = np.random.default_rng(seed + bs * 100 + tau)
    accepted = np.full((bs, 16), -1, dtype=np.int64)
    for b in range(bs):
        accepted[b, :tau] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, WIDTH), tau - 1, replace=False))])
    lens = np.full(bs, tau, dtype=np.int64)
    slots = rng.permutation(SLOTS)[: bs * WIDTH].reshape(bs, WIDTH).astype(np.int64)
    return ref.commit_plan(accepted, lens, slots)


def run_case(pool, table, bs, tau, bw):
    import torch

    from sglang_kdtree.contract import CommitPlan
    from sglang_kdtree.gpu.compact import compact_kv

    plan = make_plan(bs, tau)
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()
    gplan = CommitPlan(dev(plan.src_slots), dev(plan.dst_slots), dev(plan.hidden_rows), dev(plan.accept_lens),
                      torch.zeros(1, dtype=torch.int32, device="cuda"))
    valid = plan.src_slots >= 0
    src, tgt = dev(plan.src_slots[valid]), dev(plan.dst_slots[valid])
    moved = int((plan.src_slots != plan.dst_slots)[valid].sum())

    def ours():
        compact_kv(table, gplan)

    def sglang():
        for kv in pool:
            kv[tgt] = kv[src]

    # both apply the same permutation-free moves; check ours against torch's result once
    before = [kv.clone() for kv in pool[:2]]
    ours()
    got = [kv.clone() for kv in pool[:2]]
    for kv, b in zip(pool[:2], before):
        kv.copy_(b)
    for kv in pool[:2]:
        kv[tgt] = kv[src]
    assert all(torch.equal(a, b) for a, b in zip(got, pool[:2])), "ours differs from kv[tgt] = kv[src]"
    assert int(gplan.errors.item()) == 0
    nbytes = 2 * moved * ROW * 2 * LAYERS
    row = {"bs": bs, "tau": tau, "moved_rows": moved, "MB_moved": nbytes / 1e6}
    row["sglang_us"] = time_calls(sglang, iters=5)
    row["sglang_graph_us"] = maybe_graph(sglang)
    row["ours_us"] = time_calls(ours, iters=20)
    row["ours_graph_us"] = maybe_graph(ours)
    row["floor_us"] = floor_us(nbytes, bw)
    best = row["ours_graph_us"] or row["ours_us"]
    row["ours_pct_of_bw"] = 100 * row["floor_us"] / best
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--taus", default="4,16")
    args = ap.parse_args(argv)
    import torch

    from sglang_kdtree.gpu.compact import kv_layer_table

    bw = measured_bandwidth()
    pool = [torch.empty((SLOTS, 1, ROW), dtype=torch.bfloat16, device="cuda").normal_() for _ in range(LAYERS)]
    table = kv_layer_table(pool)
    rows = []
    for bs in [int(x) for x in args.batches.split(",")]:
        for tau in [int(x) for x in args.taus.split(",")]:
            rows.append(run_case(pool, table, bs, tau, bw))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| bs | tau | rows moved | MB moved (61 layers) | SGLang per-layer us (graph) | ours us (graph) | "
          f"speedup (graph) | floor us @ {bw / 1e12:.2f} TB/s | ours % of bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sg = r["sglang_graph_us"] or r["sglang_us"]
        og = r["ours_graph_us"] or r["ours_us"]
        print(f"| {r['bs']} | {r['tau']} | {r['moved_rows']} | {r['MB_moved']:.2f} | {r['sglang_us']:.1f} "
              f"({fmt(r['sglang_graph_us'])}) | {r['ours_us']:.1f} ({fmt(r['ours_graph_us'])}) | {sg / og:.1f}x | "
              f"{r['floor_us']:.1f} | {r['ours_pct_of_bw']:.0f}% |")
    write_rows(args.json, bw, rows)


def test_bench_compact(benchmark):
    """pytest-benchmark case (GPU only): ours, 61 layers, bs=128, tau=16."""
    torch = cuda_torch_or_skip()
    from sglang_kdtree.contract import CommitPlan
    from sglang_kdtree.gpu.compact import compact_kv, kv_layer_table

    pool = [torch.zeros((SLOTS, 1, ROW), dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    table = kv_layer_table(pool)
    plan = make_plan(128, 16)
    dev = lambda a: torch.from_numpy(a).cuda()
    gplan = CommitPlan(dev(plan.src_slots), dev(plan.dst_slots), dev(plan.hidden_rows), dev(plan.accept_lens), None)

    def call():
        compact_kv(table, gplan)
        torch.cuda.synchronize()

    benchmark(call)


if __name__ == "__main__":
    main()
