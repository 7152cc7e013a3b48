"""Top-K + lse kernel timings on peaked bf16 draft logits [bs, 15, 163840]: each top-K pipeline of
``sglang_kdtree.gpu.topk`` (``--impls``: "histogram", "cut"; with other NVRTC variants) and an older launcher
module when one is importable, all from the same
run, as replayed CUDA graphs of one ``topk_logprobs`` call (the real GPU time, no Python launch overhead)
and eagerly. Prints one row per (batch, budget) plus the HBM floor (logits bytes / measured copy bandwidth) and
the time of one streaming read of the same logits (``torch.amax`` over the vocabulary, a replayed graph): what
torch's own one-pass reduction over them costs at that batch, launch and tail included (a reference point, not a
bound: a tuned pass can beat it, as hist_pass does at batch 1 and 8).

    python benchmarks/topk_ab.py [--impls histogram cut] [--old sglang_kdtree.gpu.topk_old] [--variant=-DNAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib
import json

from sglang_kdtree.cli.bench_timing import copy_bandwidth, cuda_time_us, floor_us, graph_replay_us


def main(argv=None) -> int:
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu import topk as new

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--impls", nargs="+", default=["histogram", "cut"], help="topk.IMPL pipelines to time")
    p.add_argument("--old", default=None, help="module path of an older topk launcher to compare")
    p.add_argument("--variant", action="append", default=[],
                   help="extra NVRTC option set (space-separated) for the first impl's kernel, given with '=' since it "
                        "starts with a dash: --variant=-DCHUNK_MIN_BLOCKS=2")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    old = None
    if a.old:
        try:
            old = importlib.import_module(a.old)
        except ImportError as exc:
            print(f"old module {a.old} not importable: {exc}")
    bw = copy_bandwidth()
    depth, vocab = 15, 163840
    rows_out = []
    impls = ([(i, new, (), i) for i in a.impls] + [(f"{a.impls[0]}[{v}]", new, tuple(v.split()), a.impls[0])
                                                      for v in a.variant]
             + ([("old", old, (), None)] if old else []))
    for bs in a.batches:
        logits = peaked_logits(bs, depth, vocab, seed=bs)
        floor = floor_us(logits.numel() * 2, bw)
        amax_out = torch.empty(logits.shape[:-1], dtype=logits.dtype, device="cuda")
        read = graph_replay_us(lambda: torch.amax(logits, dim=-1, out=amax_out))
        for budget in a.budgets:
            row = {"batch": bs, "budget": budget, "floor_us": floor, "read_us": read}
            ref_ids = None
            for name, mod, opts, impl in impls:
                if mod is new:
                    new._OPTIONS = opts
                ws = (mod.TopKWorkspace(bs * depth, vocab, budget, "cuda", impl=impl) if impl
                      else mod.TopKWorkspace(bs * depth, vocab, budget, "cuda"))
                out = (torch.empty(bs * depth * budget, device="cuda"),
                       torch.empty(bs * depth * budget, dtype=torch.int64, device="cuda"))
                flag = mod.new_error_flag("cuda")

                def call(mod=mod, ws=ws, out=out, flag=flag):
                    return mod.topk_logprobs(logits, budget, workspace=ws, out=out, error_flag=flag)

                lp, ids = call()
                torch.cuda.synchronize()
                ids = ids.clone()
                if ref_ids is None:
                    ref_ids = ids
                row[f"{name}_same_ids"] = bool(torch.equal(ids, ref_ids))
                row[f"{name}_graph_us"] = graph_replay_us(call)
                row[f"{name}_eager_us"] = cuda_time_us(call, trials=20, warmup=3)
                row[f"{name}_flag"] = int(flag.item())
                del ws
            new._OPTIONS = ()
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del logits
        torch.cuda.empty_cache()
    names = [n for n, _, _, _ in impls]
    head = f"{'bs':>3} {'B':>4} {'floor':>6} {'read':>6} | " + " | ".join(f"{n + ' graph':>16} {'%fl':>4} {'eager':>7}" for n in names)
    print(head)
    for r in rows_out:
        cells = []
        for n in names:
            g = r[f"{n}_graph_us"]
            cells.append(f"{g:16.1f} {100 * r['floor_us'] / g:3.0f}% {r[f'{n}_eager_us']:7.1f}"
                         + ("" if r[f"{n}_same_ids"] else " DIFF"))
        print(f"{r['batch']:>3} {r['budget']:>4} {r['floor_us']:6.1f} {r['read_us']:6.1f} | " + " | ".join(cells))
    print(f"us; graph = replayed CUDA graph of one topk call; %fl = HBM floor / graph time; copy bw {bw / 1e12:.2f} TB/s;"
          " read = torch.amax over the same logits (one streaming pass, graph); DIFF = ids differ from the first column")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
