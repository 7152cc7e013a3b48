"""The Kimi round model corrected by served ranks (``bench_rank.py``): where a served one-GPU rank showed the model
wrong by more than 10 %, the model takes the served time's excess over its own pieces.

The served ranks (12 / 26 / 40 of 61 layers, one H100, random weights; RESULTS.md "One Kimi K2.6 rank on one GPU")
against ``kimi_round``'s model from H200 pieces, cell for cell at context 4k, once priced for the device (the
bandwidth ratio H200 4.8 TB/s / H100 3.35 TB/s = 1.43):

* **KDTREE's verify** on the Hopper path is within 10 % at every batch and width: unchanged;
* **the drafter** is 2.2-2.7x: SGLang runs the DFlash drafter's attention over the whole context with its Triton
  extend kernel where the model timed torch SDPA (1.3 ms of the drafter's 4.8 at batch 8, profiled);
* **the bookkeeping** (tree + accept + commit) is 3-5x: the model times this package's two captured graphs only, the
  served round also SGLang's verify preparation and the drafter's projection of the accepted tokens' hidden states
  (``features``); the served phases replace it;
* **plain's step** is 1.12-1.19x at batch 32 / 64 and **DFLASH's verify** 1.7-2.5x: SGLang's Triton attention
  backend (the box's default; every rank server runs it) where the model prices this package's fused MLA kernel
  (plain's decode attention 2.2x at batch 32; DFLASH's target-verify extend attention 37 ms of a 68 ms step at
  batch 32, 26 layers);
* under the sm_120 profile, **KDTREE's verify** runs ``mma_compact`` instead of wgmma: 1.04-1.44x the Hopper verify
  by batch and width (``--served-profile sm_120``, for the box).

Each correction is an **excess**: served (priced for the model's device by bandwidth) less the model's own pieces,
``draft_excess[bs,ctx]`` on the drafter's forward and ``forward_excess:MODE[bs,ctx]`` on a mode's target attention
(``kimi_model``). Another box keeps an excess in microseconds under the ``excess`` pricing rule (``kimi_box``): the
served excess is latency and inefficiency, not bytes. A forward's excess at the model's layer count comes from a
straight line in the layer count through the ranks served, or from one rank with the model's fixed part (lm_head)
and the served rest per layer. A model batch the rank did not serve takes the largest served batch below it, said in
the notes (the 12-layer rank's batch 64 ran 61 at once). Cells at another context keep the model's pieces.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import dataclasses
import math

from benchmarks import kimi_model
from benchmarks.kimi_box import BOXES, REFERENCE
from benchmarks.kimi_model import key

#: spec memory bandwidth (GB/s) of the devices a rank has been served on, by the name in their device string: the
#: H100 SXM's datasheet figure, and the H200's as kimi_box prices it
DEVICE_GBPS = {"H100": 3350.0, BOXES[REFERENCE].device: BOXES[REFERENCE].mem_gbps}
#: an H100 rank checked against the H200 pieces: the model's verify priced for the rank's device (x1.43)
H200_OVER_H100 = DEVICE_GBPS["H200"] / DEVICE_GBPS["H100"]
#: the phases a served round log splits a round into that correct the model
DRAFT, TREE, ACCEPT = "draft", "tree", "accept_commit"
DRAFT_EXCESS = "draft_excess"
#: a mode's served target forward over the model's, ``forward_excess:MODE`` (the mode in the name: a key's dims are
#: integers)
FORWARD_EXCESS = "forward_excess"
#: the modes whose forward a rank can serve: plain's step, DFLASH's round less its drafter, KDTREE's verify phase
FORWARD_MODES = ("AR", "DFLASH", "KDTREE")


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


def _bare(cfg):
    """``cfg`` without collectives (a served rank has none; the model adds its own)."""
    return dataclasses.replace(cfg, net=kimi_model.Network(gbps=math.inf, latency_us=0.0, gather_logits=False))


def served_pieces(report: dict, batches, scale: float, times: dict | None = None, cfg=None) -> tuple[dict, list[str]]:
    """``(times, notes)``: microseconds for a ``kimi_round`` measurement at ``batches`` (module docstring): the
    bookkeeping phases, and the drafter's excess over the model's drafter in ``times`` under ``cfg`` at the rank's
    vocabulary; each phase the median over the served verify widths of its median ms, times ``scale``."""
    rounds = _cycle_rounds(report)
    context = int(report["settings"]["context"])
    bare = _bare(cfg or kimi_model.RoundConfig())
    full = rank_times(times or {}, report) if "rank" in report else times or {}  # the rank's drafter head: all rows
    out, notes = {}, []
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
        model = kimi_model.draft_forward(full, bs, context, bare)["compute"]
        out[key(DRAFT_EXCESS, bs=bs, ctx=context)] = phase[DRAFT] - model
        out[key("tree", bs=bs)], out[key("accept_commit", bs=bs)] = phase[TREE], phase[ACCEPT]
    return out, notes


def load(paths, model_device: str, batches, times: dict | None = None, cfg=None, forward_modes=(),
         profile: str | None = None) -> tuple[dict, list[str]]:
    """``served_pieces`` of the first rank report in ``paths`` with a cycle server, and with ``forward_modes``
    ``served_forwards`` of them all (KDTREE's only from the reports served under ``profile``,
    ``KDTREE_DEVICE_PROFILE``; None: without one), priced from their device to ``model_device``."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    cfg = cfg or kimi_model.RoundConfig()
    reports = [json.loads(Path(p).read_text()) for p in paths]
    first = next((i for i, r in enumerate(reports) if any(k.startswith("kdtree-cycle") for k in r.get("servers", {}))),
                 0)
    report, path = reports[first], paths[first]
    scale = _scale(report, model_device)
    out, notes = served_pieces(report, batches, scale, times, cfg)
    notes.insert(0, f"drafter and bookkeeping from the served rank {path} ({_device(report)}, context "
                    f"{report['settings']['context']}), priced for {model_device} at x{scale:.3f} (bandwidth ratio)")
    if forward_modes:
        kdtree = [r for r in reports if r.get("device_profile") == profile]
        bad = sorted(set(forward_modes) - set(FORWARD_MODES))
        if bad:
            raise ValueError(f"served forward of {bad[0]!r}: one of {', '.join(FORWARD_MODES)}")
        for modes, group in (([m for m in forward_modes if m != "KDTREE"], reports),
                             (["KDTREE"] if "KDTREE" in forward_modes else [], kdtree)):
            if modes and group:
                more, more_notes = served_forwards(group, modes, batches, times or {}, cfg, model_device)
                out.update(more)
                notes += more_notes
        if "KDTREE" in forward_modes and not kdtree:
            raise ValueError(f"--served-forward KDTREE: no report served under profile {profile!r}")
    return out, notes


