"""GPU part of ``python -m sglang_kdtree bench``: the service's CPU tree path against our GPU path, stage by
stage, plus SGLang's ``build_tree_kernel_efficient`` for the mask/positions/links step and the top-K
physical floor. ``python -m sglang_kdtree.bench_gpu`` prints the table on its own.

CPU path (what a heapq service does): torch top-K + logsumexp on the GPU, copy to host, Python heapq per
request (``reference.build_tree``), numpy visibility + FULL_MASK (``reference.verify_inputs``), copy back.
GPU path: ``TreeBuilder`` (top-K+lse kernel, best-first tree kernel, verify-inputs kernels), eager and as a
replayed CUDA graph.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["run_gpu_bench", "peaked_logits", "copy_bandwidth", "format_table"]


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


def _time_gpu(fn, iters=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _time_cpu(fn, iters=3):
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s (read + write of 1 GiB)."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _time_gpu(lambda: b.copy_(a), iters=10)
    return 2 * a.numel() / (us * 1e-6)


def _eagle_abi(trees_np, budget):
    """Our tree in SGLang's EAGLE lineage ABI (parent_list / selected_index) so build_tree_kernel_efficient
    builds the same mask: node j's candidate id = slot(parent) * topk + (child order), slot(root) = 0."""
    bs, width = trees_np.tokens.shape
    n_nodes = width - 1
    fan = 1
    for b in range(bs):
        n = int(trees_np.num_nodes[b])
        if n:
            fan = max(fan, int(np.bincount(trees_np.parents[b, 1: n + 1]).max()))
    depth = max(2, int(trees_np.depths.max()))
    internal = n_nodes
    topk = max(fan, -(-internal // (depth - 1)))
    width_pl = topk * (depth - 1) + 1
    parent_list = np.zeros((bs, width_pl), dtype=np.int64)
    selected = np.zeros((bs, n_nodes), dtype=np.int64)
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

    from sglang_kdtree import reference as ref
    from sglang_kdtree.gpu.tree import TreeBuilder

    bw = copy_bandwidth()
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
            # --- CPU path
            state = {}

            def torch_topk():
                x = logits.float()
                lse = torch.logsumexp(x, dim=-1, keepdim=True)
                v, i = torch.topk(x, budget, dim=-1)
                state["lp"], state["ids"] = v - lse, i

            row["cpu_topk_us"] = _time_gpu(torch_topk, iters=10)
            torch.cuda.synchronize()

            def d2h():
                state["lp_np"] = state["lp"].cpu().numpy()
                state["ids_np"] = state["ids"].cpu().numpy()

            row["cpu_d2h_us"] = _time_cpu(d2h)
            roots_np = roots.cpu().numpy()
            reps = 1 if bs * budget >= 8192 else 3

            def heap():
                state["trees"] = ref.build_trees(state["lp_np"], state["ids_np"], budget, roots_np)

            row["cpu_heapq_us"] = _time_cpu(heap, reps)

            def mask():
                state["ver"] = ref.verify_inputs(state["trees"], seq_np)

            row["cpu_mask_us"] = _time_cpu(mask, reps)

            def h2d():
                v = state["ver"]
                for a in (v.input_ids, v.positions, v.full_mask, v.retrieve_index, v.retrieve_next_token,
                          v.retrieve_next_sibling):
                    torch.from_numpy(a).cuda(non_blocking=False)
                torch.cuda.synchronize()

            row["cpu_h2d_us"] = _time_cpu(h2d)
            row["cpu_total_us"] = sum(row[k] for k in ("cpu_topk_us", "cpu_d2h_us", "cpu_heapq_us", "cpu_mask_us",
                                                        "cpu_h2d_us"))
            # --- GPU path
            lp, ids = builder.topk(logits, budget)
            row["gpu_topk_us"] = _time_gpu(lambda: builder.topk(logits, budget))
            trees = builder.build(lp, ids, budget, roots)
            row["gpu_tree_us"] = _time_gpu(lambda: builder.build(lp, ids, budget, roots))
            row["gpu_verify_us"] = _time_gpu(lambda: builder.verify_inputs(trees, seq, seq_sum))
            row["gpu_e2e_eager_us"] = _time_gpu(lambda: builder.round(logits, budget, roots, seq, seq_sum))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                builder.round(logits, budget, roots, seq, seq_sum)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g_trees, g_ver = builder.round(logits, budget, roots, seq, seq_sum)
            row["gpu_e2e_graph_us"] = _time_gpu(graph.replay)
            torch.cuda.synchronize()
            builder.check()
            row["same_tree_as_cpu"] = bool(np.array_equal(g_trees.tokens.cpu().numpy(), state["trees"].tokens))
            row["speedup_e2e"] = row["cpu_total_us"] / row["gpu_e2e_graph_us"]
            row["topk_floor_us"] = logits.numel() * 2 / bw * 1e6
            row["topk_bw_frac"] = row["topk_floor_us"] / row["gpu_topk_us"]
            row["copy_bw_TBps"] = bw / 1e12
            # --- SGLang's mask/positions/links kernel on the same tree (EAGLE ABI)
            if sgl_build is not None:
                parent_list, selected, topk_e, depth_e = _eagle_abi(state["trees"], budget)
                pl = torch.from_numpy(parent_list).cuda()
                sel = torch.from_numpy(selected).cuda()
                mask_buf = torch.ones(seq_sum * width + width * width * bs, dtype=torch.bool, device="cuda")
                pos = torch.empty(bs * width, dtype=torch.int64, device="cuda")
                rbuf = torch.full((3, bs, width), -1, dtype=torch.int64, device="cuda")

                def sgl():
                    rbuf.fill_(-1)
                    mask_buf.fill_(True)
                    sgl_build(pl, sel, seq, mask_buf, pos, rbuf[0], rbuf[1], rbuf[2], topk_e, depth_e, width, 0)

                row["sglang_mask_us"] = _time_gpu(sgl)
                row["sglang_mask_same"] = bool(
                    torch.equal(mask_buf, g_ver.full_mask) and torch.equal(pos, g_ver.positions)
                )
                row["gpu_verify_fill_us"] = _time_gpu(lambda: builder.verify_inputs(trees, seq, seq_sum))
            else:
                row["sglang_mask_us"] = None
                row["sglang_error"] = sgl_error
            row["uno_error"] = uno_error
            # the fp32 verify logits it needs are bs * (B+1) * V * 4 bytes: skip the largest grid points
            row["worker_eager_us"] = (
                _time_gpu(worker_round_fn(bs, budget, depth, vocab, logits, seq, seq_sum, roots))
                if bs * (budget + 1) * vocab * 4 <= 8 << 30 else float("nan"))
            rows_out.append(row)
            if progress:
                progress(row)
            del builder, graph
            torch.cuda.empty_cache()
    return rows_out


def worker_round_fn(bs, budget, depth, vocab, logits, seq, seq_sum, roots, hidden_size=7168):
    """The bookkeeping a CUDA server's round runs, as ``KDTreeWorker._tree_round`` calls it: the reserved
    ``pipeline.GpuBackend`` (grow-only buffers, bf16 draft logits as they are), eager: top-K -> tree ->
    verify inputs, then greedy accept on fp32 verify logits, commit plan and the accepted hidden rows
    (Kimi's hidden size). Not included: the KV compaction (it needs a pool; see the compaction section) and
    the round's end-of-round host read of the error flags."""
    import torch

    from sglang_kdtree.pipeline import GpuBackend, bookkeeping_round

    width = budget + 1
    backend = GpuBackend("cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    target = torch.randn((bs, width, vocab), device="cuda", generator=g)
    hidden = torch.randn((bs * width, hidden_size), device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.arange(bs * width, device="cuda", dtype=torch.int64).view(bs, width)

    def round_():
        bookkeeping_round(backend, logits, budget, depth, roots, seq, seq_sum, target, slots, hidden)

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
