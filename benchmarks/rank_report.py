"""What ``bench_rank``'s report says, as tables: the served rounds beside ``kimi_round``'s model piece by piece,
tokens per second per request with a stated accept-length curve (the automatic width against the fixed ones), overlap
on against off, the kernels' split of a decode step, startup and memory.

    python -m benchmarks.rank_report rank.json          # the tables of a saved report

Tokens per second per request at a verify width ``w`` are ``tau(w - 1) / round(w)``: random weights accept
nothing, so the round is served and the accept length is stated (``report["stated_tau"]``: the testbed pair's
measured curve unless the bench was told otherwise). Fixed widths take the cycle server's round per width; the
automatic server's rate is its own rounds' stated tokens over their time, every round counted (its exploration
of each tier included), so it can fall short of the best fixed width only by choosing badly or exploring.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks import server_kinds
from benchmarks.bench_server import PHASES
from testbed.kimi_rank import GIB

#: the automatic width must reach this share of the best fixed width's tokens per second (issue's target)
AUTO_FLOOR = 0.95
#: served / model beyond this either way: the model is wrong for that piece
MODEL_TOLERANCE = 0.10


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_report(report: dict, scale: float | None = None, reference: dict | None = None) -> str:
    lines = [f"rank: {report['rank']['layers']} layers, vocab {report['rank']['vocab']:,}, context "
             f"{report['settings']['context']}, widths {report['settings']['widths']}; round wall ms: host period "
             "/ decode log / per request",
             "| server | bs | host ms | log ms | request ms | model ms | accept | decode tok/s per req | ready s |",
             "|---|---|---|---|---|---|---|---|---|"]
    model = (report.get("model") or {}).get("cells", {})
    if model:
        lines.insert(0, f"model: kimi_round's pieces from {report['model']['source']} (measured on "
                        f"{report['model']['device']}), at {report['rank']['layers']} layers, no collectives, lm_head "
                        f"x{report['model']['lm_head_scale']:g}")
    for kind, rec in report["servers"].items():
        mode = {"plain": "AR", "dflash": "DFLASH"}.get(kind)
        for bs, row in rec.get("table", {}).items():
            r = row.get("round", {})
            predicted = model.get(bs, {}).get(mode, {}).get("round")
            lines.append(f"| {kind} | {bs} | {_f(r.get('host_ms'))} | {_f(r.get('log_ms'))} | "
                         f"{_f(r.get('request_ms'))} | {_f(predicted)} | {row['accept_len']:.2f} | "
                         f"{_f(row.get('decode_tok_s'), '{:.1f}')} | {_f(rec.get('ready_s'), '{:.0f}')} |")
        if not rec.get("table"):
            lines.append(f"| {kind} | - | | | | | | | {rec.get('error', rec.get('status', ''))[-120:]!r} |")
    lines += ["", "device ms per round by verify width (round-log servers, graph rounds, medians; model: kimi_round's "
              "draft / tree / verify / accept+commit = round for KDTREE-(width - 1))",
              "| server | bs | width | rounds | draft | tree | verify | accept+commit | device | wall | model | "
              "accept predicted | realised |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, rec in report["servers"].items():
        for bs, by_width in rec.get("by_width", {}).items():
            for w, x in by_width.items():
                m = model.get(bs, {}).get(f"KDTREE-{int(w) - 1}")
                pred = "-" if not m else " / ".join(f"{m[p]:.2f}" for p in PHASES) + f" = {m['round']:.2f}"
                lines.append(f"| {kind} | {bs} | {w} | {x['rounds']} | " + " | ".join(
                    f"{x[p]:.3f}" for p in (*PHASES, "device_ms", "wall_ms")) + f" | {pred} | "
                    f"{x['predicted']:.2f} | {x['realised']:.2f} |")
    lines += ["", "startup and memory (server log; GiB)",
              "| server | ready s | load s | weights target / drafter | KV slots / GiB | SGLang graphs s / GiB | "
              "KDTREE tiers s / MiB | rehearsal peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for kind, rec in report["servers"].items():
        log = rec.get("server_log")
        if not log:
            continue
        loads = log["loads"]
        tiers = "; ".join(f"{w}: {t['seconds']:.1f} / {t['mib']}" for w, t in log["tiers"].items()) or "-"
        peak = log["prewarm_peak_bytes"]
        lines.append(f"| {kind} | {_f(rec.get('ready_s'), '{:.0f}')} | {sum(x['seconds'] for x in loads):.1f} | "
                     + " / ".join(f"{x['gib']:.2f}" for x in loads) + " | "
                     + "; ".join(f"{k['tokens']:,} / {k['gib']:.2f}" for k in log["kv"]) + " | "
                     f"{log['sglang_capture_s']:.1f} / {log['sglang_capture_gib']:.2f} | {tiers} | "
                     f"{_f(None if peak is None else peak / GIB)} |")
    return "\n".join(lines + analysis_lines(report, scale, reference))


# ---- tokens per second with a stated curve -------------------------------------------------------------------


def _kind_width(kind: str) -> int | None:
    """The verify width a pinned KDTREE kind's name says (``kdtree-31-overlap`` -> 32), else None."""
    b = server_kinds.pinned_budget(kind)
    return None if b is None else b + 1


