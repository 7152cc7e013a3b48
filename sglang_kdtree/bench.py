"""Isolated benchmark of one DDTree round's tree machinery (``python -m sglang_kdtree bench``).

Input: synthetic draft logits shaped like Kimi K2.6's DFlash drafter (L = 15 depths, V = 163,840) with
realistic peaked distributions (``synthetic_draft_logits``), for a grid of batch sizes x node budgets.

* CPU-only machine: times the CPU reference pipeline stage by stage (top-K + logsumexp, heap build,
  visibility, mask build, accept) and says plainly that the GPU columns need a GPU.
* With a GPU: also runs ``sglang_kdtree.bench_gpu.run_gpu_bench`` (the service's CPU-heap path against our
  CuPy kernels, from the same run) and prints its table.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from sglang_kdtree import reference as R

KIMI_DEPTHS = 15
KIMI_VOCAB = 163_840
DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_BUDGETS = (16, 64, 256)


def synthetic_draft_logits(bs: int, depths: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``[bs, depths, vocab]`` float32 logits with the shape of a confident drafter's output.

    Each row: Gaussian background (std 1.5) plus a Zipf-like head of 32 tokens whose boosts decay as
    ``c / rank^1.1``, with the head's strength ``c`` drawn per row (log-uniform 4..14) and sharpening
    fading with depth, so top-1 probabilities range from near-uniform tails to > 0.9, as DFlash drafts do.
    """
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, size=(bs, depths, vocab)).astype(np.float32)
    head = 32
    ranks = np.arange(1, head + 1, dtype=np.float32)
    for b in range(bs):
        for d in range(depths):
            strength = np.exp(rng.uniform(np.log(4.0), np.log(14.0))) * (1.0 - 0.03 * d)
            tokens = rng.choice(vocab, size=head, replace=False)
            logits[b, d, tokens] += strength / ranks**1.1
    return logits


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def cpu_round(logits: np.ndarray, budget: int, seq_lens: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Time one round of the CPU reference pipeline; returns milliseconds per stage."""
    bs = logits.shape[0]
    rng = np.random.default_rng(seed)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    logprobs, ids = R.topk_logprobs(logits, budget)
    times["topk_lse"] = _ms(t0)
    t0 = time.perf_counter()
    trees = R.build_trees(logprobs, ids, budget, rng.integers(0, logits.shape[-1], size=bs))
    times["heap_build"] = _ms(t0)
    t0 = time.perf_counter()
    R.ancestor_matrix(trees)
    times["visibility"] = _ms(t0)
    t0 = time.perf_counter()
    R.verify_inputs(trees, seq_lens)
    times["mask_build"] = _ms(t0)
    # the target agrees with the drafter's first child at 70% of nodes: a realistic walk length
    target = rng.integers(0, logits.shape[-1], size=trees.tokens.shape)
    for b in range(bs):
        seen: set[int] = set()
        for i in range(1, int(trees.num_nodes[b]) + 1):
            p = int(trees.parents[b, i])
            if p not in seen:
                seen.add(p)
                if rng.random() < 0.7:
                    target[b, p] = trees.tokens[b, i]
    t0 = time.perf_counter()
    R.accept_greedy(trees, target.astype(np.int64), max_depth=logits.shape[1])
    times["accept"] = _ms(t0)
    times["total"] = sum(times.values())
    return times


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    header = " | ".join(title for _, title in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for key, title in columns:
            v = row.get(key, "")
            cells.append(f"{v:>{len(title)}.2f}" if isinstance(v, float) else f"{v!s:>{len(title)}}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


CPU_COLUMNS = [
    ("batch", "batch"),
    ("budget", "budget"),
    ("topk_lse", "topk+lse ms"),
    ("heap_build", "heap build ms"),
    ("visibility", "visibility ms"),
    ("mask_build", "mask build ms"),
    ("accept", "accept ms"),
    ("total", "total ms"),
]


def run_cpu_bench(batches, budgets, depths, vocab, repeats: int = 1, progress=None) -> list[dict]:
    rows = []
    configs = [(b, k) for b in batches for k in budgets]
    for n, (bs, budget) in enumerate(configs, 1):
        if progress:
            progress(f"[{n}/{len(configs)}] CPU reference: batch {bs}, budget {budget} ...")
        logits = synthetic_draft_logits(bs, depths, vocab, seed=bs * 1000 + budget)
        seq_lens = np.random.default_rng(bs).integers(100, 4000, size=bs)
        runs = [cpu_round(logits, budget, seq_lens, seed=r) for r in range(repeats)]
        best = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        rows.append({"batch": bs, "budget": budget, **best})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_kdtree bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    p.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    p.add_argument("--depths", type=int, default=KIMI_DEPTHS, help="draft depths L (block size - 1)")
    p.add_argument("--vocab", type=int, default=KIMI_VOCAB)
    p.add_argument("--repeats", type=int, default=1, help="CPU repeats per configuration (median)")
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU columns even where a GPU exists")
    args = p.parse_args(argv)
    for b in args.budgets:
        if not 1 <= b <= R.MAX_BUDGET:
            p.error(f"--budgets: {b} is outside [1, {R.MAX_BUDGET}]")
    if not 1 <= args.depths <= 31 or args.vocab < 1 or min(args.batches) < 1:
        p.error("--depths must lie in [1, 31], --vocab and --batches must be >= 1")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(f"DDTree round, L = {args.depths}, V = {args.vocab:,}, synthetic peaked draft logits", flush=True)
    rows = run_cpu_bench(args.batches, args.budgets, args.depths, args.vocab, args.repeats, progress)
    print("\nCPU reference pipeline (numpy + Python heapq; milliseconds per round, one core):")
    print(format_table(rows, CPU_COLUMNS))

    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    reason = "--cpu-only was given" if args.cpu_only else gpu_unavailable_reason()
    if reason is not None:
        print(f"\nGPU columns: not run ({reason}). They need a CUDA GPU with CuPy (cupy-cuda13x).")
        return 0
    from sglang_kdtree.bench_gpu import format_table as gpu_table
    from sglang_kdtree.bench_gpu import run_gpu_bench

    print("\nService CPU path (torch top-K on the GPU, host heapq, numpy mask) vs our GPU kernels, same run:")
    gpu_rows = run_gpu_bench(
        args.batches, args.budgets, args.depths, args.vocab,
        progress=lambda row: progress(f"GPU: batch {row['batch']}, budget {row['budget']} done"),
    )
    print(gpu_table(gpu_rows))
    return 0
