"""Routed experts of Kimi K2.6 (384 experts, top 8, hidden 7168, INT4 W4A16 group 32) at tree-verify widths:
ours (sglang_kdtree.moe.forward.fused_moe_marlin: SGLang's JIT Marlin GEMM + CuPy glue) vs the bf16 model
(the same experts dequantized once to bf16, resident; per call: sort routes by expert, torch grouped
matmul ``torch._grouped_mm`` for gate|up and down, SiLU, top-k weighted scatter-add; a per-expert
``torch.mm`` loop where ``_grouped_mm`` is unavailable) vs the INT4 weight-bandwidth floor: bytes of the
experts the call touches (packed weights + bf16 scales of gate|up and down) / the device-to-device copy
bandwidth measured in the same run (read + write bytes / time).

Shapes: ``tp8`` = intermediate 256 per GPU (experts sharded over 8 GPUs), ``tp1`` = intermediate 2048.
Routing: uniform random distinct top-8 per token (DeepSeek-V3 style output), positive weights, routed
scaling factor 2.827. Each timed call uses one of ROTATE different routings and inputs so the touched
experts are not still in the 50 MB L2 from the previous call. Timing: CUDA events around a CUDA graph of
ROTATE x REPEAT calls (device time, what SGLang's graph replay sees) and around the same calls eager
(adds Python + launch overhead). Sanity: per-token relative error of ours and of the bf16 path vs the
fp32 float reference (tests/gpu/test_marlin_moe_gpu.py is the correctness gate).

Which floor binds (Marlin MoE at verify widths, 130 / 520 / 2080 tokens = batch 2 / 8 / 32
x N 65): besides the INT4 weight floor, a compute floor = the call's useful tensor-core FLOPs
(``moe_flops``: 2 x tokens x top_k x (hidden x 2 inter + inter x hidden), Marlin's block padding not counted)
/ ``BF16_PEAK_FLOPS``. The larger of the two binds; "% bound" = binding floor / ours. The stage split
(``--breakdown-tokens``) names the glue (every stage but the two Marlin GEMMs: align, SiLU-and-mul, top-k
sum) and its share of the whole call, flagged where it is over ``GLUE_FLAG_SHARE``; a second table gives
each stage's own floor (the GEMMs: their weights or FLOPs; SiLU and the top-k sum: the bytes they read and
write) and the stage's % of it.

    python benchmarks/bench_marlin_moe.py [--shapes tp8,tp1] [--tokens 1,8,32,65,130,260,520,2080]
        [--breakdown-tokens 1,8,65,130,520,2080] [--rotate 8] [--repeat 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from sglang_kdtree.cli.bench_timing import copy_bandwidth, cuda_time_us

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # the sibling module, also when loaded by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from marlin_moe_report import (  # noqa: E402  (gemm_weight_bytes: re-exported for the CPU tests)
    BF16_PEAK_FLOPS,
    bound_by,
    expert_bytes,
    gemm_weight_bytes,  # noqa: F401
    glue_split,
    moe_flops,
    print_table,
    stage_floors_us,
)

SHAPES = {"tp8": (384, 7168, 256), "tp1": (384, 7168, 2048)}
TOKENS = (1, 8, 32, 65, 130, 260, 520, 2080)
VERIFY_TOKENS = (130, 520, 2080)  # tree verify of batch 2 / 8 / 32 x N 65
TOP_K = 8
FACTOR = 2.827  # Kimi K2's routed_scaling_factor
ROTATE = 8
REPEAT = 4
BREAKDOWN_TOKENS = (1, 8, 65, *VERIFY_TOKENS)  # token counts whose time is also split by stage
DEVICE = "cuda"  # a CPU smoke test of this script's plumbing swaps it (and torch.cuda's timing objects)


def graph_of(fns):
    """A CUDA graph replaying ``fns`` in order REPEAT times (warm-up runs first, outside the capture)."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(REPEAT):
                for fn in fns:
                    fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def graph_or_eager_us(fns, what: str):
    """(microseconds per call, "graph") from a CUDA graph of the calls, or (eager time, "eager") where the
    capture fails (the row is then marked in the table)."""
    import torch

    calls = ROTATE * REPEAT
    try:
        graph = graph_of(fns)
        return cuda_time_us(graph.replay, calls), "graph"
    except Exception as exc:
        print(f"  {what}: graph capture failed ({type(exc).__name__}: {str(exc)[:160]}); eager timing",
              flush=True)
        torch.cuda.synchronize()
        return cuda_time_us(lambda: [f() for _ in range(REPEAT) for f in fns], calls), "eager"


