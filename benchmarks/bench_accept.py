"""Accept walk: ours (sglang_kdtree/kernels/tree_accept.cu) vs SGLang's verify_tree_greedy (one thread per request).

Two comparisons per (batch, N):
* ids: both get the target's argmax ids [bs, N] (what verify_tree_greedy consumes);
* logits: the target's bf16 verify logits [bs*N, V=151936]: ours fuses a lazy argmax (reads only the rows on
  the accepted path); SGLang's path is torch.argmax over every row + verify_tree_greedy.
The floor of the logits path is the rows ours must read (tau per request) over the measured HBM bandwidth.

Trees are real best-first DDTree trees (reference.build_trees, budget N-1, depth 15); targets are steered
down a random path per request so walks go deep. Timing: CUDA events around 50 back-to-back calls
(eager: includes Python launch cost) and, where capture works, a CUDA graph of those 50 calls (device time).

    python benchmarks/bench_accept.py [--json out.json] [--batches 1,32,128] [--widths 17,65,257]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from sglang_kdtree import reference as ref
from sglang_kdtree.cli.bench_timing import capture_graph, copy_bandwidth, cuda_time_us, floor_us

VOCAB = 151936
DEPTH = 15


def make_case(bs, width, seed=0):
    rng = np.random.default_rng(seed + bs * 1000 + width)
    draft_vocab = 512
    lp, ids = ref.topk_logprobs(rng.normal(size=(bs, DEPTH, draft_vocab)).astype(np.float32) * 2, width - 1)
    trees = ref.build_trees(lp, ids, width - 1, rng.integers(0, draft_vocab, size=bs))
    tgt = rng.integers(0, draft_vocab, size=(bs, width)).astype(np.int64)
    for b in range(bs):
        node = int(rng.integers(1, int(trees.num_nodes[b]) + 1))
        while node > 0:
            p = int(trees.parents[b, node])
            tgt[b, p] = trees.tokens[b, node]
            node = p
    return trees, tgt


def time_calls(fn, iters=50, graph=False):
    """Microseconds per call: CUDA events around `iters` back-to-back calls (eager), or a captured graph of them
    (one warm-up pass, median of 5 timed passes)."""
    if graph:
        run = capture_graph(fn, repeat=iters)[0].replay
    else:

        def run():
            for _ in range(iters):
                fn()

    return cuda_time_us(run, calls=iters, trials=5, warmup=1)


def measured_bandwidth():
    """The device-to-device copy bandwidth in bytes/s, printed with the device's name."""
    import torch

    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  measured copy bandwidth {bw / 1e12:.2f} TB/s")
    return bw


def write_rows(path, bw, rows):
    """The rows and the bandwidth they were measured against, as JSON (nothing without ``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=1)


def cuda_torch_or_skip():
    """torch, for a pytest-benchmark case; skips the case without torch or a CUDA GPU."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def maybe_graph(fn):
    try:
        return time_calls(fn, graph=True)
    except Exception as exc:  # capture is best effort; the eager number is always reported
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        return None


