"""The Kimi round model corrected by a served rank: the pieces a served one-GPU rank (``bench_rank.py``) showed the
model to get wrong, taken from the served round instead.

The served rank (12 of 61 layers, one H100, random weights; RESULTS.md "One Kimi K2.6 rank on one GPU") against
``kimi_round``'s model from H200 pieces, cell for cell at context 4k:

* **the target's forward** (plain's step, KDTREE's verify at every width) is 1.33-1.42x the model, the bandwidth
  ratio of the two devices (H200 4.8 TB/s / H100 3.35 TB/s = 1.43): right once priced for the device, so unchanged;
* **the drafter** is 3.2-3.7x the model (2.2-2.6x once priced for the device): SGLang runs the DFlash drafter's
  attention over the whole context with its Triton extend kernel (1.3 ms of the drafter's 4.8 at batch 8, profiled;
  the drafter phase grows to 14.8 ms at 61), where the model timed torch SDPA; replaced by the served drafter phase;
* **the bookkeeping** (tree + accept + commit) is 4.7-6.9x the model: the model times this package's two captured
  graphs only, the served round also SGLang's verify preparation and the drafter's projection of the accepted
  tokens' hidden states (``features``, 0.27 ms at batch 1); replaced by the served tree and accept + commit phases.

``served_pieces`` turns a rank report into those replacements, priced from the rank's device to the model's by the
bandwidth ratio (``scale``), one per (batch, context) the rank served: the drafter as ``draft_served[bs,ctx]`` (the
model's ``draft_forward`` takes it instead of its pieces; the drafter's collectives are still added by the model),
the bookkeeping as ``tree[bs]`` / ``accept_commit[bs]``. A model batch the rank did not serve takes the largest
served batch below it, said in the notes (the rank's batch 64 ran 61 at once). Cells at another context keep the
model's drafter, which is too cheap.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.kimi_box import BOXES, REFERENCE
from benchmarks.kimi_model import key

#: spec memory bandwidth (GB/s) of the devices a rank has been served on, by the name in their device string: the
#: H100 SXM's datasheet figure, and the H200's as kimi_box prices it
DEVICE_GBPS = {"H100": 3350.0, BOXES[REFERENCE].device: BOXES[REFERENCE].mem_gbps}
#: an H100 rank checked against the H200 pieces: the model's verify priced for the rank's device (x1.43)
H200_OVER_H100 = DEVICE_GBPS["H200"] / DEVICE_GBPS["H100"]
#: the phases a served round log splits a round into, and the model's piece each replaces
DRAFT, TREE, ACCEPT = "draft", "tree", "accept_commit"
SERVED_DRAFT = "draft_served"


def device_gbps(device: str) -> float:
    """The spec bandwidth of a device named in a report (``"1 H100"``, ``"NVIDIA H200"``); ValueError otherwise."""
    for name, gbps in DEVICE_GBPS.items():
        if name in device:
            return gbps
    raise ValueError(f"no bandwidth known for device {device!r} (known: {', '.join(DEVICE_GBPS)})")


def _cycle_rounds(report: dict) -> dict:
    """``{bs: {width: row}}`` of the report's ``kdtree-cycle*`` server (every width of one server)."""
    for kind, rec in report.get("servers", {}).items():
        if kind.startswith("kdtree-cycle") and rec.get("by_width"):
            return {int(bs): rows for bs, rows in rec["by_width"].items()}
    raise ValueError("the rank report has no kdtree-cycle server with a round log "
                     "(bench_rank --kinds kdtree-cycle-log)")


def served_pieces(report: dict, batches, scale: float) -> tuple[dict, list[str]]:
    """``(times, notes)``: microseconds to write over a ``kimi_round`` measurement's times for ``batches`` (module
    docstring), each the median over the served verify widths of that phase's median ms, times ``scale``."""
    rounds = _cycle_rounds(report)
    context = int(report["settings"]["context"])
    times, notes = {}, []
    for bs in batches:
        below = [b for b in rounds if b <= bs]
        if not below:
            notes.append(f"batch {bs}: no served batch at or below it; the model's drafter and bookkeeping kept")
            continue
        served = max(below)
        if served != bs:
            notes.append(f"batch {bs}: the served rank's batch {served} stands for it")
        rows = rounds[served].values()
        phase = {p: statistics.median(r[p] for r in rows) * 1e3 * scale for p in (DRAFT, TREE, ACCEPT)}
        times[key(SERVED_DRAFT, bs=bs, ctx=context)] = phase[DRAFT]
        times[key("tree", bs=bs)], times[key("accept_commit", bs=bs)] = phase[TREE], phase[ACCEPT]
    return times, notes


def load(path, model_device: str, batches) -> tuple[dict, list[str]]:
    """``served_pieces`` of the rank report at ``path``, priced from its device to ``model_device``."""
    report = json.loads(Path(path).read_text())
    served_device = (report.get("run") or {}).get("device") or report.get("device") or ""
    scale = device_gbps(served_device) / device_gbps(model_device)
    times, notes = served_pieces(report, batches, scale)
    notes.insert(0, f"drafter and bookkeeping from the served rank {path} ({served_device}, context "
                    f"{report['settings']['context']}), priced for {model_device} at x{scale:.3f} (bandwidth ratio)")
    return times, notes