def _step_ms(rec: dict, bs: str) -> float | None:
    """A server's decode step at batch ``bs`` (``rank_report.step_ms``), None where it served none."""
    from benchmarks import rank_report  # imports bench_server's CUDA harness: only when a forward is asked for

    row = rec.get("table", {}).get(bs)
    return None if row is None else rank_report.step_ms(rec, bs, row)


def _drafter_ms(reports: list) -> dict:
    """``{bs: ms}``: the drafter phase per batch, the median over every report's cycle server (the drafter does not
    depend on the target's layers)."""
    found: dict = {}
    for report in reports:
        for kind, rec in report.get("servers", {}).items():
            if kind.startswith("kdtree-cycle"):
                for bs, rows in rec.get("by_width", {}).items():
                    found.setdefault(int(bs), []).extend(r[DRAFT] for r in rows.values())
    return {bs: statistics.median(v) for bs, v in found.items()}


def forward_ms(report: dict, mode: str, bs: int, drafter: dict) -> float | None:
    """The target forward of ``mode`` that ``report`` served at batch ``bs`` (ms on its device): plain's step for AR,
    DFLASH's step less the drafter phase, the cycle server's verify phase for ``KDTREE-B`` (width B + 1)."""
    servers = report.get("servers", {})
    if mode == "AR":
        return _step_ms(servers.get("plain") or {}, str(bs))
    if mode == "DFLASH":
        step = _step_ms(servers.get("dflash") or {}, str(bs))
        return None if step is None or bs not in drafter else step - drafter[bs]
    width = str(int(mode.split("-", 1)[1]) + 1)
    for kind, rec in servers.items():
        if kind.startswith("kdtree-cycle") and width in rec.get("by_width", {}).get(str(bs), {}):
            return rec["by_width"][str(bs)][width]["verify"]
    return None