def run_case(bs, width, verify_tree_greedy, bw):
    import torch

    from sglang_kdtree.gpu.accept import accept_greedy

    trees, tgt = make_case(bs, width)
    vi = ref.verify_inputs(trees, np.zeros(bs, dtype=np.int64))
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()

    class G:
        tokens, parents, num_nodes = dev(trees.tokens), dev(trees.parents), dev(trees.num_nodes)

    tgt_d = dev(tgt)
    cand, r_idx, r_next, r_sib = dev(trees.tokens), dev(vi.retrieve_index), dev(vi.retrieve_next_token), dev(vi.retrieve_next_sibling)
    spec = DEPTH + 1
    predicts = torch.empty(bs * width, dtype=torch.int32, device="cuda")
    acc_idx = torch.empty((bs, spec), dtype=torch.int32, device="cuda")
    acc_num = torch.empty(bs, dtype=torch.int32, device="cuda")

    def sglang_ids():
        verify_tree_greedy(predicts, acc_idx, acc_num, cand, r_idx, r_next, r_sib, tgt_d)

    def ours_ids():
        accept_greedy(G, tgt_d, DEPTH)

    res = accept_greedy(G, tgt_d, DEPTH)
    expect = ref.accept_greedy(trees, tgt, max_depth=DEPTH)
    assert np.array_equal(res.accept_lens.cpu().numpy(), expect.accept_lens), "ours differs from the reference"
    sglang_ids()
    assert np.array_equal(acc_num.cpu().numpy() + 1, expect.accept_lens), "verify_tree_greedy differs"
    row = {"bs": bs, "N": width, "mean_tau": float(expect.accept_lens.mean())}
    row["ids_sglang_us"] = time_calls(sglang_ids)
    row["ids_ours_us"] = time_calls(ours_ids)
    row["ids_sglang_graph_us"] = maybe_graph(sglang_ids)
    row["ids_ours_graph_us"] = maybe_graph(ours_ids)

    logits = torch.empty((bs * width, VOCAB), dtype=torch.bfloat16, device="cuda").normal_()
    flat_rows = torch.arange(bs * width, device="cuda")
    logits[flat_rows, tgt_d.reshape(-1)] = 10.0  # the steered argmax (normals stay far below 10)

    def sglang_logits():
        am = torch.argmax(logits, dim=-1).view(bs, width)
        verify_tree_greedy(predicts, acc_idx, acc_num, cand, r_idx, r_next, r_sib, am)

    def ours_logits():
        accept_greedy(G, logits, DEPTH)

    res = accept_greedy(G, logits, DEPTH)
    assert np.array_equal(res.accepted.cpu().numpy(), expect.accepted), "fused argmax differs"
    row["logits_sglang_us"] = time_calls(sglang_logits, iters=10)
    row["logits_ours_us"] = time_calls(ours_logits, iters=10)
    row["logits_sglang_graph_us"] = maybe_graph(sglang_logits)
    row["logits_ours_graph_us"] = maybe_graph(ours_logits)
    row["logits_floor_us"] = floor_us(float(expect.accept_lens.sum()) * VOCAB * 2, bw)
    del logits
    torch.cuda.empty_cache()
    return row


def fmt(x):
    return "n/a" if x is None else f"{x:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--widths", default="17,65,257")
    args = ap.parse_args(argv)
    from sglang.kernels.ops.speculative.tree import verify_tree_greedy

    bw = measured_bandwidth()
    rows = []
    for bs in [int(x) for x in args.batches.split(",")]:
        for width in [int(x) for x in args.widths.split(",")]:
            rows.append(run_case(bs, width, verify_tree_greedy, bw))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| bs | N | mean tau | ids: SGLang us | ids: ours us | speedup | graph SGLang / ours us | "
          "logits bf16 V=151936: argmax+SGLang us | ours fused us | speedup | graph argmax+SGLang / ours us | floor us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = f"{fmt(r['ids_sglang_graph_us'])} / {fmt(r['ids_ours_graph_us'])}"
        print(f"| {r['bs']} | {r['N']} | {r['mean_tau']:.2f} | {r['ids_sglang_us']:.1f} | {r['ids_ours_us']:.1f} | "
              f"{r['ids_sglang_us'] / r['ids_ours_us']:.2f}x | {g} | {r['logits_sglang_us']:.1f} | "
              f"{r['logits_ours_us']:.1f} | {r['logits_sglang_us'] / r['logits_ours_us']:.2f}x | "
              f"{fmt(r['logits_sglang_graph_us'])} / {fmt(r['logits_ours_graph_us'])} | {r['logits_floor_us']:.1f} |")
    write_rows(args.json, bw, rows)


def test_bench_accept_ids(benchmark):
    """pytest-benchmark case (GPU only): ours on ids at bs=128, N=257."""
    torch = cuda_torch_or_skip()
    from sglang_kdtree.gpu.accept import accept_greedy

    trees, tgt = make_case(128, 257)

    class G:
        tokens, parents, num_nodes = (torch.from_numpy(getattr(trees, k)).cuda() for k in ("tokens", "parents", "num_nodes"))

    t = torch.from_numpy(tgt).cuda()

    def call():
        accept_greedy(G, t, DEPTH)
        torch.cuda.synchronize()

    benchmark(call)


if __name__ == "__main__":
    main()
