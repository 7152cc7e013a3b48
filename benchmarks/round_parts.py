"""Where the GPU round's bookkeeping time goes, kernel by kernel, at a server's shapes.

    python benchmarks/round_parts.py --batches 1 8 32 --budget 64 --hidden 256 [--json OUT.json] [--trace] [--ab]
        [--ab-pdl]

The worker's two step graphs (``GpuBackend.tree_step`` and ``accept_commit_greedy``, the path a CUDA server
with graphs takes: ``gpu/round_graphs.py``) are timed as the server calls them (input copies + replay) and as
bare replays of the captured graphs (device time only), and
each of their parts is captured and replayed alone: the draft head GEMM (the drafter's lm_head: part of the
draft, not of the bookkeeping), top-K + logsumexp, the best-first tree, the verify inputs, the fused tree +
verify launch the tree step takes (``GpuBackend.build_verify``), the greedy accept, the commit plan, the KV
compaction (an SGLang ``MLATokenToKVPool`` of ``--layers`` layers) and the hidden-row gather. Times are the
median of CUDA-event-timed replays (device time, no host); the floor column is the part's bytes over the measured
copy bandwidth. Target logits are fp32 ``[bs, N, V]`` whose argmax follows a tree child
with probability ``--agree`` (a realistic accept length). Needs a CUDA GPU and SGLang (for the pool class).

``--trace`` also prints, per step graph, its kernels as the replays run them (torch.profiler's CUPTI kernel
records, no serialisation): per kernel the median duration and the median idle gap before it (from the
previous kernel's end, or the replay's first kernel's start), and the replay's span from first start to last
end. The gaps are the dependent-launch latencies inside a graph that fusing kernels would save.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from sglang_kdtree.cli.bench_timing import capture_graph, cuda_time_us
from sglang_kdtree.state import RoundShape


def _graph_time(fn, iters: int = 30) -> float:
    """Median device microseconds of one replay of ``fn`` captured in a CUDA graph (after a warm-up call that
    compiles and sizes outside the capture)."""
    graph, _ = capture_graph(fn)
    return _time(graph.replay, iters)


def _time(fn, iters: int = 30) -> float:
    """Median device microseconds of ``fn()`` (3 warm-up calls, CUDA events: the bench CLI's timer)."""
    return cuda_time_us(fn, trials=iters, warmup=3)


def _host_us(fn, iters: int = 40) -> float:
    """Median host microseconds to issue ``fn()`` on an idle GPU (a synchronize before each call, none inside
    the timing): what a host-paced server's GPU waits for."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _tree_step_host_split(call, iters: int = 40) -> tuple[float, float]:
    """Median host microseconds of the worker's tree-step call ``call(mark)``: (whole call, from ``mark()``,
    which the step calls once the head GEMM is issued, to the call's return). The second is the host work the
    GPU waits for when the GEMM ends before it (a host-paced server)."""
    import statistics
    import time

    whole, after = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        marked = []
        t0 = time.perf_counter()
        call(lambda: marked.append(time.perf_counter()))
        t1 = time.perf_counter()
        whole.append((t1 - t0) * 1e6)
        after.append((t1 - marked[0]) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(whole), statistics.median(after)


def _replay_time(graphs) -> float:
    """Median device microseconds of one replay of the step graph ``graphs`` captured last (nan if none)."""
    if not graphs._graphs:
        return float("nan")
    graph, _ = list(graphs._graphs.values())[-1]
    return _time(graph.replay)


def _kernel_trace(graph, replays: int = 20) -> dict:
    """``group_kernel_records`` of ``graph``'s kernels over ``replays`` replays (CUPTI kernel records via
    torch.profiler, one synchronised replay after another)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # replays apart: each one's kernels form one group below
    return group_kernel_records([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                                 if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))],
                                replays)