def rank_times(times: dict, report: dict) -> dict:
    """``times`` for the rank's shape: every ``lm_head`` piece scaled from the TP 8 slice of the vocabulary to the
    rank's (the rank holds all of it; ASSUMED linear in the rows, as ``bench_rank.predicted_rounds`` has it)."""
    scale = report["rank"]["vocab"] / (kimi_model.KIMI.vocab // kimi_model.KIMI.tp)
    return {k: v * scale if k.startswith("lm_head[") else v for k, v in times.items()}


def forward_line(points, layers: int, fixed: float) -> float:
    """The served forward at ``layers`` from ``points`` ``[(layers, us), ...]``: a least-squares line when they span
    two layer counts or more, else ``fixed`` (the model's part without layers) plus the served rest per layer."""
    counts = [n for n, _ in points]
    mean_n, mean_t = statistics.fmean(counts), statistics.fmean(t for _, t in points)
    if len(set(counts)) > 1:
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n in counts)
        return mean_t + slope * (layers - mean_n)
    return fixed + (mean_t - fixed) * layers / counts[0]


def _line_and_model(points, times: dict, bs: int, width: int, context: int, cfg) -> tuple[float, float]:
    """(``forward_line`` through ``points`` at ``cfg``'s layer count, the model's forward there), us, from ``times``
    under ``cfg`` (no collectives); the line's one-rank fallback keeps the model's part without layers."""
    no_layers = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=0, dense_layers=0))
    fixed = kimi_model.verify_forward(times, bs, width, context, no_layers)["total"]
    line = forward_line([p[:2] for p in points], cfg.model.layers, fixed)
    return line, kimi_model.verify_forward(times, bs, width, context, cfg)["total"]


def _points(reports, mode, bs, drafter, model_device) -> list:
    """``[(layers, us priced for model_device, report), ...]``: every report's served forward of ``mode``."""
    out = []
    for report in reports:
        ms = forward_ms(report, mode, bs, drafter)
        if ms is not None:
            out.append((report["rank"]["layers"], ms * 1e3 * _scale(report, model_device), report))
    return out


def served_forwards(reports: list, modes, batches, times: dict, cfg, model_device: str) -> tuple[dict, list[str]]:
    """``(times, notes)``: ``forward_excess`` (us at ``cfg``'s layer count, priced for ``model_device``) of every
    fixed mode of ``cfg`` in ``modes`` ("AR", "DFLASH", "KDTREE": every KDTREE-B) at each batch some report served:
    ``forward_line`` through the served forwards less the model's forward from ``times``, both at the rank's
    vocabulary (module docstring). Collectives: none on either side."""
    context = int(reports[0]["settings"]["context"])
    if any(int(r["settings"]["context"]) != context for r in reports):
        raise ValueError("served ranks at more than one context: one context at a time")
    drafter, bare, full = _drafter_ms(reports), _bare(cfg), rank_times(times, reports[0])
    out, notes = {}, []
    for mode, width in cfg.widths.items():
        if mode.split("-", 1)[0] not in modes:
            continue
        for bs in batches:
            points = _points(reports, mode, bs, drafter, model_device)
            if not points:
                notes.append(f"{mode} at batch {bs}: no served forward; the model's kept")
                continue
            value, model = _line_and_model(points, full, bs, width, context, bare)
            out[key(f"{FORWARD_EXCESS}:{mode}", bs=bs, ctx=context)] = value - model
            notes.append(f"{mode} at batch {bs}: forward served at {sorted({p[0] for p in points})} layers, "
                         f"{value / 1e3:.2f} ms at {cfg.model.layers} against the model's {model / 1e3:.2f}")
    return out, notes


