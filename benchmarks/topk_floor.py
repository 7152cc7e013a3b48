"""What a top-K over draft logits can cost at the least, beside what ours costs, at each batch size: the HBM
floor (logits bytes / measured copy bandwidth), an empty kernel, the fastest single streaming read of the same
bf16 logits that a probe kernel here reaches (a max over each row chunk: the least work any top-K has to do, since
it must read every logit once), and our top-K (``sglang_kdtree.gpu.topk``, the kernels the worker launches).

Each is timed two ways, both CUDA-event medians of device time:
- ``1/graph``: a CUDA graph holding one call, replayed back to back (``topk_ab.py``'s measure);
- ``in graph``: one graph holding ``--calls`` back-to-back calls, per call (no graph launch between calls).

    python benchmarks/topk_floor.py [--batches 1 8 32 64] [--budgets 64 512] [--calls 20] [--json OUT]

The probe read kernels (below, benchmark-only) load 16 bytes per thread per step, every load of a thread in
flight at once, with 1, 2, 4 or 8 loads per thread (2,048 to 16,384 columns per block of 256 threads); the best
of the four is the column "best read". It is not a bound in the strict sense (another read kernel could be
faster), but a read that keeps every load in flight and does nothing else is what a top-K pass can at most hope
to match.
"""

from __future__ import annotations

import argparse
import json

from sglang_kdtree.cli.bench_timing import copy_bandwidth, floor_us, graph_replay_us

_PROBE = r"""
// Benchmark-only probes (benchmarks/topk_floor.py): an empty kernel, and a streaming max over bf16 row chunks.
extern "C" __global__ void probe_empty() {}

template <int LOADS>
__device__ __forceinline__ void read_max(const uint4* __restrict__ x, long long row_vecs, float* __restrict__ out) {
    const long long row = blockIdx.y;
    const long long v0 = (long long)blockIdx.x * blockDim.x * LOADS + threadIdx.x;
    const uint4* p = x + row * row_vecs;
    uint4 w[LOADS];
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
        const long long v = v0 + (long long)i * blockDim.x;
        w[i] = v < row_vecs ? p[v] : make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
    }
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
        const unsigned u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) m = fmaxf(m, fmaxf(__uint_as_float(u[j] << 16), __uint_as_float(u[j] & 0xffff0000u)));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x >> 5); ++i) m = fmaxf(m, part[i]);
        out[row * gridDim.x + blockIdx.x] = m;
    }
}

extern "C" __global__ void probe_read1(const uint4* x, long long n, float* out) { read_max<1>(x, n, out); }
extern "C" __global__ void probe_read2(const uint4* x, long long n, float* out) { read_max<2>(x, n, out); }
extern "C" __global__ void probe_read4(const uint4* x, long long n, float* out) { read_max<4>(x, n, out); }
extern "C" __global__ void probe_read8(const uint4* x, long long n, float* out) { read_max<8>(x, n, out); }
"""

_THREADS = 256
_LOADS = (1, 2, 4, 8)


def _probe_module():
    import cupy

    return cupy.RawModule(code=_PROBE, options=("-std=c++17",))


def timings(fn, calls: int) -> tuple[float, float]:
    """(us per replay of a one-call graph, us per call in a graph of ``calls`` calls), device time."""
    return graph_replay_us(fn, trials=5), graph_replay_us(fn, repeat=calls, replays=1, trials=5)


def main(argv=None) -> int:
    import numpy as np
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import runtime, topk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 512])
    p.add_argument("--calls", type=int, default=20, help="calls per graph for the 'in graph' figures")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    mod = _probe_module()
    empty = mod.get_function("probe_empty")
    reads = {n: mod.get_function(f"probe_read{n}") for n in _LOADS}
    bw = copy_bandwidth()
    depth, vocab = 15, 163840
    rows_out = []

    def launch(fn, grid, args=()):
        with runtime.current_stream():
            fn(grid, (_THREADS,), args)

    for bs in a.batches:
        logits = peaked_logits(bs, depth, vocab, seed=bs)
        rows, vecs = bs * depth, vocab // 8
        floor = floor_us(logits.numel() * 2, bw)
        row = {"batch": bs, "floor_us": floor}
        row["empty1_us"], row["empty1_in_graph_us"] = timings(lambda: launch(empty, (1,)), a.calls)
        grid_blocks = (-(-vecs // (_THREADS * 4)), rows)
        row["empty_grid_us"], row["empty_grid_in_graph_us"] = timings(lambda: launch(empty, grid_blocks), a.calls)
        truth = logits.float().amax(dim=-1).reshape(-1)
        best = None
        for n, fn in reads.items():
            chunks = -(-vecs // (_THREADS * n))
            out = torch.full((rows * chunks,), float("nan"), device="cuda")  # poisoned: an unwritten max stays NaN
            args = (np.uint64(logits.data_ptr()), np.int64(vecs), np.uint64(out.data_ptr()))

            def call(fn=fn, chunks=chunks, args=args):
                launch(fn, (chunks, rows), args)

            call()
            torch.cuda.synchronize()
            ok = bool(torch.equal(out.view(rows, chunks).amax(dim=1), truth))
            t1, tn = timings(call, a.calls)
            row[f"read{n}"] = {"us": t1, "in_graph_us": tn, "exact": ok}
            if ok and (best is None or t1 < best[0]):
                best = (t1, tn, n)
        if best is None:
            raise SystemExit(f"batch {bs}: no probe read matched torch.amax over the logits; the timings are void")
        row["best_read_us"], row["best_read_in_graph_us"], row["best_read_loads"] = best
        for budget in a.budgets:
            ws = topk.TopKWorkspace(rows, vocab, budget, "cuda")
            out = (torch.empty(rows * budget, device="cuda"), torch.empty(rows * budget, dtype=torch.int64, device="cuda"))
            flag = topk.new_error_flag("cuda")

            def call(ws=ws, out=out, flag=flag, budget=budget):
                return topk.topk_logprobs(logits, budget, workspace=ws, out=out, error_flag=flag)

            row[f"topk{budget}_us"], row[f"topk{budget}_in_graph_us"] = timings(call, a.calls)
            row[f"topk{budget}_flag"] = int(flag.item())
            del ws
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del logits
        torch.cuda.empty_cache()

    print(f"us (device time); copy bw {bw / 1e12:.2f} TB/s; each cell: 1/graph | in graph (per call, {a.calls} calls"
          " per graph); % = HBM floor / time")
    head = f"{'bs':>3} {'floor':>6} | {'empty 1 block':>13} | {'empty grid':>11} | {'best read':>22}"
    head += "".join(f" | {'top-K K ' + str(b):>24}" for b in a.budgets)
    print(head)
    for r in rows_out:
        f = r["floor_us"]
        line = (f"{r['batch']:>3} {f:6.1f} | {r['empty1_us']:5.1f} {r['empty1_in_graph_us']:5.1f}   | "
                f"{r['empty_grid_us']:5.1f} {r['empty_grid_in_graph_us']:5.1f} | "
                f"{r['best_read_us']:5.1f} ({100 * f / r['best_read_us']:3.0f}%) "
                f"{r['best_read_in_graph_us']:5.1f} ({100 * f / r['best_read_in_graph_us']:3.0f}%)")
        for b in a.budgets:
            t1, tn = r[f"topk{b}_us"], r[f"topk{b}_in_graph_us"]
            line += f" | {t1:6.1f} ({100 * f / t1:3.0f}%) {tn:6.1f} ({100 * f / tn:3.0f}%)"
        print(line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_bw": bw, "rows": rows_out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