def group_kernel_records(records, replays: int) -> dict:
    """``{"kernels": [(name, median us, median gap us before it)], "span": median us}`` from ``(start us, end us,
    name)`` kernel records of ``replays`` replays of one graph: sorted by start and cut into ``replays`` equal groups
    (one per replay); a kernel's gap is its start minus the latest end among the kernels before it in its replay
    (negative: it overlaps one, a concurrent branch), the first kernel's is 0; the span is a replay's last end minus
    its first start. Records that do not split evenly give one row saying so and a NaN span."""
    import statistics

    kernels = sorted(records)
    if not kernels or len(kernels) % replays:
        return {"kernels": [("(kernel records not grouped by replay: %d records)" % len(kernels), 0.0, 0.0)],
                "span": float("nan")}
    per = len(kernels) // replays
    groups = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    rows = []
    for j in range(per):
        durs = [g[j][1] - g[j][0] for g in groups]
        gaps = [g[j][0] - max(k[1] for k in g[:j]) if j else 0.0 for g in groups]
        rows.append((groups[0][j][2][:60], statistics.median(durs), statistics.median(gaps)))
    span = statistics.median(max(k[1] for k in g) - g[0][0] for g in groups)
    return {"kernels": rows, "span": span}


def _last_graph(graphs):
    return list(graphs._graphs.values())[-1][0] if graphs._graphs else None


