"""The roofline arithmetic and the tables of ``bench_marlin_moe.py``: the INT4 weight bytes a call touches, its
tensor-core FLOPs, which floor binds (weights or compute), each stage's own floor, the glue's share of a call, and
the markdown tables the benchmark prints from its rows. Pure host arithmetic (no torch), so the CPU tests check it
by hand.
"""

from __future__ import annotations

GROUP = 32  # INT4 scale group along the input dimension
#: Dense (no 2:4 sparsity) bf16 tensor-core peak of one H200 SXM, FLOP/s. NVIDIA's H200 datasheet lists "BF16
#: Tensor Core 1,979 TFLOPS" with sparsity, i.e. 989 TFLOP/s dense; the same figure as the H100 SXM (132 SMs x
#: 4 tensor cores x 512 bf16 FMA/clk = 4096 FLOP/clk/SM, at the 1.83 GHz boost clock = 989.4e12). Reachable
#: only with Hopper's wgmma; Marlin issues Ampere-style mma.sync, which tops out well below it.
BF16_PEAK_FLOPS = 989e12
GLUE_STAGES = ("align", "silu", "topk_sum")  # every stage of fused_moe_marlin but the two Marlin GEMMs
GEMM_STAGES = ("gemm1", "gemm2")
GLUE_FLAG_SHARE = 0.10  # the glue is worth improving where it is more than 10 % of the call


def expert_bytes(K: int, N: int, group: int = GROUP) -> int:
    """Bytes one expert's weights occupy in the INT4 checkpoint layout: packed gate|up and down + bf16 scales."""
    return gemm_weight_bytes(K, 2 * N, group) + gemm_weight_bytes(N, K, group)


def gemm_weight_bytes(size_in: int, size_out: int, group: int = GROUP) -> int:
    """Bytes of one expert's INT4 ``[size_in, size_out]`` matrix: packed nibbles + bf16 scale per group of inputs."""
    return size_in * size_out // 2 + size_in // group * size_out * 2


def moe_flops(tokens: int, top_k: int, K: int, N: int) -> float:
    """Useful tensor-core FLOPs of one call: every route runs gate|up (K x 2N) and down (N x K), 2 FLOPs per
    multiply-add (Marlin's padding of each expert's rows up to its block height is not counted)."""
    return 2.0 * tokens * top_k * (K * 2 * N + N * K)


def bound_by(weight_floor_us: float, flops: float, ours_us: float, peak: float = BF16_PEAK_FLOPS) -> dict:
    """Which floor binds a call: the INT4 weight floor (``weight_floor_us``) or the compute floor (``flops`` at
    ``peak`` FLOP/s), whichever is larger, and ``ours_us`` as a % of it (binding floor / ours)."""
    compute_us = flops / peak * 1e6
    bound = "compute" if compute_us > weight_floor_us else "weights"
    floor = max(compute_us, weight_floor_us)
    return {"compute_floor_us": compute_us, "bound": bound, "bound_floor_us": floor,
            "pct_bound": 100 * floor / ours_us, "tflops": flops / ours_us * 1e-6}


def stage_floors_us(tokens: int, top_k: int, K: int, N: int, experts: float, bw: float,
                    peak: float = BF16_PEAK_FLOPS) -> dict:
    """Each stage's own floor in microseconds: the GEMMs' larger of weight bytes (``experts`` touched) / ``bw``
    and FLOPs / ``peak``; SiLU-and-mul and the top-k sum: the bf16 bytes they read and write / ``bw`` (align is
    launch-bound: no floor)."""
    routes = tokens * top_k
    w1, w2 = experts * gemm_weight_bytes(K, 2 * N), experts * gemm_weight_bytes(N, K)
    f1, f2 = 2.0 * routes * K * 2 * N, 2.0 * routes * N * K
    return {
        "gemm1": max(w1 / bw, f1 / peak) * 1e6,
        "silu": (routes * 2 * N + routes * N) * 2 / bw * 1e6,
        "gemm2": max(w2 / bw, f2 / peak) * 1e6,
        "topk_sum": (routes * K + tokens * K) * 2 / bw * 1e6,
    }


def glue_split(stages_us: dict, whole_us: float, flag_share: float = GLUE_FLAG_SHARE) -> dict:
    """The glue's share of a call: each of ``GLUE_STAGES``' time (on its own) as a % of the whole call, their
    sum, the GEMMs' sum, the rest (whole call minus every stage: launch gaps, allocation; negative when the
    stages overlap in the whole call) and ``flag`` = glue over ``flag_share`` of the call."""
    glue = sum(stages_us[k] for k in GLUE_STAGES)
    gemms = sum(stages_us[k] for k in GEMM_STAGES)
    out = {f"{k}_pct": 100 * stages_us[k] / whole_us for k in GLUE_STAGES}
    out.update(glue_us=glue, glue_pct=100 * glue / whole_us, gemm_us=gemms, gemm_pct=100 * gemms / whole_us,
               rest_us=whole_us - glue - gemms, flag=glue > flag_share * whole_us)
    return out