def forward_check(reports: list, times: dict, model_device: str, modes=FORWARD_MODES) -> list[dict]:
    """Every served forward beside the model's and the line's (``forward_line`` through all the ranks given) at its
    rank's layer count, in ms on the rank's device: how far the model is off, and how well the correction holds."""
    drafter, rows = _drafter_ms(reports), []
    for report in reports:
        shape, context = report["rank"], int(report["settings"]["context"])
        model_shape = dataclasses.replace(kimi_model.KIMI, layers=shape["layers"], dense_layers=shape["dense_layers"])
        cfg = _bare(kimi_model.RoundConfig(model=model_shape, budgets=(15, 31, 63)))  # the widths ranks serve
        scale, full = _scale(report, model_device), rank_times(times, report)
        for mode, width in cfg.widths.items():
            if mode.split("-", 1)[0] not in modes:
                continue
            for bs in sorted({int(b) for rec in report["servers"].values() for b in rec.get("table", {})}):
                points = _points(reports, mode, bs, drafter, model_device)
                mine = [p for p in points if p[2] is report]
                if not mine:
                    continue
                line, model = _line_and_model(points, full, bs, width, context, cfg)
                served = mine[0][1] / scale / 1e3
                rows.append({"layers": shape["layers"], "profile": report.get("device_profile"), "mode": mode,
                             "bs": bs, "served": round(served, 3), "model": round(model / scale / 1e3, 3),
                             "line": round(line / scale / 1e3, 3), "ranks": sorted({p[0] for p in points})})
    return rows


def _device(report: dict) -> str:
    """The device a rank report was served on, as its run record names it ("" if none)."""
    return (report.get("run") or {}).get("device") or report.get("device") or ""


def _scale(report: dict, model_device: str) -> float:
    """The bandwidth ratio from the report's device to ``model_device``."""
    return device_gbps(_device(report)) / device_gbps(model_device)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="served target forwards against the model and the corrected line")
    ap.add_argument("ranks", nargs="+", type=Path, help="bench_rank.py reports of one rank at one context")
    ap.add_argument("--model-json", type=Path, default=Path(__file__).parent / "results" / "kimi_round.json")
    ap.add_argument("--profile", default=None,
                    help="KDTREE's forward from the ranks served under this KDTREE_DEVICE_PROFILE only (default: none)")
    args = ap.parse_args(argv)
    measured = json.loads(args.model_json.read_text())["measured"]
    reports = [json.loads(p.read_text()) for p in args.ranks]
    device = measured.get("device") or "H200"
    rows = forward_check(reports, measured["times"], device, ("AR", "DFLASH"))  # SGLang's own: any profile
    rows += forward_check([r for r in reports if r.get("device_profile") == args.profile], measured["times"],
                          device, ("KDTREE",))
    print("| layers | profile | mode | bs | served ms | model ms | served / model | corrected (line) ms | "
          "served / corrected | line through |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["mode"], r["bs"], r["layers"])):
        print(f"| {r['layers']} | {r['profile'] or '-'} | {r['mode']} | {r['bs']} | {r['served']:.2f} | "
              f"{r['model']:.2f} | {r['served'] / r['model']:.2f} | {r['line']:.2f} | {r['served'] / r['line']:.2f} | "
              f"{', '.join(map(str, r['ranks']))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