def served_rates(report: dict) -> dict:
    """``{bs: {"fixed": {width: tok/s}, "pinned": {kind: tok/s}, "auto": {kind: {...}}, "best": ..., ...}}``: tokens
    per second per request with the stated tau (module docstring). Fixed widths from every ``kdtree-cycle*`` server's
    round per width (device clock, the round's own time); pinned kinds from their scheduler period; automatic kinds
    with a round log from their own rounds (``chose``: rounds per width); each automatic kind's ``ratio`` to the best
    fixed width and whether it reaches ``AUTO_FLOOR``."""
    stated = {int(w): t for w, t in (report.get("stated_tau") or {}).get("by_width", {}).items()}
    if not stated:
        return {}
    out: dict = {}
    for kind, rec in report.get("servers", {}).items():
        for bs, by_width in rec.get("by_width", {}).items():
            cell = out.setdefault(bs, {"fixed": {}, "pinned": {}, "auto": {}})
            if kind.startswith("kdtree-cycle"):
                for w, x in by_width.items():
                    if int(w) in stated and x.get("wall_ms"):
                        cell["fixed"][int(w)] = stated[int(w)] / x["wall_ms"] * 1e3
            elif kind.startswith("kdtree-auto"):
                tokens = sum(x["rounds"] * stated[int(w)] for w, x in by_width.items() if int(w) in stated)
                ms = sum(x["rounds"] * x["wall_ms"] for w, x in by_width.items() if int(w) in stated)
                if ms > 0:
                    cell["auto"][kind] = {"tok_s": tokens / ms * 1e3,
                                          "chose": {int(w): x["rounds"] for w, x in by_width.items()}}
        w = _kind_width(kind)
        for bs, row in rec.get("table", {}).items():
            host_ms = (row.get("round") or {}).get("host_ms")
            if w in stated and host_ms:
                out.setdefault(bs, {"fixed": {}, "pinned": {}, "auto": {}})["pinned"][kind] = stated[w] / host_ms * 1e3
    for cell in out.values():
        if cell["fixed"]:
            best = max(cell["fixed"], key=lambda w: (cell["fixed"][w], -w))
            cell["best"] = {"width": best, "tok_s": cell["fixed"][best]}
            for a in cell["auto"].values():
                a["ratio"] = a["tok_s"] / cell["best"]["tok_s"]
                a["pass"] = a["ratio"] >= AUTO_FLOOR
    return out


