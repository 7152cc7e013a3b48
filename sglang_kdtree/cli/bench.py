"""Isolated benchmark of one DDTree round's tree machinery (``python -m sglang_kdtree bench``).

Input: synthetic draft logits shaped like Kimi K2.6's DFlash drafter (L = 15 depths, V = 163,840) with
realistic peaked distributions (``synthetic_draft_logits``), for a grid of batch sizes x node budgets.

* CPU-only machine: times the CPU reference pipeline stage by stage (top-K + logsumexp, heap build,
  visibility, mask build, accept) and says plainly that the GPU columns need a GPU.
* With a GPU: also runs ``sglang_kdtree.cli.bench_gpu.run_gpu_bench`` (the service's CPU-heap path against our
  CuPy kernels, from the same run) and prints its table.
* ``--kimi-round``: instead, the measured model of one Kimi K2.6 decode round at TP 8 (``benchmarks.kimi_round``
  of a source checkout, run from its root; every other option is then its own: ``--kimi-round --help``).
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


def _fmt(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _cell(v) -> str:
    """A figure: ``median (min-max)`` for a ``(median, lo, hi)`` triple, the value itself otherwise."""
    if isinstance(v, tuple):
        med, lo, hi = v
        return f"{_fmt(med)} ({_fmt(lo)}-{_fmt(hi)})"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    cells = [[_cell(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max([len(title)] + [len(r[i]) for r in cells]) for i, (_, title) in enumerate(columns)]
    header = " | ".join(f"{title:>{w}}" for (_, title), w in zip(columns, widths))
    lines = [header, "-" * len(header)]
    lines += [" | ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in cells]
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

DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1


def run_cpu_bench(batches, budgets, depths, vocab, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                  progress=None) -> list[dict]:
    """One row per (batch, budget); each stage is ``(median, min, max)`` over ``repeats`` timed rounds, run
    after ``warmup`` untimed rounds on the same logits (each round draws its own tree root and target)."""
    rows = []
    configs = [(b, k) for b in batches for k in budgets]
    for n, (bs, budget) in enumerate(configs, 1):
        if progress:
            progress(f"[{n}/{len(configs)}] CPU reference: batch {bs}, budget {budget}, "
                     f"{warmup} warm-up + {repeats} timed rounds ...")
        logits = synthetic_draft_logits(bs, depths, vocab, seed=bs * 1000 + budget)
        seq_lens = np.random.default_rng(bs).integers(100, 4000, size=bs)
        for r in range(warmup):
            cpu_round(logits, budget, seq_lens, seed=repeats + r)
        runs = [cpu_round(logits, budget, seq_lens, seed=r) for r in range(repeats)]
        stats = {k: (float(np.median([r[k] for r in runs])), min(r[k] for r in runs), max(r[k] for r in runs))
                 for k in runs[0]}
        rows.append({"batch": bs, "budget": budget, **stats})
    return rows


#: a row whose total's (max - min) / median exceeds this is flagged: its median is not a figure to quote
NOISY_SPREAD = 0.5


def cpu_summary(rows: list[dict]) -> list[str]:
    """The CPU table's reading: one line per row whose spread exceeds ``NOISY_SPREAD`` and a conclusion line (the
    round's range over the grid and the stage that dominates it), from the rows themselves."""
    lines = []
    for row in rows:
        med, lo, hi = row["total"]
        if med > 0 and (hi - lo) / med > NOISY_SPREAD:
            lines.append(f"NOISY: batch {row['batch']}, budget {row['budget']}: total {_fmt(lo)}-{_fmt(hi)} ms, a "
                         f"spread of {100 * (hi - lo) / med:.0f} % of its median; the machine was busy or the "
                         "repeats too few (--repeats), so do not quote that median")
    low = min(rows, key=lambda r: r["total"][0])
    high = max(rows, key=lambda r: r["total"][0])
    stages = [key for key, _ in CPU_COLUMNS[2:-1]]
    share = {k: sum(r[k][0] for r in rows) / max(sum(r["total"][0] for r in rows), 1e-9) for k in stages}
    top = max(share, key=share.get)
    title = dict(CPU_COLUMNS)[top].replace(" ms", "")
    lines.append(f"Conclusion: on this CPU the reference round's tree machinery costs {_fmt(low['total'][0])} ms "
                 f"(batch {low['batch']}, budget {low['budget']}) to {_fmt(high['total'][0])} ms (batch "
                 f"{high['batch']}, budget {high['budget']}) per round, {100 * share[top]:.0f} % of it in {title}; "
                 "a server on this path pays it every decode round on the host.")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_kdtree bench",
        description=__doc__.split("\n\n")[0] + " Every CPU figure is the median (min-max) of --repeats timed "
        "rounds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="BS",
                   help="batch sizes (requests per round) to time")
    p.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), metavar="B",
                   help=f"node budgets (tree nodes per request, 1..{R.MAX_BUDGET}) to time")
    p.add_argument("--depths", type=int, default=KIMI_DEPTHS, help="draft depths L (drafter block size - 1), 1..31")
    p.add_argument("--vocab", type=int, default=KIMI_VOCAB, help="vocabulary size V of the synthetic draft logits")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="timed CPU rounds per configuration; the table shows their median (min-max)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help="untimed CPU rounds per configuration before the timed ones")
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU table even where a GPU exists")
    p.add_argument("--kimi-round", action="store_true",
                   help="instead: the measured Kimi K2.6 TP 8 decode-round model (benchmarks.kimi_round of a source "
                        "checkout, run from its root). Needs "
                        "a CUDA GPU to time its pieces; without one it can only re-assemble a saved GPU run "
                        "(--from-json). The other options are then its own (--kimi-round --help)")
    return p


