"""The device time of a served decode step by kind of kernel, from a torch-profiler trace (SGLang's
``/start_profile``).

A decode round's log splits it into phases (draft, tree, verify, accept + commit) but not the verify forward into
its layers' parts, which is what ``kimi_round``'s model adds up. The kernels say it: every kernel a step runs (CUPTI
reports the kernels of a CUDA-graph replay one by one) is put in one class by its name (``CLASSES``, first match
wins), and each class's device time is summed over the profiled decode steps:

* ``moe``: the routed experts (SGLang's Marlin GEMMs and this package's MoE align / SiLU / top-k sum kernels) and
  the router's top-k;
* ``mla``: this package's MLA tree-verify kernels (the target's attention in a KDTREE verify);
* ``attention``: every other attention kernel (plain's decode attention, the drafter's);
* ``kdtree``: this package's round bookkeeping (top-K, tree, verify inputs, accept, commit, KV compaction);
* ``gemm``: dense matrix products (the projections, the shared expert, the dense layer, the heads);
* ``other``: the rest (norms, rotary, elementwise, copies, sampling).

    python -m benchmarks.kernel_split TRACE.json.gz --steps 12    # one table
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

CLASSES = (
    ("kdtree", re.compile(r"hist_pass|hist_select|topk_chunk|topk_merge|build_trees|verify_inputs|accept_|commit_plan"
                          r"|compact_kv|gather_hidden", re.I)),
    ("mla", re.compile(r"mla_tree_verify", re.I)),
    ("moe", re.compile(r"marlin|moe|topk_sum|silu_and_mul_bf16|grouped_topk|biased_topk|expert", re.I)),
    ("attention", re.compile(r"attention|attn|_fwd_|fmha|flash|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|splitk|sm90_|sm100_|sm120_", re.I)),
)
NAMES = tuple(name for name, _ in CLASSES) + ("other",)


def classify(kernel: str) -> str:
    """The class of a kernel name (module docstring)."""
    for name, pattern in CLASSES:
        if pattern.search(kernel):
            return name
    return "other"


def read_trace(path: Path) -> list[dict]:
    """The kernel events (``"cat": "kernel"``) of a Chrome trace, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("cat") == "kernel" and "dur" in e]


def split(events: list[dict], steps: int, top: int = 8) -> dict:
    """Per class: device ms per step (summed kernel durations / ``steps``) and kernel launches per step; ``busy_ms``
    their sum; ``span_ms`` first kernel start to last kernel end per step (busy plus the device's idle gaps);
    ``top``: the longest kernels by total time, with their class."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, not {steps}")
    ms = dict.fromkeys(NAMES, 0.0)
    count = dict.fromkeys(NAMES, 0)
    by_name: dict = {}
    for e in events:
        c = classify(e["name"])
        ms[c] += e["dur"] / 1e3
        count[c] += 1
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1e3
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3 if events else 0.0
    longest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": steps, "ms": {c: round(v / steps, 4) for c, v in ms.items()},
            "launches": {c: round(v / steps, 1) for c, v in count.items()},
            "busy_ms": round(sum(ms.values()) / steps, 4), "span_ms": round(span / steps, 4),
            "top": [{"name": n[:120], "class": classify(n), "ms_per_step": round(v / steps, 4)} for n, v in longest]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--steps", type=int, required=True, help="decode steps the trace holds")
    args = ap.parse_args(argv)
    out = split(read_trace(args.trace), args.steps)
    print("| class | ms per step | launches per step |\n|---|---|---|")
    for c in NAMES:
        print(f"| {c} | {out['ms'][c]:.3f} | {out['launches'][c]:.0f} |")
    print(f"busy {out['busy_ms']:.3f} ms, span {out['span_ms']:.3f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