def overlap_ratios(report: dict) -> dict:
    """``{bs: {"pair": (on, off), "runs": [off_ms / on_ms per repeat], "median", "min", "max"}}`` for every kind that
    ran both with and without ``-overlap``: each timed batch's median decode rate per request, repeat by repeat (a
    ratio above 1: overlap shortens the round)."""
    servers = report.get("servers", {})
    out = {}
    for on, rec_on in servers.items():
        if not on.endswith("-overlap") or on.removesuffix("-overlap") not in servers:
            continue
        rec_off = servers[on.removesuffix("-overlap")]
        for bs, row_on in rec_on.get("table", {}).items():
            row_off = rec_off.get("table", {}).get(bs)
            runs_on, runs_off = row_on.get("decode_tok_s_runs") or [], (row_off or {}).get("decode_tok_s_runs") or []
            ratios = [a / b for a, b in zip(runs_on, runs_off) if a and b]  # rate on / rate off = round off / on
            if ratios:
                out[bs] = {"pair": [on, on.removesuffix("-overlap")], "runs": [round(r, 4) for r in ratios],
                           "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


# ---- the model checked -----------------------------------------------------------------------------------------


def step_ms(rec: dict, bs: str, row: dict) -> float | None:
    """A server's decode step (plain's, DFLASH's): the scheduler loop's median period at that batch (its mean counts
    the prefill passes' long periods too), else the report's mean."""
    return (rec.get("host_times", {}).get(bs) or {}).get("period_ms") or (row.get("round") or {}).get("host_ms")


def model_check(report: dict) -> list[dict]:
    """The served round beside the model's, piece by piece, per (batch, server, width): draft, bookkeeping (tree +
    accept + commit), verify and the host's share (served wall - device; the model has none), and the whole round;
    plain's decode step from its scheduler period, split by its kernels where profiled. Each row: served ms, model ms,
    served / model, and ``off`` when that ratio is beyond ``MODEL_TOLERANCE``."""
    cells = (report.get("model") or {}).get("cells", {})
    rows = []

    def add(bs, server, width, piece, served, model):
        if served is None or model is None:
            return
        ratio = served / model if model > 0 else None
        rows.append({"bs": int(bs), "server": server, "width": width, "piece": piece, "served": round(served, 4),
                     "model": round(model, 4), "ratio": None if ratio is None else round(ratio, 3),
                     "off": ratio is not None and abs(ratio - 1) > MODEL_TOLERANCE})

    for kind, rec in report.get("servers", {}).items():
        if kind == "plain":
            for bs, row in rec.get("table", {}).items():
                m = cells.get(bs, {}).get("AR")
                if m:
                    add(bs, kind, 1, "round", step_ms(rec, bs, row), m["round"])
            prof = rec.get("profile")
            if prof and cells.get(str(prof["bs"]), {}).get("AR"):
                m, ms = cells[str(prof["bs"])]["AR"], prof["split"]["ms"]
                add(prof["bs"], kind, 1, "attention", ms["attention"] + ms["mla"], m["attention"])
                add(prof["bs"], kind, 1, "moe", ms["moe"], m["moe"])
                add(prof["bs"], kind, 1, "dense + other", ms["gemm"] + ms["other"], m["other"])
        if not kind.startswith("kdtree-cycle"):
            continue
        for bs, by_width in rec.get("by_width", {}).items():
            for w, x in by_width.items():
                m = cells.get(bs, {}).get(f"KDTREE-{int(w) - 1}")
                if not m:
                    continue
                add(bs, kind, int(w), "draft", x["draft"], m["draft"])
                add(bs, kind, int(w), "tree + accept", x["tree"] + x["accept_commit"], m["tree"] + m["accept_commit"])
                add(bs, kind, int(w), "verify", x["verify"], m["verify"])
                add(bs, kind, int(w), "host", max(0.0, x["wall_ms"] - x["device_ms"]), 0.0)
                add(bs, kind, int(w), "round", x["wall_ms"], m["round"])
        prof = rec.get("profile")
        if prof:  # the profiled steps cycle through every width: the verify's split summed over one cycle
            bs = str(prof["bs"])
            models = [cells.get(bs, {}).get(f"KDTREE-{int(w) - 1}") for w in rec.get("by_width", {}).get(bs, {})]
            if models and all(models):
                n, ms = len(models), prof["split"]["ms"]
                add(bs, kind, "cycle", "attention (MLA)", ms["mla"] * n, sum(m["attention"] for m in models))
                add(bs, kind, "cycle", "moe", ms["moe"] * n, sum(m["moe"] for m in models))
    return rows


def corrected_rounds(report: dict, scale: float) -> list[dict]:
    """The round the corrected model predicts for each served KDTREE cell (``kimi_served.py``): the model's verify
    priced for the rank's device (times ``scale``, the bandwidth ratio) plus the served drafter and bookkeeping,
    beside the served round; and plain's step priced so. ``off`` as in ``model_check``."""
    cells, out = (report.get("model") or {}).get("cells", {}), []
    for kind, rec in report.get("servers", {}).items():
        if kind == "plain":
            for bs, row in rec.get("table", {}).items():
                served, m = step_ms(rec, bs, row), cells.get(bs, {}).get("AR")
                if served and m:
                    out.append({"bs": int(bs), "server": kind, "width": 1, "served": served,
                                "model": m["round"] * scale})
        elif kind.startswith("kdtree-cycle"):
            for bs, by_width in rec.get("by_width", {}).items():
                for w, x in by_width.items():
                    m = cells.get(bs, {}).get(f"KDTREE-{int(w) - 1}")
                    if m:
                        model = m["verify"] * scale + x["draft"] + x["tree"] + x["accept_commit"]
                        out.append({"bs": int(bs), "server": kind, "width": int(w), "served": x["wall_ms"],
                                    "model": model})
    for r in out:
        r["ratio"] = r["served"] / r["model"]
        r["off"] = abs(r["ratio"] - 1) > MODEL_TOLERANCE
    return out


def greedy_identity(report: dict, reference: dict | None = None) -> list[dict]:
    """Each server's greedy tokens against the plain server's, request by request, at every batch size both kept
    (``bench_server.measure(keep_outputs=True)``): ``reference``'s plain server when given (a report of the same
    rank from another call), else this report's. Each row: requests, how many are identical, and the earliest
    token at which one differs (None if none does)."""
    plain = ((reference or report).get("servers", {}).get("plain") or {}).get("table", {})
    rows = []
    for kind, rec in report.get("servers", {}).items():
        if kind == "plain" and reference is None:
            continue
        for bs, row in rec.get("table", {}).items():
            ours, theirs = row.get("output_ids"), plain.get(bs, {}).get("output_ids")
            if ours is None or theirs is None:
                continue
            if len(ours) != len(theirs):
                raise ValueError(f"{kind} at batch {bs}: {len(ours)} requests kept against plain's {len(theirs)}")
            firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(ours, theirs) if a != b]
            rows.append({"server": kind, "bs": int(bs), "requests": len(ours), "identical": len(ours) - len(firsts),
                         "tokens": sum(map(len, ours)), "first_diff": min(firsts) if firsts else None})
    return sorted(rows, key=lambda r: (r["server"], r["bs"]))