def print_table(rows, bw, device, matmul_flops=None):
    print()
    print(f"device: {device}; HBM copy bandwidth {bw / 1e12:.2f} TB/s; ours = graph replay with the default reduce; "
          "targets: >= 60% of floor and >= 3x bf16 at <= 65 tokens")
    print("| shape | tokens | experts | floor us | ours us | % floor | atomic us | fp32 us | bf16 us | x bf16 | "
          "ours eager us | max rel err atomic / fp32 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = lambda key: "" if r.get(key, "graph") == "graph" else " (eager)"
        rel = " / ".join(f"{r['rel_' + k]:.1e}" if "rel_" + k in r else "-" for k in ("atomic", "fp32", "bf16"))
        print(f"| {r['shape']} | {r['tokens']} | {r['experts']:.1f} | {r['floor_us']:.1f} | "
              f"{r['ours_graph_us']:.1f}{mark('ours_timing')} ({r['ours_reduce']}) | {r['pct_floor']:.0f}% | "
              f"{r['atomic_graph_us']:.1f}{mark('atomic_timing')} | {r['fp32_graph_us']:.1f}{mark('fp32_timing')} | "
              f"{r['bf16_graph_us']:.1f}{mark('bf16_timing')} | {r['x_vs_bf16']:.2f} | {r['ours_eager_us']:.1f} | "
              f"{rel} |")
    split = [r for r in rows if "stages_us" in r]
    if split:
        names = list(split[0]["stages_us"])
        print()
        print(f"stages on their own (graph replay, us, {split[0]['ours_reduce']} reduce); glue = "
              f"{' + '.join(GLUE_STAGES)} (everything but the two Marlin GEMMs), % of the whole call; "
              f"rest = whole call - every stage; flag: glue > {GLUE_FLAG_SHARE:.0%} of the call")
        print("| shape | tokens | " + " | ".join(names) + " | whole call | "
              + " | ".join(f"{k} %" for k in GLUE_STAGES) + " | glue us | glue % | GEMMs % | rest us | glue > "
              f"{GLUE_FLAG_SHARE:.0%} |")
        print("|---|---|" + "---|" * (len(names) + len(GLUE_STAGES) + 6))
        for r in split:
            g = r.get("glue") or glue_split(r["stages_us"], r["ours_graph_us"])
            print(f"| {r['shape']} | {r['tokens']} | " + " | ".join(f"{r['stages_us'][k]:.1f}" for k in names)
                  + f" | {r['ours_graph_us']:.1f} | " + " | ".join(f"{g[k + '_pct']:.1f}" for k in GLUE_STAGES)
                  + f" | {g['glue_us']:.1f} | {g['glue_pct']:.1f} | {g['gemm_pct']:.1f} | {g['rest_us']:.1f} | "
                  + ("**YES**" if g["flag"] else "no") + " |")
        floored = [r for r in split if "stage_floors_us" in r]
        if floored:
            fnames = list(floored[0]["stage_floors_us"])
            print()
            print("each stage vs its own floor (us floor / % of it reached): GEMMs = max(INT4 weight bytes of the "
                  "touched experts / bandwidth, FLOPs / peak); silu, topk_sum = bf16 bytes read + written / bandwidth")
            print("| shape | tokens | " + " | ".join(fnames) + " |")
            print("|---|---|" + "---|" * len(fnames))
            for r in floored:
                cells = (f"{r['stage_floors_us'][k]:.1f} / {100 * r['stage_floors_us'][k] / r['stages_us'][k]:.0f}%"
                         for k in fnames)
                print(f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells) + " |")
    small = [r for r in rows if r["tokens"] <= 65]
    if small:
        ok_floor = all(r["pct_floor"] >= 60 for r in small)
        ok_bf16 = all(r["x_vs_bf16"] >= 3 for r in small)
        print(f"targets at <= 65 tokens: floor {'met' if ok_floor else 'MISSED'}, bf16 {'met' if ok_bf16 else 'MISSED'}")
    bound = [r for r in rows if "bound" in r]
    if bound:
        print()
        measured = f"; measured cuBLAS bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s" if matmul_flops else ""
        print(f"binding floor: weights = INT4 bytes of the touched experts / {bw / 1e12:.2f} TB/s copy bandwidth; "
              "compute = 2 x tokens x top_k x (hidden x 2 inter + inter x hidden) FLOPs / "
              f"{BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s (dense bf16 tensor-core peak, NVIDIA H200 SXM datasheet){measured}; "
              "% bound = binding floor / ours")
        print("| shape | tokens | experts | weight floor us | compute floor us | binds | ours us | "
              "% of binding floor | TFLOP/s | glue % |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in bound:
            glue = f"{r['glue']['glue_pct']:.1f}" + (" (>10%)" if r["glue"]["flag"] else "") if "glue" in r else "-"
            print(f"| {r['shape']} | {r['tokens']} | {r['experts']:.1f} | {r['floor_us']:.1f} | "
                  f"{r['compute_floor_us']:.1f} | {r['bound']} | {r['ours_graph_us']:.1f} | {r['pct_bound']:.0f}% | "
                  f"{r['tflops']:.0f} | {glue} |")