def _pool(rows: int, layers: int):
    """An SGLang ``MLATokenToKVPool`` with only what ``compact_kv``'s table reads (as the GPU tests build it)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool.__new__(MLATokenToKVPool)
    pool.page_size, pool.layer_num, pool.k_scale_buffer = 1, layers, None
    pool.kv_buffer = [torch.randn((rows, 1, 576), device="cuda").to(torch.bfloat16) for _ in range(layers)]
    return pool


def _target(trees, vocab: int, agree: float, gen, seed: int) -> torch.Tensor:
    """fp32 target logits whose argmax at a node is its first child's token with probability ``agree`` (the
    host draws from a generator seeded with ``seed``: the same accept lengths in every run)."""
    bs, width = trees.tokens.shape
    logits = torch.randn((bs, width, vocab), device="cuda", generator=gen)
    host = torch.Generator().manual_seed(seed)
    parents, tokens = trees.parents.cpu(), trees.tokens.cpu()
    first_child = torch.full((bs, width), -1, dtype=torch.int64)
    for b in range(bs):
        for i in range(int(trees.num_nodes[b]), 0, -1):
            first_child[b, int(parents[b, i])] = i
    pick = torch.where(first_child >= 0, tokens.gather(1, first_child.clamp_min(0)),
                       torch.randint(vocab, (bs, width), generator=host))
    hit = torch.rand((bs, width), generator=host) < agree
    pick = torch.where(hit, pick, torch.randint(vocab, (bs, width), generator=host)).cuda()
    logits.scatter_add_(2, pick[:, :, None], torch.full((bs, width, 1), 40.0, device="cuda"))
    return logits


def parts(bs: int, budget: int, depth: int, vocab: int, hidden: int, layers: int, agree: float,
          trace: bool = False, fused: bool = True, pdl: bool = True) -> dict:
    from sglang_kdtree.gpu import runtime
    from sglang_kdtree.gpu import tree as gpu_tree

    gpu_tree.FUSE_VERIFY, pdl_before, runtime.PDL = fused, runtime.PDL, pdl and runtime.PDL
    try:
        out = _parts(bs, budget, depth, vocab, hidden, layers, agree, trace)
    finally:
        gpu_tree.FUSE_VERIFY, runtime.PDL = True, pdl_before
    out["variant"] = ("fused" if fused else "two launches") + ("" if pdl else ", no PDL")
    return out


def _parts(bs: int, budget: int, depth: int, vocab: int, hidden: int, layers: int, agree: float,
           trace: bool) -> dict:
    from sglang_kdtree.round import pipeline

    gen = torch.Generator(device="cuda").manual_seed(bs)
    width = budget + 1
    backend = pipeline.GpuBackend("cuda")
    seq_lens = torch.randint(64, 2048, (bs,), device="cuda", generator=gen)
    seq_sum = int(seq_lens.sum())
    backend.reserve(bs, budget, depth, vocab, mask_bytes=pipeline.full_mask_numel(seq_sum, width, bs))
    weight = (torch.randn((vocab, hidden), device="cuda", generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    rows = torch.randn((bs * depth, hidden), device="cuda", generator=gen).to(torch.bfloat16) * 4
    roots = torch.randint(vocab, (bs,), device="cuda", generator=gen)
    k = min(budget, vocab)
    out: dict = {"bs": bs}

    # the server's call: input copies + one replay (the first two calls run eagerly and capture)
    shape = RoundShape(budget, width, depth, vocab)
    for _ in range(2):
        step = backend.tree_step(rows, weight, shape, roots, seq_lens, seq_sum)
    trees, verify, draft_logits = step.trees, step.verify, step.draft_logits
    out["tree_step graph"] = _time(lambda: backend.tree_step(rows, weight, shape, roots, seq_lens, seq_sum))
    # the captured graph alone (top-K -> tree -> verify inputs): the device time when the host runs ahead, as in
    # a server whose host queues the step while the GPU still runs the draft forward
    out["tree graph replay"] = _replay_time(backend._tree_graphs)
    out["tree_step host"], out["tree_step host after GEMM"] = _tree_step_host_split(
        lambda mark: backend.tree_step(rows, weight, shape, roots, seq_lens, seq_sum, mark=mark))
    if backend._tree_graphs._graphs:
        out["replay host"] = _host_us(_last_graph(backend._tree_graphs).replay)
    if trace:
        out["trace tree graph"] = _kernel_trace(_last_graph(backend._tree_graphs))
    logits = torch.empty((bs * depth, vocab), device="cuda", dtype=torch.bfloat16)
    out["head GEMM"] = _graph_time(lambda: torch.matmul(rows, weight.t(), out=logits))
    lg3 = logits.view(bs, depth, vocab)
    out["top-K"] = _graph_time(lambda: backend.topk(lg3, k))
    lp, ids = backend.topk(lg3, k)
    lp, ids = lp.clone(), ids.clone()
    out["tree"] = _graph_time(lambda: backend.build(lp, ids, budget, roots))
    trees = backend.build(lp, ids, budget, roots)
    out["verify inputs"] = _graph_time(lambda: backend.verify_inputs(trees, seq_lens, seq_lens_sum=seq_sum))
    out["tree + verify"] = _graph_time(lambda: backend.build_verify(lp, ids, budget, roots, seq_lens, seq_sum))

    target = _target(trees, vocab, agree, gen, seed=bs)
    hidden_rows = torch.randn((bs * width, 7168), device="cuda", generator=gen).to(torch.bfloat16)
    pool = _pool(bs * width * 2 + 64, layers)
    slots = torch.randperm(bs * width * 2, device="cuda", generator=gen)[: bs * width].view(bs, width)
    for _ in range(2):
        acc, plan, _rows = backend.accept_commit_greedy(trees, target, depth, slots, pool, hidden_rows, width,
                                                        graph=True)
    out["accept_commit graph"] = _time(lambda: backend.accept_commit_greedy(trees, target, depth, slots, pool,
                                                                            hidden_rows, width, graph=True))
    out["accept_commit graph replay"] = _replay_time(backend._commit_graphs)
    out["accept_commit host"] = _host_us(lambda: backend.accept_commit_greedy(trees, target, depth, slots, pool,
                                                                              hidden_rows, width, graph=True))
    if trace:
        out["trace accept_commit graph"] = _kernel_trace(_last_graph(backend._commit_graphs))
    out["accept len"] = float(acc.accept_lens.float().mean())
    out["accept"] = _graph_time(lambda: backend.accept_greedy(trees, target, depth))
    acc = backend.accept_greedy(trees, target, depth)
    lens = acc.accept_lens.to(torch.int64)
    out["commit plan"] = _graph_time(lambda: backend.commit_plan(acc.accepted, lens, slots))
    plan = backend.commit_plan(acc.accepted, lens, slots)
    out["KV compaction"] = _graph_time(lambda: backend.commit_kv(pool, plan))
    out["hidden gather"] = _graph_time(lambda: backend.gather_hidden(hidden_rows, plan, width))
    out["errors"] = int(backend.tree_errors.item()) | int(backend.commit_errors.item())
    out["bookkeeping (calls)"] = out["tree_step graph"] - out["head GEMM"] + out["accept_commit graph"]
    out["bookkeeping (replays)"] = out["tree graph replay"] + out["accept_commit graph replay"]
    return out


COLUMNS = ["tree_step graph", "tree graph replay", "head GEMM", "top-K", "tree", "verify inputs", "tree + verify",
           "accept_commit graph", "accept_commit graph replay", "accept", "commit plan", "KV compaction",
           "hidden gather", "bookkeeping (calls)", "bookkeeping (replays)", "tree_step host",
           "tree_step host after GEMM", "replay host", "accept_commit host", "accept len"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--hidden", type=int, default=256, help="draft head width (the Kimi-shaped target's: 256)")
    ap.add_argument("--layers", type=int, default=3, help="MLA KV layers moved by the compaction")
    ap.add_argument("--agree", type=float, default=0.75)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true", help="also print each step graph's kernels and the gaps")
    ap.add_argument("--ab", action="store_true",
                    help="each batch twice: the tree and verify inputs fused into one launch (the worker's path), "
                         "and as the two launches it replaced (gpu.tree.FUSE_VERIFY off)")
    ap.add_argument("--ab-pdl", action="store_true",
                    help="each batch twice: the top-K select and the tree kernel as programmatic dependent launches "
                         "(the worker's path on sm_90+) and as plain launches (gpu.runtime.PDL off)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("round_parts needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [parts(bs, args.budget, args.depth, args.vocab, args.hidden, args.layers, args.agree, args.trace, fused,
                  pdl)
            for bs in args.batches for fused in ((True, False) if args.ab else (True,))
            for pdl in ((True, False) if args.ab_pdl else (True,))]
    import sglang_kdtree

    print(f"sglang_kdtree from {sglang_kdtree.__file__}")
    print(f"us, median of replays; budget {args.budget}, depth {args.depth}, vocab {args.vocab}, "
          f"head width {args.hidden}, {args.layers} MLA layers; bookkeeping (calls) = tree_step graph - head "
          "GEMM + accept_commit graph, each timed around the worker's call on an idle GPU (host included); "
          "bookkeeping (replays) = the two captured graphs replayed alone (device only); the host columns: host "
          "microseconds to issue the call on an idle GPU (tree_step host after GEMM: from the head GEMM's issue "
          "to the call's return; replay host: one bare graph.replay())")
    print("| bs | tree + verify launches | " + " | ".join(COLUMNS) + " | errors |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for r in rows:
        print(f"| {r['bs']} | {r['variant']} | " + " | ".join(f"{r.get(c, float('nan')):.1f}" if c != "accept len"
                                                              else f"{r[c]:.2f}" for c in COLUMNS)
              + f" | {r['errors']} |")
    for r in rows:
        for name in ("trace tree graph", "trace accept_commit graph"):
            if name in r:
                t = r[name]
                print(f"\nbs {r['bs']} ({r['variant']}), {name[6:]}: span {t['span']:.1f} us (first kernel start -> "
                      "last end)")
                print("| kernel | us | gap before us |\n|---|---|---|")
                for kname, dur, gap in t["kernels"]:
                    print(f"| {kname} | {dur:.1f} | {gap:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