def bf16_experts(packed):
    """The experts dequantized once to bf16, stored [E, out, in] (row-major per expert, nn.Linear style)."""
    import torch

    from sglang_kdtree.moe import weights as mw

    E, K, N = packed.num_experts, packed.hidden_size, packed.intermediate_size
    w13 = torch.empty((E, 2 * N, K), dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.empty((E, K, N), dtype=torch.bfloat16, device=DEVICE)
    for e in range(E):  # one expert at a time: fp32 copies of all of them would not fit at TP 1
        w13[e] = mw.dequantize(packed.w13_packed[e], packed.w13_scale[e]).t().to(torch.bfloat16)
        w2[e] = mw.dequantize(packed.w2_packed[e], packed.w2_scale[e]).t().to(torch.bfloat16)
    return w13, w2


def bf16_moe_grouped(x, ids, weights, w13, w2, factor):
    """bf16 model MoE with torch._grouped_mm, no host sync (capturable)."""
    import torch

    M, top_k = ids.shape
    E, two_n, K = w13.shape
    n = two_n // 2
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    act = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    y = y.float() * weights.reshape(-1)[order, None]
    out = torch.zeros((M, K), dtype=torch.float32, device=x.device).index_add_(0, tokens, y)
    return (out * factor).to(x.dtype)


def bf16_moe_loop_plan(ids):
    """Host plan for the per-expert loop fallback: (expert, token rows, route slots) per touched expert."""
    import torch

    plan = []
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        plan.append((e, tok, slot))
    return plan


def bf16_moe_loop(x, ids, weights, w13, w2, factor, plan):
    import torch

    n = w13.shape[1] // 2
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    for e, tok, slot in plan:
        h = x[tok] @ w13[e].t()
        y = (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return (out * factor).to(x.dtype)


def max_rel(ours, ref) -> float:
    diff = (ours.float() - ref.float()).norm(dim=1)
    return float((diff / ref.float().norm(dim=1).clamp_min(1e-30)).max())


def run_shape(name, tokens, bw, rows, check_tokens):
    import torch

    from sglang_kdtree.moe import forward as fwd
    from sglang_kdtree.moe import reference as twin
    from sglang_kdtree.moe import weights as mw

    E, K, N = SHAPES[name]
    t0 = time.perf_counter()
    packed = mw.random_packed_weights(E, K, N, device=DEVICE, seed=1)
    marlin = mw.repack_for_marlin(packed)
    w13, w2 = bf16_experts(packed)
    print(f"[{name}] weights ready in {time.perf_counter() - t0:.1f} s (E={E} K={K} N={N})", flush=True)
    grouped = hasattr(torch, "_grouped_mm")
    default = fwd.DEFAULT_REDUCE
    per_expert = expert_bytes(K, N)
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(7)
    for M in tokens:
        cases = []
        for r in range(ROTATE):
            ids = torch.topk(torch.rand((M, E), device=DEVICE, generator=gen), TOP_K, dim=1).indices.to(torch.int32)
            w = torch.rand((M, TOP_K), device=DEVICE, generator=gen) + 0.1
            w = w / w.sum(dim=1, keepdim=True)
            x = torch.randn((M, K), device=DEVICE, generator=gen).to(torch.bfloat16)
            cases.append((x, ids, w))
        touched = sum(int(torch.unique(ids).numel()) for _, ids, _ in cases) / ROTATE
        x0, ids0, w0 = cases[0]
        outs0 = {mode: fwd.fused_moe_marlin(x0, marlin, w0, ids0, FACTOR, reduce=mode) for mode in fwd.REDUCE_MODES}
        ours0 = outs0[default]
        use_grouped = grouped
        if use_grouped:
            try:
                base0 = bf16_moe_grouped(x0, ids0, w0, w13, w2, FACTOR)
            except Exception as exc:  # no sm90 grouped GEMM in this torch build
                print(f"  torch._grouped_mm unavailable ({type(exc).__name__}: {str(exc)[:100]}); per-expert loop",
                      flush=True)
                use_grouped = False
        plans = [None if use_grouped else bf16_moe_loop_plan(ids) for _, ids, _ in cases]
        if not use_grouped:
            base0 = bf16_moe_loop(x0, ids0, w0, w13, w2, FACTOR, plans[0])
        row = {"shape": name, "tokens": M, "experts": touched, "baseline": "grouped_mm" if use_grouped else "loop",
               "ours_reduce": default}
        row["rel_ours_vs_bf16"] = max_rel(ours0, base0)
        if M in check_tokens:
            ref = twin.fused_moe_reference(x0, packed, w0, ids0, FACTOR)
            for mode, out0 in outs0.items():
                row[f"rel_{mode}"] = max_rel(out0, ref)
            row["rel_ours"] = row[f"rel_{default}"]
            row["rel_bf16"] = max_rel(base0, ref)
        if use_grouped:
            base_fns = [lambda c=c: bf16_moe_grouped(c[0], c[1], c[2], w13, w2, FACTOR) for c in cases]
        else:
            base_fns = [lambda c=c, p=p: bf16_moe_loop(c[0], c[1], c[2], w13, w2, FACTOR, p)
                        for c, p in zip(cases, plans)]
        for mode in fwd.REDUCE_MODES:
            fns = [lambda c=c, m=mode: fwd.fused_moe_marlin(c[0], marlin, c[2], c[1], FACTOR, reduce=m) for c in cases]
            row[f"{mode}_graph_us"], row[f"{mode}_timing"] = graph_or_eager_us(fns, f"ours ({mode} reduce)")
        row["ours_graph_us"], row["ours_timing"] = row[f"{default}_graph_us"], row[f"{default}_timing"]
        row["bf16_graph_us"], row["bf16_timing"] = graph_or_eager_us(base_fns, "bf16")
        calls = ROTATE * REPEAT
        ours_fns = [lambda c=c: fwd.fused_moe_marlin(c[0], marlin, c[2], c[1], FACTOR) for c in cases]
        row["ours_eager_us"] = cuda_time_us(lambda: [f() for _ in range(REPEAT) for f in ours_fns], calls)
        row["floor_us"] = touched * per_expert / bw * 1e6
        row["pct_floor"] = 100 * row["floor_us"] / row["ours_graph_us"]
        row["flops"] = moe_flops(M, TOP_K, K, N)
        row.update(bound_by(row["floor_us"], row["flops"], row["ours_graph_us"]))
        row["x_vs_bf16"] = row["bf16_graph_us"] / row["ours_graph_us"]
        other = [m for m in fwd.REDUCE_MODES if m != default][0]
        print(f"  {name} M={M:4d} experts={touched:6.1f} floor={row['floor_us']:8.1f}us ours={row['ours_graph_us']:8.1f}us "
              f"({row['pct_floor']:5.1f}% of floor, {default} reduce; {other} reduce {row[other + '_graph_us']:.1f}us) "
              f"bf16={row['bf16_graph_us']:8.1f}us ({row['x_vs_bf16']:.2f}x) "
              f"eager={row['ours_eager_us']:8.1f}us compute floor={row['compute_floor_us']:.1f}us "
              f"({row['bound']} bind: {row['pct_bound']:.1f}%, {row['tflops']:.0f} TFLOP/s) "
              f"rel(ours,bf16)={row['rel_ours_vs_bf16']:.2e}"
              + ("".join(f" rel({m},ref)={row['rel_' + m]:.2e}" for m in fwd.REDUCE_MODES)
                 + f" rel(bf16,ref)={row['rel_bf16']:.2e}" if "rel_ours" in row else ""),
              flush=True)
        if M in BREAKDOWN_TOKENS:
            row["stages_us"] = stage_breakdown(marlin, cases, default)
            row["stage_floors_us"] = stage_floors_us(M, TOP_K, K, N, touched, bw)
            row["glue"] = glue_split(row["stages_us"], row["ours_graph_us"])
            print("    stages: " + ", ".join(f"{k} {v:.1f}us" for k, v in row["stages_us"].items())
                  + f"; glue {row['glue']['glue_us']:.1f}us = {row['glue']['glue_pct']:.1f}% of the call"
                  + (" (over 10%)" if row["glue"]["flag"] else ""), flush=True)
        rows.append(row)
    del packed, marlin, w13, w2
    torch.cuda.empty_cache()


def stage_breakdown(marlin, cases, reduce) -> dict:
    """Graph-replay microseconds of each stage of ``fused_moe_marlin`` on its own (same rotation of cases,
    inputs of every stage precomputed): where the time between the floor and the whole call goes."""
    import torch

    from sglang_kdtree.moe import forward as fwd
    from sglang_kdtree.moe import launch, routing

    E, N, K = marlin.num_experts, marlin.intermediate_size, marlin.hidden_size
    atomic = reduce == "atomic"
    prepared = []
    for x, ids, w in cases:
        M, top_k = ids.shape
        block = routing.choose_block_size_m(M, top_k, E)
        align = launch.moe_align_block_size(ids, E, block)
        tables = (align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, w)
        gate_up = torch.empty((M * top_k, 2 * N), dtype=x.dtype, device=x.device)
        act = torch.empty((M * top_k, N), dtype=x.dtype, device=x.device)
        routed = torch.empty((M * top_k, K), dtype=x.dtype, device=x.device)
        out = torch.empty_like(x)
        prepared.append((x, ids, block, tables, gate_up, act, routed, out))
    stages = {
        "align": lambda x, ids, block, tables, gate_up, act, routed, out: launch.moe_align_block_size(ids, E, block),
        "gemm1": lambda x, ids, block, tables, gate_up, act, routed, out: fwd.marlin_gemm(
            x, gate_up, marlin.w13, marlin.w13_scale, marlin.workspace, tables, block, top_k=ids.shape[1],
            mul_topk_weights=False, atomic=atomic),
        "silu": lambda x, ids, block, tables, gate_up, act, routed, out: launch.silu_and_mul(gate_up, out=act),
        "gemm2": lambda x, ids, block, tables, gate_up, act, routed, out: fwd.marlin_gemm(
            act, routed, marlin.w2, marlin.w2_scale, marlin.workspace, tables, block, top_k=1,
            mul_topk_weights=True, atomic=atomic),
        "topk_sum": lambda x, ids, block, tables, gate_up, act, routed, out: launch.moe_topk_sum(
            routed, ids, E, FACTOR, out=out),
    }
    result = {}
    for name, stage in stages.items():
        fns = [lambda p=p, f=stage: f(*p) for p in prepared]
        result[name], _ = graph_or_eager_us(fns, f"stage {name}")
    result["sum"] = sum(result.values())
    return result


SWEEP_SHAPES = {"small": (8, 256, 128, 2), "tp8": (384, 7168, 256, 8)}


def accuracy_sweep(draws: int, tokens=(1, 8, 65)) -> list:
    """Per-token relative error vs the fp32 reference over ``draws`` random routings/inputs per case, for
    each reduce mode and the bf16 model: (shape, tokens, source, median, max, share of draws > 1e-2)."""
    import torch

    from sglang_kdtree.moe import forward as fwd
    from sglang_kdtree.moe import reference as twin
    from sglang_kdtree.moe import weights as mw

    out = []
    for name, (E, K, N, top_k) in SWEEP_SHAPES.items():
        packed = mw.random_packed_weights(E, K, N, device=DEVICE, seed=5)
        marlin = mw.repack_for_marlin(packed)
        w13, w2 = bf16_experts(packed)
        gen = torch.Generator(device=DEVICE)
        gen.manual_seed(11)
        for M in tokens:
            errs = {m: [] for m in (*fwd.REDUCE_MODES, "bf16")}
            for _ in range(draws):
                ids = torch.topk(torch.rand((M, E), device=DEVICE, generator=gen), top_k, dim=1).indices.to(torch.int32)
                w = torch.rand((M, top_k), device=DEVICE, generator=gen) + 0.1
                w = w / w.sum(dim=1, keepdim=True)
                x = torch.randn((M, K), device=DEVICE, generator=gen).to(torch.bfloat16)
                ref = twin.fused_moe_reference(x, packed, w, ids, FACTOR)
                for mode in fwd.REDUCE_MODES:
                    errs[mode].append(max_rel(fwd.fused_moe_marlin(x, marlin, w, ids, FACTOR, reduce=mode), ref))
                errs["bf16"].append(max_rel(bf16_moe_loop(x, ids, w, w13, w2, FACTOR, bf16_moe_loop_plan(ids)), ref))
            for source, e in errs.items():
                e = sorted(e)
                out.append((name, M, source, e[len(e) // 2], e[-1], sum(v > 1e-2 for v in e) / len(e)))
        del packed, marlin, w13, w2
        torch.cuda.empty_cache()
    print()
    print(f"accuracy sweep ({draws} draws per row; per-token relative error vs the fp32 reference)")
    print("| shape | tokens | path | median | max | share > 1e-2 |")
    print("|---|---|---|---|---|---|")
    for name, M, source, med, mx, share in out:
        print(f"| {name} | {M} | {source} | {med:.2e} | {mx:.2e} | {share:.1%} |")
    return out


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of one cuBLAS ``n x n x n`` matmul (median of 10): what a dense GEMM reaches on this device,
    printed next to ``BF16_PEAK_FLOPS`` (the compute floor uses the datasheet peak)."""
    import torch

    a = torch.randn((n, n), device="cuda").to(torch.bfloat16)
    b = torch.randn((n, n), device="cuda").to(torch.bfloat16)
    c = torch.empty((n, n), dtype=torch.bfloat16, device="cuda")
    us = cuda_time_us(lambda: torch.mm(a, b, out=c), trials=10, warmup=3)
    return 2.0 * n**3 / (us * 1e-6)


def int_list(text: str) -> list:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv=None) -> int:
    global BREAKDOWN_TOKENS, REPEAT, ROTATE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tp8,tp1")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                        help=f"token counts (verify widths: {','.join(map(str, VERIFY_TOKENS))})")
    parser.add_argument("--breakdown-tokens", default=",".join(map(str, BREAKDOWN_TOKENS)),
                        help="token counts whose time is also split by stage (glue share, stage floors)")
    parser.add_argument("--rotate", type=int, default=ROTATE, help="routings/inputs cycled through per timed pass")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="passes over the rotation in one CUDA graph")
    parser.add_argument("--check-tokens", default="1,65,520",
                        help="token counts also checked against the fp32 reference (slow at TP 1)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep", type=int, default=0,
                        help="also run the accuracy sweep with this many random draws per case (0 = skip)")
    args = parser.parse_args(argv)
    BREAKDOWN_TOKENS = tuple(int_list(args.breakdown_tokens))
    ROTATE, REPEAT = max(1, args.rotate), max(1, args.repeat)
    import torch

    from sglang_kdtree.moe import jit

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"Marlin kernels ready in {jit.ensure_marlin_kernels('bfloat16'):.1f} s", flush=True)
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    mm = matmul_rate()
    print(f"{device}: copy bandwidth {bw / 1e12:.2f} TB/s; cuBLAS bf16 matmul {mm / 1e12:.0f} TFLOP/s "
          f"(compute floor uses the datasheet {BF16_PEAK_FLOPS / 1e12:.0f})", flush=True)
    tokens = int_list(args.tokens)
    check = set(int_list(args.check_tokens))
    rows = []

    def stop(signum, frame):  # `timeout` sends SIGTERM: still write and print what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    sweep = []
    try:
        if args.sweep:
            sweep = accuracy_sweep(args.sweep)
        for name in [s for s in args.shapes.split(",") if s]:
            run_shape(name, tokens, bw, rows, check)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}); {len(rows)} rows measured", flush=True)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "bandwidth": bw, "rows": rows, "sweep": sweep,
                           "peak_flops": BF16_PEAK_FLOPS, "matmul_flops": mm, "rotate": ROTATE, "repeat": REPEAT},
                          f, indent=1)
        print_table(rows, bw, device, mm)
    return 0


def test_bench_marlin_moe_tp8_65(benchmark):
    """pytest-benchmark case (GPU only): ours at TP 8, 65 tokens (eager, one routing)."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sglang_kdtree.moe import forward as fwd
    from sglang_kdtree.moe import weights as mw

    E, K, N = SHAPES["tp8"]
    marlin = mw.repack_for_marlin(mw.random_packed_weights(E, K, N, device="cuda", seed=1))
    ids = torch.topk(torch.rand((65, E), device="cuda"), TOP_K, dim=1).indices.to(torch.int32)
    w = torch.rand((65, TOP_K), device="cuda")
    x = torch.randn((65, K), device="cuda").to(torch.bfloat16)

    def call():
        fwd.fused_moe_marlin(x, marlin, w, ids, FACTOR)
        torch.cuda.synchronize()

    benchmark(call)


if __name__ == "__main__":
    raise SystemExit(main())
