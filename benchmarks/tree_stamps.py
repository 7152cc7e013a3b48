"""Where the best-first tree kernel's time goes: ``build_trees_list1`` (budget <= 64, the kernel a server's tree step
launches at budget 64) with ``clock64`` stamps in a patched copy, block 0, per phase: staging the log-probs, the pop
loop (warp 0), the input validation (warps 1-3, beside it), the write-out; plus each copy's graph-replayed time.

    python benchmarks/tree_stamps.py [--batches 1 8 32] [--old PATH/best_first_tree.cu] [--json OUT.json]

Inputs: the histogram top-K (K 64) of ``bench_gpu.peaked_logits`` [bs, 15, 163840], and the same shape with heavy
exact ties (log-probs on a 1/4 grid). ``--old`` times an older copy of the kernel file beside the working tree's, same
inputs, and checks that every output is identical to it. The stamps need ``build_trees_list``'s body as this file
expects it (otherwise the CLI exits naming the kernel text it could not find).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

# the kernel texts the stamps go around (build_trees_list's body: the older sorted list, for --old copies, and the
# padded-rows list), and where they go: after which line of the body
BODIES = ("""  stage_rows(S, lp, L, K, KS);
  if (tid == 0) init_root(node_parent, node_rank, node_depth, node_score, &s_nodes);
  __syncthreads();
  if (tid < 32) {
    const int n = list_tree<J>(S, L, KS, budget, node_parent, node_rank, node_depth, node_score);
    if (tid == 0) s_nodes = n;
  }
  validate_rows(lp, ids, L, K, err);
  __syncthreads();""", """  stage_rows_padded(S, lp, L, K, KS);
  if (tid == 0) s_nodes = 0;
  __syncthreads();
  if (tid < 32) {
    const int n = list_tree<J>(S, L, stride, budget, node_meta, node_score);
    if (tid == 0) s_nodes = n;
  }
  validate_rows(lp, ids, L, K, err);
  __syncthreads();""")
GLOBAL_T = 'unsigned long long g; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g)); if (b == 0) g_st[{}] = g;'
STAMPS_AFTER = {0: "  if (tid == 0) STAMP(1);", 2: "  if (tid == 0) STAMP(2);", 6: "  if (tid == 0) STAMP(3);",
                7: "  if (tid == 32) STAMP(4);", 8: "  if (tid == 0) STAMP(5);"}


def stamped_body(body: str) -> str:
    out = ["  if (tid == 0) { STAMP(0); " + GLOBAL_T.format(10) + " }"]
    for i, line in enumerate(body.split("\n")):
        out.append(line)
        if i in STAMPS_AFTER:
            out.append(STAMPS_AFTER[i])
    return "\n".join(out)


# the end of build_trees_list's write-out (before the fused tree + verify kernels, and with them), and the stamp
# after it
ENDS = ("""scores, num_nodes);
}

