"""What ``cuda_servers.py`` compares between two servers' outputs and logs: plain functions over their JSON, so the
CPU tests check them without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

from testbed.acceptance import first_difference


def logprob_pair(plain: list[dict], spec: list[dict]) -> dict:
    """Ids identical, and the largest |difference| of the output tokens' logprobs (same tokens)."""
    ids_same = [r["output_ids"] for r in plain] == [r["output_ids"] for r in spec]
    diff = 0.0
    for a, b in zip(plain, spec):
        la = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lb = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        if len(la) != len(lb) or any(x is None or y is None for x, y in zip(la, lb)):
            return {"ids_identical": ids_same, "max_abs_diff": None, "error": "missing or unequal logprobs"}
        diff = max([diff] + [abs(x - y) for x, y in zip(la, lb)])
    return {"ids_identical": ids_same, "max_abs_diff": diff, "error": None}


def first_mismatch(a: list[dict], b: list[dict]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        j = first_difference(x["output_ids"], y["output_ids"])
        if j is not None:
            return f"prompt {i}: first differing output index {j}: {x['output_ids']} vs {y['output_ids']}"
    return None


def host_syncs(path: Path) -> dict:
    """``KDTREE_SYNC_DEBUG``'s lines (every host sync inside a decode round, which the overlap path must not have):
    their number, and their sites with a count each."""
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    sites: dict = {}
    for r in records:
        sites[f"{r['file']}:{r['line']}"] = sites.get(f"{r['file']}:{r['line']}", 0) + 1
    return {"host_syncs": len(records), "host_sync_sites": sites}