def analysis_lines(report: dict, scale: float | None = None, reference: dict | None = None) -> list[str]:
    """The tables of ``served_rates``, ``overlap_ratios``, ``model_check`` and the profiled kernel split."""
    lines = []
    rates = served_rates(report)
    if rates:
        src = report["stated_tau"]
        lines += ["", f"tokens/s per request with the stated tau ({src['source']}: "
                  + ", ".join(f"width {w}: {t:.2f}" for w, t in src["by_width"].items()) + ")",
                  "| bs | fixed widths (cycle) | best | pinned kinds | automatic: tok/s (rounds per width) | "
                  f"auto / best | >= {AUTO_FLOOR:.0%} |", "|---|---|---|---|---|---|---|"]
        for bs, cell in sorted(rates.items(), key=lambda kv: int(kv[0])):
            fixed = ", ".join(f"{w}: {v:.1f}" for w, v in sorted(cell["fixed"].items())) or "-"
            best = f"{cell['best']['width']}: {cell['best']['tok_s']:.1f}" if "best" in cell else "-"
            pinned = ", ".join(f"{k}: {v:.1f}" for k, v in cell["pinned"].items()) or "-"
            autos = cell["auto"] or {"-": {}}
            for kind, a in autos.items():
                chose = " ".join(f"{w}x{n}" for w, n in sorted(a.get("chose", {}).items()))
                lines.append(f"| {bs} | {fixed} | {best} | {pinned} | {kind}: {_f(a.get('tok_s'), '{:.1f}')} "
                             f"({chose}) | {_f(a.get('ratio'), '{:.3f}')} | "
                             f"{'-' if 'pass' not in a else 'yes' if a['pass'] else 'NO'} |")
    overlap = overlap_ratios(report)
    if overlap:
        lines += ["", "overlap on / off: decode rate per request, repeat by repeat (> 1: overlap is faster)",
                  "| bs | servers | median | min | max | repeats |", "|---|---|---|---|---|---|"]
        for bs, o in sorted(overlap.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {bs} | {' / '.join(o['pair'])} | {o['median']:.3f} | {o['min']:.3f} | {o['max']:.3f} | "
                         f"{', '.join(f'{r:.3f}' for r in o['runs'])} |")
    check = model_check(report)
    if check:
        lines += ["", f"served against the model, ms (off: more than {MODEL_TOLERANCE:.0%} apart)",
                  "| bs | server | width | piece | served | model | served / model | off |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['bs']} | {r['server']} | {r['width']} | {r['piece']} | {r['served']:.3f} | {r['model']:.3f} | "
                  f"{_f(r['ratio'], '{:.2f}')} | {'off' if r['off'] else ''} |" for r in check]
    if scale:
        lines += ["", f"served against the corrected model (verify x{scale:.3f} for the device; drafter and "
                  "bookkeeping served), ms", "| bs | server | width | served | corrected model | served / model | off |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['bs']} | {r['server']} | {r['width']} | {r['served']:.3f} | {r['model']:.3f} | "
                  f"{r['ratio']:.2f} | {'off' if r['off'] else ''} |" for r in corrected_rounds(report, scale)]
    if report.get("device_profile"):
        problems = report.get("profile_problems")
        lines += ["", f"KDTREE_DEVICE_PROFILE={report['device_profile']}: " + (
            "not checked" if problems is None else "every KDTREE server's launches within its limits" if not problems
            else "; ".join(problems))]
        lines += [f"{kind}: {rec['launch_limits']['line']}" for kind, rec in report["servers"].items()
                  if rec.get("launch_limits")]
    same = greedy_identity(report, reference)
    if same:
        lines += ["", "greedy tokens against the plain server's, request by request"
                  + (" (plain from another call of the same rank)" if reference else ""),
                  "| server | bs | requests | identical | tokens | first differing token |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['server']} | {r['bs']} | {r['requests']} | {r['identical']} | {r['tokens']} | "
                  f"{_f(r['first_diff'], '{}')} |" for r in same]
    for kind, rec in report.get("servers", {}).items():
        prof = rec.get("profile")
        if not prof or "split" not in prof:
            continue
        sp = prof["split"]
        lines += ["", f"{kind}: device ms per decode step by kernel class (batch {prof['bs']}, {sp['steps']} steps "
                  f"profiled; busy {sp['busy_ms']:.2f}, span {sp['span_ms']:.2f})",
                  "| " + " | ".join(sp["ms"]) + " |", "|" + "---|" * len(sp["ms"]),
                  "| " + " | ".join(f"{v:.3f}" for v in sp["ms"].values()) + " |"]
    return lines


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="bench_rank.py's rank.json")
    ap.add_argument("--device-scale", type=float, default=None,
                    help="the model's device bandwidth over the rank's (4800 / 3350 for H200 pieces and an H100 rank): "
                         "adds the corrected model's rounds")
    ap.add_argument("--plain-from", type=Path, default=None,
                    help="another call's rank.json of the same rank whose plain server the greedy tokens are held to")
    args = ap.parse_args(argv)
    reference = json.loads(args.plain_from.read_text()) if args.plain_from else None
    print(format_report(json.loads(args.report.read_text()), args.device_scale, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