// build_trees_list<J> for budget <= 64 * J""", """scores, num_nodes, V ? &rows : nullptr);
  if (V) {""")
END_STAMP = "  if (tid == 0) { STAMP(6); " + GLOBAL_T.format(11) + " }\n"  # after the end's first line
HEAD = ("__device__ unsigned long long g_st[16];\n"
        "#define STAMP(i) do { if (blockIdx.x == 0) g_st[i] = clock64(); } while (0)\n")
PHASES = ("stage", "sync", "pops", "validate", "sync2", "write")


def stamped_source(text: str, name: str) -> str:
    from sglang_kdtree.gpu import runtime

    body = next((b for b in BODIES if b in text), None)
    end = next((e for e in ENDS if e in text), None)
    include = next((line for line in text.splitlines() if line.startswith('#include "')), None)
    for part, what in ((body, "build_trees_list's body"), (end, "the end of its write-out"),
                       (include, "an #include line")):
        if part is None:
            raise SystemExit(f"{name}: build_trees_list is not one this script stamps (missing {what})")
    text = text.replace(include, include + "\n" + HEAD, 1)
    first, rest = end.split("\n", 1)
    text = text.replace(body, stamped_body(body)).replace(end, first + "\n" + END_STAMP + rest)
    # the digest line, as compile_source writes it
    return f"// sglang_kdtree/kernels/*.cuh sha256 {runtime.headers_digest()}\n" + text


def run_copy(text, name, lp, ids, bs):
    import cupy
    import torch

    from sglang_kdtree.cli.bench_timing import capture_graph, cuda_time_us
    from sglang_kdtree.gpu import runtime

    mod = cupy.RawModule(code=stamped_source(text, name),
                         options=("--std=c++17", "-fmad=false", f"-I{runtime.kernels_dir()}"))
    fn = mod.get_function("build_trees_list1")
    stamps = cupy.ndarray((16,), cupy.uint64, memptr=mod.get_global("g_st"))
    budget, depth, k = 64, lp.shape[1], lp.shape[2]
    width, ks = budget + 1, min(k, budget + 1)
    outs = [torch.full((bs * width,), -7, dtype=torch.int64, device="cuda") for _ in range(4)]  # poisoned
    scores = torch.full((bs * width,), float("nan"), dtype=torch.float64, device="cuda")
    nodes = torch.full((bs,), -7, dtype=torch.int64, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    p = runtime.device_ptr
    args = (p(lp), p(ids), p(roots), np.int32(depth), np.int32(k), np.int32(budget), np.int32(ks), p(outs[0]),
            p(outs[1]), p(outs[2]), p(outs[3]), p(scores), p(nodes), p(err))

    def call():
        with runtime.current_stream():
            fn((bs,), (128,), args, shared_mem=(depth + 1) * (ks + 1) * 8)  # enough for either list layout

    graph, _ = capture_graph(call)
    us = cuda_time_us(lambda: [graph.replay() for _ in range(20)], calls=20, trials=5)
    samples = []
    for _ in range(30):
        graph.replay()
        torch.cuda.synchronize()
        s = stamps.get().astype(np.int64)
        samples.append([s[i] - s[0] for i in range(1, 7)] + [s[11] - s[10]])
    med = [statistics.median(c[i] for c in samples) for i in range(7)]
    row = {"graph_us": us, "cycles": dict(zip(PHASES, med[:6])), "block0_ns": med[6],
           "nodes": int(nodes[0]), "error_bits": int(err.item())}
    return row, [o.clone() for o in outs] + [scores.clone(), nodes.clone()]


def main(argv=None) -> int:
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import runtime, topk

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--old", type=Path, default=None, help="an older best_first_tree.cu to time beside this one")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    copies = [("new", (runtime.kernels_dir() / "best_first_tree.cu").read_text())]
    if a.old:
        copies.insert(0, ("old", a.old.read_text()))
    rows = []
    print(f"{'bs':>3} {'input':6} {'copy':4} {'graph us':>8} | cycles from block 0's start: "
          + " ".join(f"{p:>8}" for p in PHASES) + " | block us  same")
    for bs in a.batches:
        lp, ids = topk.topk_logprobs(peaked_logits(bs, 15, 163840, seed=bs), 64)
        g = torch.Generator(device="cuda").manual_seed(7 + bs)
        ties = -torch.sort(torch.randint(0, 12, lp.shape, device="cuda", generator=g).float() / 4, -1).values
        for label, x in (("peaked", lp.contiguous()), ("ties", ties.contiguous())):
            first = None
            for name, text in copies:
                row, out = run_copy(text, name, x, ids.contiguous(), bs)
                same = first is None or all(torch.equal(u, v) for u, v in zip(out, first))
                first = first or out
                row.update(batch=bs, input=label, copy=name, same_as_first=same)
                rows.append(row)
                c = row["cycles"]
                print(f"{bs:>3} {label:6} {name:4} {row['graph_us']:8.2f} | {'':29}"
                      + " ".join(f"{c[p]:8.0f}" for p in PHASES)
                      + f" | {row['block0_ns'] / 1e3:8.2f}  {'yes' if same else 'DIFF'}", flush=True)
    print("cycles: clock64 at the end of each phase minus at block 0's start (stage: log-probs into shared memory; "
          "sync: the barrier after it; pops: warp 0's pop loop; validate: warp 1's validation; sync2; write: the "
          "outputs); graph us: one launch replayed in a CUDA graph; same: outputs identical to the first copy's")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