class NeedsCheckout(ImportError):
    """``--kimi-round`` asked for where the checkout's ``benchmarks`` package does not import."""


def load_kimi_round():
    """The Kimi round model, ``benchmarks.kimi_round``: a module of the source checkout (importable from its root),
    not of the installed package. Raises ``NeedsCheckout`` saying so where it does not import."""
    import importlib

    try:
        return importlib.import_module("benchmarks.kimi_round")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.kimi_round"):
            raise  # the model itself lacks a dependency: that error says which
        raise NeedsCheckout(
            "--kimi-round needs a source checkout of sglang-kdtree (the Kimi round model is its benchmarks "
            "package, which the installed package does not ship); from the checkout's root run "
            "`python -m benchmarks.kimi_round [options]` or `python -m sglang_kdtree bench --kimi-round [options]`"
        ) from exc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--kimi-round" in argv:
        try:
            kimi_round = load_kimi_round()
        except NeedsCheckout as exc:
            print(f"python -m sglang_kdtree bench: {exc}", file=sys.stderr)
            return 2
        return kimi_round.main([a for a in argv if a != "--kimi-round"],
                               prog="python -m sglang_kdtree bench --kimi-round")
    p = _parser()
    args = p.parse_args(argv)
    for b in args.budgets:
        if not 1 <= b <= R.MAX_BUDGET:
            p.error(f"--budgets: {b} is outside [1, {R.MAX_BUDGET}]")
    if not 1 <= args.depths <= 31 or args.vocab < 1 or min(args.batches) < 1:
        p.error("--depths must lie in [1, 31], --vocab and --batches must be >= 1")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(f"DDTree round, L = {args.depths}, V = {args.vocab:,}, synthetic peaked draft logits", flush=True)
    rows = run_cpu_bench(args.batches, args.budgets, args.depths, args.vocab, args.repeats, args.warmup, progress)
    runs = "run" if args.repeats == 1 else "runs"
    print(f"\nCPU reference pipeline (numpy + Python heapq; milliseconds per round, one core). Each figure: "
          f"median (min-max) of {args.repeats} timed {runs} after {args.warmup} warm-up:")
    print(format_table(rows, CPU_COLUMNS))
    print("\n".join(cpu_summary(rows)))

    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    reason = "--cpu-only was given" if args.cpu_only else gpu_unavailable_reason()
    if reason is not None:
        print(f"\nGPU table: not run ({reason}). It needs a CUDA GPU with CuPy (cupy-cuda13x). Without one, from a "
              "source checkout's root, `python -m sglang_kdtree bench --kimi-round --from-json "
              "benchmarks/results/kimi_round.json` reprices the modelled Kimi K2.6 round from a saved GPU run.")
        return 0
    from sglang_kdtree.cli.bench_gpu import format_table as gpu_table
    from sglang_kdtree.cli.bench_gpu import run_gpu_bench

    print("\nService CPU path (torch top-K on the GPU, host heapq, numpy mask) vs our GPU kernels, same run. Each "
          "figure: a median (GPU stages: CUDA events, 20 runs after 3 warm-up; host stages: 3 runs; see "
          "sglang_kdtree.cli.bench_gpu.run_gpu_bench):")
    gpu_rows = run_gpu_bench(
        args.batches, args.budgets, args.depths, args.vocab,
        progress=lambda row: progress(f"GPU: batch {row['batch']}, budget {row['budget']} done"),
    )
    print(gpu_table(gpu_rows))
    return 0
