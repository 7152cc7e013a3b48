"""MLA tree-verify attention: ours (the kernel the server runs, ``mla_attention.resolve_kernel``: on an H200 the
wgmma kernel sglang_kdtree/kernels/mla_tree_verify_wgmma.cu), the previous mma.sync kernel
(sglang_kdtree/kernels/mla_tree_verify.cu, "mma"), SGLang's Triton extend attention with a custom mask
(``sglang.kernels.ops.attention.extend_attention.extend_attention_fwd``, the triton backend's TARGET_VERIFY path
for absorbed MLA), plain torch, and the roofline measured in the same run: ``max(bytes / HBM bandwidth, FLOPs /
bf16 tensor rate)`` with the bandwidth from a 1 GiB device copy and the rate from a bf16 8192^3 matmul.

FLOPs count only visible (query row, key) pairs: ``2 * (576 + 512)`` per pair. Bytes: the latent KV rows
read once (576 bf16 each), q, out, LSE and the index arrays.

Ours is timed three ways: an eager call (CUDA events around the call, so the launcher's Python between the events
counts), a replayed CUDA graph of the call with the split-K factor an eager call picks, and a graph captured the
way SGLang's verify graph captures it (the split planned for a nominal context). The server runs the kernel only
inside that captured graph, so the roofline percentage is the graph's; the eager one is printed beside it.

``--sm120``: the grid of the kernel an sm_120 card runs (``mma_compact``, 99,584 B of shared memory per block) at
Kimi K2.6's TP 8 shapes (8 heads; batch 1 / 8 / 32, widths 16 / 32 / 64, contexts 4k / 16k) against SGLang's Triton
verify, the mma and the wgmma kernels, every one timed as a replayed CUDA graph (the server's way) in the same run.

CLI: ``python benchmarks/bench_mla_attention.py [--quick | --sm120] [--deadline S] [--json PATH]``.
pytest-benchmark: ``pytest benchmarks/bench_mla_attention.py`` (one mid-size shape, ours and Triton).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import pytest
import torch

from sglang_kdtree.cli.bench_timing import copy_bandwidth, cuda_time_us, graph_replay_us
from sglang_kdtree.gpu.mla_attention import mla_tree_verify, resolve_kernel
from sglang_kdtree.gpu.mla_reference import synthetic_inputs

GRID_BATCH = (1, 8, 32)
GRID_CONTEXT = (4096, 16384, 65536)
GRID_WIDTH = (17, 65, 257)
GRID_HEADS = (8, 16)
TARGET_SHAPE = (32, 16384, 65, 16)  # the shape with the >= 50 % roofline target
KIMI_TP8_SHAPE = (32, 16384, 65, 8)  # the same target with Kimi K2.6's per-GPU heads at TP 8


def _timed(fn, min_reps=3, budget_s=0.25):
    """Median milliseconds of fn() with CUDA events after one warm-up call: ``min_reps`` timed calls, more
    while they take under ``budget_s`` seconds, 20 at most."""
    return cuda_time_us(fn, trials=min_reps, warmup=1, budget_s=budget_s, max_trials=20) / 1e3


def measure_ceilings():
    """(HBM bytes/s from a 1 GiB device copy (``bench_timing.copy_bandwidth``), bf16 FLOP/s from an 8192^3
    matmul), medians."""
    bandwidth = copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _timed(lambda: a @ b, min_reps=10)
    rate = 2 * 8192**3 / (ms * 1e-3)
    return bandwidth, rate


def work(case, prefix):
    """(FLOPs over visible pairs, bytes moved at minimum)."""
    import numpy as np

    bits = case["ancestor_bits"].cpu().numpy()
    tree_pairs = int(np.unpackbits(bits.view(np.uint8)).sum())
    heads = case["q"].shape[1]
    width = case["q"].shape[0] // len(prefix)
    pairs = heads * (width * sum(prefix) + tree_pairs)
    flops = 2 * (576 + 512) * pairs
    tokens = case["q"].shape[0]
    nbytes = (sum(prefix) + tokens) * 576 * 2 + tokens * heads * (576 * 2 + 512 * 2 + 4) + sum(prefix) * 8 + tokens * 8
    return flops, nbytes


def sglang_triton_runner(case):
    """SGLang's triton-backend call for MLA TARGET_VERIFY on the same inputs (dense FULL_MASK as uint8)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    q, kv = case["q"], case["kv_buffer"]
    tokens, heads, _ = q.shape
    batch = case["kv_indptr"].shape[0] - 1
    width = tokens // batch
    prefix = case["kv_indptr"].diff().tolist()
    k_buffer = kv.view(-1, 1, 576)
    v_buffer = k_buffer[..., :512]
    k_extend = k_buffer[case["tree_slots"]].contiguous()
    v_extend = k_extend[..., :512].contiguous()
    cols = torch.arange(width, device="cuda")
    anc = ((case["ancestor_bits"].to(torch.int64)[:, :, cols // 32] >> (cols % 32)) & 1).to(torch.uint8)
    parts = []
    for b in range(batch):
        parts.append(torch.cat([torch.ones((width, prefix[b]), dtype=torch.uint8, device="cuda"), anc[b]], 1).view(-1))
    custom_mask = torch.cat(parts)
    mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device="cuda")
    mask_indptr[1:] = torch.cumsum(torch.tensor([width * (p + width) for p in prefix], device="cuda"), 0)
    qo_indptr = torch.arange(0, (batch + 1) * width, width, dtype=torch.int32, device="cuda")
    out = torch.empty((tokens, heads, 512), dtype=torch.bfloat16, device="cuda")

    def run():
        extend_attention_fwd(q, k_extend, v_extend, out, k_buffer, v_buffer, qo_indptr, case["kv_indptr"],
                             case["kv_indices"], custom_mask, True, mask_indptr, width, 1.0, 1.0,
                             sm_scale=case["sm_scale"])
        return out

    return run


def torch_runner(case):
    """Plain torch: per request, bf16 matmuls with an fp32 masked softmax."""
    q, kv = case["q"], case["kv_buffer"]
    tokens, heads, _ = q.shape
    batch = case["kv_indptr"].shape[0] - 1
    width = tokens // batch
    indptr = case["kv_indptr"].tolist()
    cols = torch.arange(width, device="cuda")
    anc = ((case["ancestor_bits"].to(torch.int64)[:, :, cols // 32] >> (cols % 32)) & 1).bool()
    out = torch.empty((tokens, heads, 512), dtype=torch.bfloat16, device="cuda")

    def run():
        for b in range(batch):
            slots = torch.cat([case["kv_indices"][indptr[b]:indptr[b + 1]], case["tree_slots"][b * width:(b + 1) * width]])
            keys = kv[slots]
            qb = q[b * width:(b + 1) * width].reshape(width * heads, 576)
            s = (qb @ keys.T).float() * case["sm_scale"]
            s = s.view(width, heads, -1)
            s[:, :, indptr[b + 1] - indptr[b]:].masked_fill_(~anc[b][:, None, :], -math.inf)
            p = torch.softmax(s, dim=-1).to(torch.bfloat16).view(width * heads, -1)
            out[b * width:(b + 1) * width] = (p @ keys[:, :512]).view(width, heads, 512)
        return out

    return run


def ours_runner(case, kernel=None, num_splits=None):
    args = (case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"], case["tree_slots"],
            case["ancestor_bits"], case["sm_scale"])
    return lambda: mla_tree_verify(*args, kernel=kernel, num_splits=num_splits)


def eager_splits(case, kernel):
    """The split-K factor an eager call of ``mla_tree_verify`` picks for ``case``: the launcher's
    ``planned_num_splits`` for ``mla_tree_verify``'s mean prefix (``kv_indices``' length over the batch)."""
    from sglang_kdtree.gpu import mla_attention as mla

    batch = case["kv_indptr"].shape[0] - 1
    width = case["q"].shape[0] // batch
    return mla.planned_num_splits(batch, width * case["q"].shape[1], case["kv_indices"].shape[0] / batch, width,
                                  mla.limits.current(torch.cuda.current_device()).sm_count, kernel)


def graph_ms(fn, reps=5):
    """Median device milliseconds of one replay of ``fn`` captured in a CUDA graph, as SGLang's verify graph runs
    the kernel: no host time between calls (an eager call's CUDA-event time also counts the launcher's Python)."""
    return graph_replay_us(fn, replays=reps) / 1e3


def mixed_prefixes(batch, context, seed):
    """Mixed prefix lengths averaging ``context``: uniform in [context/2, 3*context/2], first one = context."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if batch == 1:
        return [context]
    lens = rng.integers(context // 2, 3 * context // 2 + 1, size=batch)
    lens[0] = context
    return [int(x) for x in lens]


def run_grid(quick=False, deadline_s=1e9, with_torch_limit=8 * 16384):
    t_start = time.perf_counter()
    bandwidth, rate = measure_ceilings()
    print(f"# ceilings: HBM {bandwidth / 1e12:.2f} TB/s (1 GiB copy), bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    shapes = [(b, c, n, h) for b in GRID_BATCH for c in GRID_CONTEXT for n in GRID_WIDTH for h in GRID_HEADS]
    if quick:
        shapes = [(1, 4096, 17, 8), (8, 16384, 65, 16), KIMI_TP8_SHAPE, TARGET_SHAPE]
    # the two targets first, then cheapest first, so a deadline cuts the most expensive shapes
    shapes.sort(key=lambda s: (s not in (TARGET_SHAPE, KIMI_TP8_SHAPE), s[0] * s[1] * s[2] * s[3]))
    rows = []
    kernel = resolve_kernel(None, torch.cuda.current_device())
    print(f"# ours = the {kernel} kernel (what the server runs here); mma = the mma.sync kernel", flush=True)
    print("# ours = an eager call (CUDA events, the launcher's host time included); graph = a replayed CUDA graph of "
          "the call with the split eager picks; server = a graph captured as the server captures it (split planned "
          "for a nominal context, gpu/mla_attention._GRAPH_MEAN_PREFIX); % roof from the graph, then eager", flush=True)
    header = f"{'bs':>3} {'ctx':>6} {'N':>4} {'H':>3} | {'ours ms':>9} {'graph ms':>8} {'server':>7} {'mma ms':>8} " \
             f"{'triton ms':>10} {'torch ms':>9} | {'x mma':>6} {'x triton':>8} {'roof ms':>8} {'% roof':>6} " \
             f"{'eager %':>7} {'TFLOP/s':>7}"
    print(header, flush=True)
    for batch, context, width, heads in shapes:
        if time.perf_counter() - t_start > deadline_s:
            print(f"# deadline reached: skipped {batch, context, width, heads} and later shapes", flush=True)
            break
        prefix = mixed_prefixes(batch, context, seed=batch + context + width)
        case = synthetic_inputs(batch, width, heads, prefix, seed=1, spare_slots=0)
        flops, nbytes = work(case, prefix)
        roof_ms = max(nbytes / bandwidth, flops / rate) * 1e3
        ours = _timed(ours_runner(case))
        splits = eager_splits(case, kernel)
        graph = graph_ms(ours_runner(case, num_splits=splits))
        server = graph_ms(ours_runner(case))
        mma_ms = ours if kernel == "mma" else _timed(ours_runner(case, "mma"))
        try:
            triton_ms = _timed(sglang_triton_runner(case), min_reps=2, budget_s=0.1)
        except Exception as exc:  # report, keep going: the comparison is the point of the run
            print(f"# sglang triton failed at {batch, context, width, heads}: {type(exc).__name__}: {exc}", flush=True)
            triton_ms = float("nan")
        torch_ms = float("nan")
        if batch * context <= with_torch_limit:
            torch_ms = _timed(torch_runner(case), min_reps=2, budget_s=0.1)
        row = dict(batch=batch, context=context, width=width, heads=heads, prefix=prefix, kernel=kernel,
                   ours_ms=ours, graph_ms=graph, server_graph_ms=server, splits=splits, mma_ms=mma_ms,
                   triton_ms=triton_ms, torch_ms=torch_ms, roofline_ms=roof_ms, flops=flops, bytes=nbytes)
        rows.append(row)
        print(f"{batch:>3} {context:>6} {width:>4} {heads:>3} | {ours:>9.3f} {graph:>8.3f} {server:>7.3f} "
              f"{mma_ms:>8.3f} {triton_ms:>10.3f} {torch_ms:>9.3f} | {mma_ms / ours:>6.2f} {triton_ms / ours:>8.2f} "
              f"{roof_ms:>8.3f} {100 * roof_ms / graph:>6.1f} {100 * roof_ms / ours:>7.1f} {flops / graph / 1e9:>7.0f}",
              flush=True)
        del case
        torch.cuda.empty_cache()
    return dict(bandwidth=bandwidth, tensor_rate=rate, rows=rows)


SM120_KERNELS = ("mma_compact", "mma", "wgmma")


def run_sm120_grid(deadline_s=1e9):
    """The ``--sm120`` grid: per cell, the graph-replay milliseconds of each kernel of ``SM120_KERNELS`` that runs here
    and of SGLang's Triton verify, and mma_compact's share of the roofline (from its graph time)."""
    from sglang_kdtree.gpu import limits
    from sglang_kdtree.gpu.mla_attention import choose_kernel

    t_start = time.perf_counter()
    bandwidth, rate = measure_ceilings()
    lim = limits.current(torch.cuda.current_device())
    kernels = []
    for k in SM120_KERNELS:
        try:
            kernels.append(choose_kernel(k, lim))
        except ValueError as exc:
            print(f"# {k} does not run here: {exc}", flush=True)
    print(f"# ceilings: HBM {bandwidth / 1e12:.2f} TB/s (1 GiB copy), bf16 matmul {rate / 1e12:.0f} TFLOP/s; limits "
          f"{lim.describe()}; graph-replay ms, split-K as the server's captured graph plans it", flush=True)
    print(f"{'bs':>3} {'ctx':>6} {'N':>3} | " + " ".join(f"{k:>11}" for k in kernels)
          + f" {'triton':>8} | {'x triton':>8} {'roof ms':>8} {'% roof':>6}", flush=True)
    rows = []
    for batch in (1, 8, 32):
        for context in (4096, 16384):
            for width in (16, 32, 64):
                if time.perf_counter() - t_start > deadline_s:
                    print(f"# deadline reached at {batch, context, width}", flush=True)
                    return dict(bandwidth=bandwidth, tensor_rate=rate, limits=lim.describe(), rows=rows)
                prefix = mixed_prefixes(batch, context, seed=batch + context + width)
                case = synthetic_inputs(batch, width, 8, prefix, seed=1, spare_slots=0)
                flops, nbytes = work(case, prefix)
                roof_ms = max(nbytes / bandwidth, flops / rate) * 1e3
                ms = {k: graph_ms(ours_runner(case, k)) for k in kernels}
                try:
                    ms["triton"] = graph_ms(sglang_triton_runner(case))
                except Exception as exc:  # report, keep going: the comparison is the point of the run
                    print(f"# triton failed at {batch, context, width}: {type(exc).__name__}: {exc}", flush=True)
                    ms["triton"] = float("nan")
                ours = ms["mma_compact"]
                rows.append(dict(batch=batch, context=context, width=width, heads=8, prefix=prefix, ms=ms,
                                 roofline_ms=roof_ms, flops=flops, bytes=nbytes))
                print(f"{batch:>3} {context:>6} {width:>3} | " + " ".join(f"{ms[k]:>11.4f}" for k in kernels)
                      + f" {ms['triton']:>8.4f} | {ms['triton'] / ours:>8.2f} {roof_ms:>8.4f} "
                        f"{100 * roof_ms / ours:>6.1f}", flush=True)
                del case
                torch.cuda.empty_cache()
    slower = [r for r in rows if not r["ms"]["mma_compact"] < r["ms"]["triton"]]
    print(f"# mma_compact faster than SGLang's Triton verify in {len(rows) - len(slower)} of {len(rows)} cells"
          + (f"; NOT in {[(r['batch'], r['context'], r['width']) for r in slower]}" if slower else ""), flush=True)
    return dict(bandwidth=bandwidth, tensor_rate=rate, limits=lim.describe(), rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="four shapes only (the two targets first)")
    ap.add_argument("--sm120", action="store_true", help="the sm_120 kernel's grid against Triton, mma and wgmma")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = run_sm120_grid(args.deadline) if args.sm120 else run_grid(quick=args.quick, deadline_s=args.deadline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


# ---- pytest-benchmark cases (GPU only) ----

@pytest.fixture(scope="module")
def mid_case():
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    if gpu_unavailable_reason() is not None:
        pytest.skip(gpu_unavailable_reason())
    return synthetic_inputs(8, 65, 16, mixed_prefixes(8, 4096, 0), seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["ours", "mma", "sglang_triton"])
def test_bench_mla_tree_verify(benchmark, mid_case, impl):
    fn = {"ours": lambda: ours_runner(mid_case), "mma": lambda: ours_runner(mid_case, "mma"),
          "sglang_triton": lambda: sglang_triton_runner(mid_case)}[impl]()

    def call():
        fn()
        torch.cuda.synchronize()

    benchmark(call)


if __name__ == "__main__":
    sys.exit(main())
