"""GPU part of ``python -m sglang_kdtree bench``: the service's CPU tree path against our GPU path, stage by
stage, plus SGLang's ``build_tree_kernel_efficient`` for the mask/positions/links step and the top-K
physical floor. ``python -m sglang_kdtree.cli.bench_gpu`` prints the table on its own.

CPU path (what a heapq service does): torch top-K + logsumexp on the GPU, copy to host, Python heapq per
request (``reference.build_tree``), numpy visibility + FULL_MASK (``reference.verify_inputs``), copy back.
GPU path: ``TreeBuilder`` (top-K+lse kernel, best-first tree kernel, verify-inputs kernels), eager and as a
replayed CUDA graph.
"""

from __future__ import annotations

import functools

import numpy as np

from sglang_kdtree.cli.bench_timing import capture_graph, copy_bandwidth, cpu_time_us, cuda_time_us, floor_us

__all__ = ["run_gpu_bench", "peaked_logits", "format_table"]

#: the table's GPU timer: median of 20 CUDA-event-timed calls after 3 warm-up calls
_gpu_us = functools.partial(cuda_time_us, trials=20, warmup=3)


def peaked_logits(bs, depth, vocab, seed=0):
    """bf16 draft logits with a Zipf-like, temperature-scaled profile: logit of the token of rank r is
    ``-a * log(r + 1) / T`` plus log-normal jitter, tokens shuffled per row; the top token holds ~30-70%."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = bs * depth
    r = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    temp = 0.6 + 0.8 * torch.rand(rows, 1, device="cuda", generator=g)
    base = -1.2 * torch.log(r)[None, :] / temp
    jitter = 0.3 * torch.randn(rows, vocab, device="cuda", generator=g)
    x = base + jitter
    perm = torch.argsort(torch.rand(rows, vocab, device="cuda", generator=g), dim=1)
    out = torch.empty_like(x)
    out.scatter_(1, perm, x)
    return (out + 8.0).to(torch.bfloat16).view(bs, depth, vocab)


def _eagle_abi(trees_np, budget):
    """Our tree in SGLang's EAGLE lineage ABI (parent_list / selected_index) so build_tree_kernel_efficient
    builds the same mask: node j's candidate id = slot(parent) * topk + (child order), slot(root) = 0."""
    bs, width = trees_np.tokens.shape
    tree_budget = width - 1  # rows besides the root
    fan = 1
    for b in range(bs):
        n = int(trees_np.num_nodes[b])
        if n:
            fan = max(fan, int(np.bincount(trees_np.parents[b, 1: n + 1]).max()))
    depth = max(2, int(trees_np.depths.max()))
    internal = tree_budget
    topk = max(fan, -(-internal // (depth - 1)))
    width_pl = topk * (depth - 1) + 1
    parent_list = np.zeros((bs, width_pl), dtype=np.int64)
    selected = np.zeros((bs, tree_budget), dtype=np.int64)
    for b in range(bs):
        n = int(trees_np.num_nodes[b])
        slot_of = {0: 0}
        next_slot = 1
        child_count = {}
        cand = {}
        for i in range(1, n + 1):
            p = int(trees_np.parents[b, i])
            if p not in slot_of:
                slot_of[p] = next_slot
                parent_list[b, next_slot] = cand[p]
                next_slot += 1
            c = child_count.get(p, 0)
            child_count[p] = c + 1
            cand[i] = slot_of[p] * topk + c
            selected[b, i - 1] = cand[i]
        for i in range(n + 1, width):  # padding: distinct root children beyond every real id
            selected[b, i - 1] = 10**12 + i
    return parent_list, selected, topk, depth


def run_gpu_bench(batches=(1, 8, 32, 64), budgets=(16, 64, 256, 512), depth=15, vocab=163840, progress=None):
    """One row per (batch, budget): CPU-path stages, GPU stages, SGLang's mask/links kernel, floor.

    Times are microseconds (GPU: CUDA events, median of 20 after warm-up; CPU: perf_counter median of 3).
    """
    import torch

    from sglang_kdtree.gpu.tree import TreeBuilder

    bw = copy_bandwidth()
    sgl_build, sgl_error, uno_error = _sglang_tree_kernels()
    rows_out = []
    for bs in batches:
        logits = peaked_logits(bs, depth, vocab, seed=bs)
        rng = np.random.default_rng(bs)
        seq_np = rng.integers(256, 1024, size=bs).astype(np.int64)
        seq = torch.from_numpy(seq_np).cuda()
        seq_sum = int(seq_np.sum())
        roots = torch.arange(bs, device="cuda", dtype=torch.int64)
        for budget in budgets:
            width = budget + 1
            builder = TreeBuilder(bs, budget, depth, vocab, "cuda", max_mask_bytes=seq_sum * width + width * width * bs)
            row = {"batch": bs, "budget": budget, "depth": depth, "vocab": vocab}
            cpu_trees = _time_cpu_path(row, logits, budget, roots, seq_np)
            graph, trees, g_trees, g_ver = _time_gpu_path(row, builder, logits, budget, roots, seq, seq_sum)
            row["same_tree_as_cpu"] = bool(np.array_equal(g_trees.tokens.cpu().numpy(), cpu_trees.tokens))
            row["speedup_e2e"] = row["cpu_total_us"] / row["gpu_e2e_graph_us"]
            row["topk_floor_us"] = floor_us(logits.numel() * 2, bw)
            row["topk_bw_frac"] = row["topk_floor_us"] / row["gpu_topk_us"]
            row["copy_bw_TBps"] = bw / 1e12
            if sgl_build is not None:
                _time_sglang_mask(row, sgl_build, cpu_trees, g_ver, seq, seq_sum, width)
                row["gpu_verify_fill_us"] = _gpu_us(lambda: builder.verify_inputs(trees, seq, seq_sum))
            else:
                row["sglang_mask_us"] = None
                row["sglang_error"] = sgl_error
            row["uno_error"] = uno_error
            # the fp32 verify logits it needs are bs * (B+1) * V * 4 bytes: skip the largest grid points
            row["worker_eager_us"] = (
                _gpu_us(worker_round_fn(bs, budget, depth, vocab, logits, seq, seq_sum, roots))
                if bs * (budget + 1) * vocab * 4 <= 8 << 30 else float("nan"))
            rows_out.append(row)
            if progress:
                progress(row)
            del builder, graph
            torch.cuda.empty_cache()
    return rows_out


def _sglang_tree_kernels():
    """(SGLang's build_tree_kernel_efficient or None, why not, why its UNO tree builder does not import)."""
    try:
        from sglang.kernels.ops.speculative.tree import build_tree_kernel_efficient as sgl_build
    except Exception as exc:  # the JIT wheels are absent
        sgl_build, sgl_error = None, f"{type(exc).__name__}: {exc}"
    else:
        sgl_error = None
    try:
        import sglang.kernels.ops.speculative.uno_tree  # noqa: F401

        uno_error = None
    except Exception as exc:
        uno_error = f"{type(exc).__name__}: {exc}"
    return sgl_build, sgl_error, uno_error


def _time_cpu_path(row, logits, budget, roots, seq_np):
    """The heapq service's stages into ``row`` (``cpu_*_us``); returns its trees (numpy)."""
    import torch

    from sglang_kdtree import reference as ref

    bs = logits.shape[0]
    state = {}

    def torch_topk():
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        v, i = torch.topk(x, budget, dim=-1)
        state["lp"], state["ids"] = v - lse, i

    row["cpu_topk_us"] = cuda_time_us(torch_topk, trials=10, warmup=3)
    torch.cuda.synchronize()

    def d2h():
        state["lp_np"] = state["lp"].cpu().numpy()
        state["ids_np"] = state["ids"].cpu().numpy()

    row["cpu_d2h_us"] = cpu_time_us(d2h)
    roots_np = roots.cpu().numpy()
    reps = 1 if bs * budget >= 8192 else 3

    def heap():
        state["trees"] = ref.build_trees(state["lp_np"], state["ids_np"], budget, roots_np)

    row["cpu_heapq_us"] = cpu_time_us(heap, reps)

    def mask():
        state["ver"] = ref.verify_inputs(state["trees"], seq_np)

    row["cpu_mask_us"] = cpu_time_us(mask, reps)

    def h2d():
        v = state["ver"]
        for a in (v.input_ids, v.positions, v.full_mask, v.retrieve_index, v.retrieve_next_token,
                  v.retrieve_next_sibling):
            torch.from_numpy(a).cuda(non_blocking=False)
        torch.cuda.synchronize()

    row["cpu_h2d_us"] = cpu_time_us(h2d)
    row["cpu_total_us"] = sum(row[k] for k in ("cpu_topk_us", "cpu_d2h_us", "cpu_heapq_us", "cpu_mask_us",
                                                "cpu_h2d_us"))
    return state["trees"]


def _time_gpu_path(row, builder, logits, budget, roots, seq, seq_sum):
    """``TreeBuilder``'s stages, eager and as one replayed graph, into ``row`` (``gpu_*_us``); returns
    (the graph, the eager trees, the graph's trees and verify inputs)."""
    import torch

    lp, ids = builder.topk(logits, budget)
    row["gpu_topk_us"] = _gpu_us(lambda: builder.topk(logits, budget))
    trees = builder.build(lp, ids, budget, roots)
    row["gpu_tree_us"] = _gpu_us(lambda: builder.build(lp, ids, budget, roots))
    row["gpu_verify_us"] = _gpu_us(lambda: builder.verify_inputs(trees, seq, seq_sum))
    row["gpu_e2e_eager_us"] = _gpu_us(lambda: builder.round(logits, budget, roots, seq, seq_sum))
    graph, (g_trees, g_ver) = capture_graph(lambda: builder.round(logits, budget, roots, seq, seq_sum))
    row["gpu_e2e_graph_us"] = _gpu_us(graph.replay)
    torch.cuda.synchronize()
    builder.check()
    return graph, trees, g_trees, g_ver


def _time_sglang_mask(row, sgl_build, cpu_trees, g_ver, seq, seq_sum, width):
    """SGLang's mask/positions/links kernel on the same tree (EAGLE ABI) into ``row`` (``sglang_mask_*``)."""
    import torch

    bs = seq.shape[0]
    parent_list, selected, topk_e, depth_e = _eagle_abi(cpu_trees, width - 1)
    pl = torch.from_numpy(parent_list).cuda()
    sel = torch.from_numpy(selected).cuda()
    mask_buf = torch.ones(seq_sum * width + width * width * bs, dtype=torch.bool, device="cuda")
    pos = torch.empty(bs * width, dtype=torch.int64, device="cuda")
    rbuf = torch.full((3, bs, width), -1, dtype=torch.int64, device="cuda")

    def sgl():
        rbuf.fill_(-1)
        mask_buf.fill_(True)
        sgl_build(pl, sel, seq, mask_buf, pos, rbuf[0], rbuf[1], rbuf[2], topk_e, depth_e, width, 0)

    row["sglang_mask_us"] = _gpu_us(sgl)
    row["sglang_mask_same"] = bool(torch.equal(mask_buf, g_ver.full_mask) and torch.equal(pos, g_ver.positions))


def worker_round_fn(bs, budget, depth, vocab, logits, seq, seq_sum, roots, hidden_size=7168):
    """The bookkeeping a CUDA server's round runs, as ``KDTreeWorker._tree_round`` calls it: the reserved
    ``pipeline.GpuBackend`` (grow-only buffers, bf16 draft logits as they are), eager: top-K -> tree ->
    verify inputs, then greedy accept on fp32 verify logits, commit plan and the accepted hidden rows
    (Kimi's hidden size). Not included: the KV compaction (it needs a pool; see the compaction section) and
    the round's end-of-round host read of the error flags."""
    import torch

    from sglang_kdtree.round.pipeline import GpuBackend, RoundShape, bookkeeping_round

    width = budget + 1
    backend = GpuBackend("cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    target = torch.randn((bs, width, vocab), device="cuda", generator=g)
    hidden = torch.randn((bs * width, hidden_size), device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.arange(bs * width, device="cuda", dtype=torch.int64).view(bs, width)

    def round_():
        bookkeeping_round(backend, logits, RoundShape(budget, width, depth, vocab), roots, seq, seq_sum, target, slots,
                          hidden)

    round_()  # sizes the buffers and compiles, as the server's startup rehearsal does
    return round_


def format_table(rows) -> str:
    head = (f"{'bs':>3} {'B':>4} | {'torch topk':>10} {'d2h':>7} {'heapq':>9} {'mask':>9} {'h2d':>7} {'CPU tot':>9} | "
            f"{'topk':>7} {'%floor':>6} {'tree':>7} {'verify':>7} {'e2e':>7} {'graph':>7} {'x':>6} | "
            f"{'sgl mask':>8} {'same':>4} | {'worker':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sg = f"{r['sglang_mask_us']:8.1f}" if r.get("sglang_mask_us") is not None else f"{'n/a':>8}"
        lines.append(
            f"{r['batch']:>3} {r['budget']:>4} | {r['cpu_topk_us']:10.1f} {r['cpu_d2h_us']:7.1f} {r['cpu_heapq_us']:9.0f} "
            f"{r['cpu_mask_us']:9.0f} {r['cpu_h2d_us']:7.0f} {r['cpu_total_us']:9.0f} | {r['gpu_topk_us']:7.1f} "
            f"{100 * r['topk_bw_frac']:5.0f}% {r['gpu_tree_us']:7.1f} {r['gpu_verify_us']:7.1f} "
            f"{r['gpu_e2e_eager_us']:7.1f} {r['gpu_e2e_graph_us']:7.1f} {r['speedup_e2e']:6.0f} | {sg} "
            f"{str(r.get('sglang_mask_same', '-'))[:4]:>4} | {r.get('worker_eager_us', float('nan')):7.1f}"
        )
    if rows:
        lines.append(f"times in us; %floor = (bf16 logits bytes / copy bandwidth {rows[0]['copy_bw_TBps']:.2f} TB/s) "
                     "/ topk time; x = CPU total / GPU graph e2e; worker = the server round's bookkeeping as the worker "
                     "runs it (reserved GpuBackend, eager: top-K .. verify inputs + accept + commit plan + hidden rows)")
        if rows[0].get("uno_error"):
            lines.append(f"UNO builder (uno_tree.py) not run: {rows[0]['uno_error']}")
        if rows[0].get("sglang_error"):
            lines.append(f"SGLang build_tree_kernel_efficient not run: {rows[0]['sglang_error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    rows = run_gpu_bench(a.batches, a.budgets, a.depth, a.vocab,
                         progress=lambda r: print(json.dumps(r), flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
