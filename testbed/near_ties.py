"""Where a speculative server's greedy output leaves plain's, is it a near tie of the target? Checked in float64.

    python -m testbed.near_ties --pair DIR --outputs outputs.json.gz [--json OUT]

``outputs.json.gz`` is ``python -m testbed.acceptance``'s per-request outputs (``KIND@T=0`` -> one result per
held-out prompt). For every greedy divergence from ``plain@T=0`` (prompt, first differing position, the two
tokens; the servers that share it), the pair's target runs in float64 on the CPU on the prompt plus plain's tokens
before that position, and reports the gap between its two best logits and which of the two tokens it prefers.

A verify forward (many rows of one request in one extend pass) and a decode step compute the same logits with
different kernels and reduction orders; where the two best logits lie closer than those kernels' error, either
token is a correct greedy choice, and a divergence there says nothing about the tree or the accept rule. A
divergence at a wide gap would be a bug.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from testbed.acceptance import first_difference


def divergences(outputs: dict, reference: str = "plain@T=0") -> dict:
    """``{(prompt, position, reference token, other token): [kinds]}`` over every ``KIND@T=0`` but the reference
    (an output that only stops earlier or later has no token pair to check, and is left out)."""
    ref = [r["output_ids"] for r in outputs[reference]]
    found: dict = {}
    for key, results in outputs.items():
        if key == reference or not key.endswith("@T=0"):
            continue
        for i, (a, r) in enumerate(zip(ref, results)):
            b = r["output_ids"]
            j = first_difference(a, b)
            if j is not None and j < min(len(a), len(b)):
                found.setdefault((i, j, a[j], b[j]), []).append(key.split("@")[0])
    return found


def logit_gap(model, ids: list[int], token_a: int, token_b: int) -> dict:
    """The float64 next-token logits after ``ids``: the top-2 gap, ``a - b``, and the largest |logit|."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), last_only=True)
    row = logits.reshape(-1)
    top = torch.topk(row, 2)
    return {"top2": top.indices.tolist(), "top2_gap": float(top.values[0] - top.values[1]),
            "a_minus_b": float(row[token_a] - row[token_b]), "max_abs_logit": float(row.abs().max())}


def main(argv=None) -> int:
    from testbed import target as tg

    p = argparse.ArgumentParser(prog="python -m testbed.near_ties", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, required=True)
    p.add_argument("--outputs", type=Path, required=True, help="testbed.acceptance's outputs.json.gz")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    outputs = json.load(gzip.open(a.outputs))
    prompts = [json.loads(line) for line in (a.pair / "heldout_prompts.jsonl").read_text().splitlines() if line]
    model = tg.load(a.pair / "target").double().eval()
    plain = [r["output_ids"] for r in outputs["plain@T=0"]]
    rows = []
    for (i, j, tok_plain, tok_other), kinds in sorted(divergences(outputs).items()):
        gap = logit_gap(model, prompts[i]["input_ids"] + plain[i][:j], tok_plain, tok_other)
        rows.append({"prompt": i, "position": j, "plain": tok_plain, "other": tok_other, "servers": kinds, **gap})
        print(f"prompt {i:3d} pos {j:3d}: plain {tok_plain} / other {tok_other}; float64 top-2 {gap['top2']}, gap "
              f"{gap['top2_gap']:.2e} (|logit| max {gap['max_abs_logit']:.1f}), plain - other {gap['a_minus_b']:+.2e}; "
              f"{', '.join(kinds)}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
