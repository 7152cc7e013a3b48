"""Tokens/s per request against verify width from a ``kimi_round.py --json`` file: one panel per (batch, context),
the fixed KDTREE budgets as a line, DFLASH and AR as horizontal lines, KDTREE-auto's chosen width marked.

    python -m benchmarks.plot_kimi_round ROUND.json OUT.png [--tau-label TEXT] [--run R] [--date D] ...

Every figure is titled as what it is: a PROJECTION of Kimi K2.6 by the ``kimi_round.py`` model (an ESTIMATE for a
``kimi_round.py --box`` file: the box, the pricing rule and the date), the device and run that timed its pieces,
the assumed drafter, where its accept lengths come from (the DDTree paper's assumed curve, or one given with
``--tau-curve``: ``--tau-label`` names it), and a reading of its panels; a panel whose KV would not fit the card
says so. The run's facts that the JSON does not record come from ``--run`` / ``--date`` / ``--device`` /
``--commit`` or ``benchmarks/results/runs.json``.

Needs matplotlib, which the package does not depend on; without it the script says so and exits 2 (the same
figures are in the kimi_round report's summary table).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from benchmarks import plot_captions
from benchmarks.kimi_model import PAPER_CURVE_SOURCE

AUTO = "KDTREE-auto"


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def panels(rows: list[dict]) -> list[dict]:
    """One dict per (batch, context), in the rows' order: ``widths`` and ``tok_s`` of the fixed KDTREE rows (width
    ascending; None where not finite), ``dflash`` / ``ar`` tokens/s, ``auto_width`` / ``auto_tok_s`` and ``partial``
    (some row of the cell lacks pieces, so its figures are bounds)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["bs"], r["ctx"]), []).append(r)
    out = []
    for (bs, ctx), group in cells.items():
        fixed = sorted((r for r in group if r["mode"].startswith("KDTREE-") and r["mode"] != AUTO),
                       key=lambda r: r["width"])
        by = {r["mode"]: r for r in group}
        auto = by.get(AUTO, {})
        out.append({"bs": bs, "ctx": ctx, "widths": [r["width"] for r in fixed],
                    "tok_s": [_num(r["tok_s"]) for r in fixed],
                    "dflash": _num(by.get("DFLASH", {}).get("tok_s")), "ar": _num(by.get("AR", {}).get("tok_s")),
                    "auto_width": auto.get("chose"), "auto_tok_s": _num(auto.get("tok_s")),
                    "partial": any(r.get("missing") for r in group)})
    return out


MEASURED_TITLE = "Kimi K2.6 decode round at TP 8 (model from measured pieces)"


class RoundError(Exception):
    """A JSON the plot cannot use; the message says what is wrong and how to mend it."""


def tau_text(payload: dict, label: str | None = None) -> str:
    """Where the round's accept lengths come from (``label``, else the saved curve's source), KDTREE's first
    points and DFLASH's tau. The paper's curve is said to be assumed; a curve given with ``--tau-curve`` records no
    source, so without ``label`` it is said to be unnamed."""
    cfg = payload.get("config") or {}
    curve, dflash = cfg.get("curve") or {}, cfg.get("accept_dflash")
    source = str(curve.get("source", "tau curve"))
    if label:
        source = label
    elif source.startswith(PAPER_CURVE_SOURCE):
        source = f"ASSUMED from {PAPER_CURVE_SOURCE} (Qwen3-8B, scaled to the paper's MoE mean)"
    elif source == "--tau-curve":
        source = "a --tau-curve whose source the JSON does not record (name it with --tau-label)"
    else:
        source = source.split(" (")[0]
    points = " ".join(f"{b}={t:.2f}" for b, t in curve.get("points", [])[:4])
    return f"accept lengths, not Kimi K2.6's: {source}" + (f": KDTREE tau(budget) {points}" if points else "") + \
        (f", DFLASH {dflash:.2f}" if isinstance(dflash, (int, float)) else "")


def reading(cells: list[dict]) -> str:
    """What the panels show: the width KDTREE-auto verifies, its tokens/s against DFLASH's, and whether every
    wider fixed budget is slower."""
    widths = sorted({c["auto_width"] for c in cells if c["auto_width"] is not None})
    ratios = [c["auto_tok_s"] / c["dflash"] for c in cells if c["auto_tok_s"] and c["dflash"]]
    if not widths or not ratios:
        return "Reading: no panel has both KDTREE-auto and DFLASH"
    where = "every panel" if len(ratios) == len(cells) else f"{len(ratios)} of {len(cells)} panels"
    width = f"width {widths[0]}" if len(widths) == 1 else "widths " + " / ".join(map(str, widths))
    out = f"Reading: KDTREE-auto verifies {width} in {where}, {plot_captions.ratio_range(ratios)} DFLASH per request"
    falling = all(all(a > b for a, b in zip(t, t[1:])) for t in
                  ([x for x in c["tok_s"] if x is not None] for c in cells))
    return out + ("; every wider verify is slower, in every panel" if falling else "")


def _pieces(path, payload: dict, given: dict) -> dict:
    """The facts of the run that timed the pieces: a ``--from-json`` output's are its source file's."""
    source = (payload.get("args") or {}).get("from_json")
    f = plot_captions.facts(source or path, None, **given)
    measured = payload.get("measured") or {}
    f.setdefault("device", f"1 {measured['device']}" if measured.get("device") else None)
    return f


def title(payload: dict, tau_label: str | None = None, path=None, cells: list[dict] | None = None,
          **given) -> str:
    """The figure's title and caption: a projection (or an ``estimate`` for another box: its box, ESTIMATE, the
    pricing rule and date), the run that timed its pieces (``given`` / the JSON / ``benchmarks/results/runs.json`` under
    ``path``), the assumed drafter, where the accept lengths come from, and the reading of ``cells``."""
    own = plot_captions.facts(path)
    tau_label = tau_label or own.get("tau_label")
    pieces = _pieces(path, payload, given)
    layers = ((payload.get("config") or {}).get("drafter") or {}).get("layers", "?")
    drafter = f"drafter: a {layers}-layer DFlash drafter, assumed"
    served = [m for n in (payload.get("measured") or {}).get("notes", [])
              for m in [re.search(r"from the served rank (\S+) \(([^,]+),", n)] if m]
    if served:  # kimi_round --served-rank: the drafter's and the bookkeeping's times are a served rank's
        drafter += (f", its time and the bookkeeping's from a served Kimi rank ({served[0][2]}, "
                    f"{Path(served[0][1]).name})")
        forwards = sorted({m[1] for n in payload["measured"]["notes"]
                           for m in [re.match(r"(\w+)(?:-\d+)? at batch \d+: forward served", n)] if m})
        if forwards:  # --served-forward: those modes' target forwards too
            drafter += f"; the target forward of {' / '.join(forwards)} from served ranks too"
    est = payload.get("estimate")
    if not est:
        head = ("PROJECTION, not a served Kimi: Kimi K2.6 decode round at TP 8 (the benchmarks/kimi_round.py model)\n"
                f"pieces timed on {pieces.get('device') or 'a device not recorded'} "
                f"({plot_captions.run_text(pieces, device=False)}) at Kimi K2.6's per-GPU shapes; {drafter}; "
                "collectives modelled")
    else:
        head = (f"ESTIMATE, not measured: Kimi K2.6 decode round at TP 8 on {est.get('box_label', est.get('box'))} "
                "(the benchmarks/kimi_round.py model)\n"
                f"{own.get('run', 'estimate')}, {est.get('date', 'undated')}: the "
                f"{est.get('reference_device', 'reference')} pieces ({plot_captions.run_text(pieces, device=False)}) "
                f"repriced for the box (rule '{est.get('rule', '?')}'); {drafter}")
    cells = panels(payload["rows"]) if cells is None and payload.get("rows") else cells or []
    return f"{head}\n{tau_text(payload, tau_label)}\n{reading(cells)}"


def kv_notes(payload: dict) -> dict:
    """(batch, context) -> a note for panels whose KV does not fit, or only marginally, the card (an estimate's
    ``kv`` record)."""
    cells = ((payload.get("estimate") or {}).get("kv") or {}).get("cells") or {}
    out = {}
    for k, c in cells.items():
        ctx, bs = (int(v) for v in k.split(","))
        if c.get("fits") in ("no", "marginal"):
            out[(bs, ctx)] = f"KV {c.get('kv_gb')} GB/card: " + ("does not fit" if c["fits"] == "no" else "marginal")
    return out


def plot(cells: list[dict], out_png: str, plt, suptitle: str = MEASURED_TITLE, notes: dict | None = None,
         footer: str = "") -> None:
    """A grid of panels (rows: contexts, columns: batches) saved to ``out_png``; ``notes`` by (batch, context) go
    under a panel's title; one legend for all panels, below them."""
    batches = list(dict.fromkeys(c["bs"] for c in cells))
    contexts = list(dict.fromkeys(c["ctx"] for c in cells))
    fig, axes = plt.subplots(len(contexts), len(batches), figsize=(4 * len(batches), 3.1 * len(contexts)),
                             squeeze=False, layout="constrained")
    for c in cells:
        ax = axes[contexts.index(c["ctx"])][batches.index(c["bs"])]
        pts = [(w, t) for w, t in zip(c["widths"], c["tok_s"]) if t is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color="tab:blue", label="KDTREE, fixed budget")
        for value, label, style in ((c["dflash"], "DFLASH", "tab:orange"), (c["ar"], "AR (no drafter)", "tab:gray")):
            if value is not None:
                ax.axhline(value, color=style, linestyle="--", label=label)
        auto = ""
        if c["auto_width"] is not None and c["auto_tok_s"] is not None:
            ax.plot([c["auto_width"]], [c["auto_tok_s"]], "*", color="tab:red", markersize=14,
                    label="KDTREE-auto's width")
            auto = f": auto width {c['auto_width']}" + (f", {c['auto_tok_s'] / c['dflash']:.2f}x DFLASH"
                                                       if c["dflash"] else "")
        note = (notes or {}).get((c["bs"], c["ctx"]))
        ax.set_title(f"batch {c['bs']}, ctx {c['ctx']}{auto}" + (" (missing pieces: bounds)" if c["partial"] else "")
                     + (f"\n{note}" if note else ""), fontsize=9, color="tab:red" if note else "black")
        ax.set_xlabel("verify width (budget + 1)")
        ax.set_ylabel("tokens/s per request")
        ax.set_xticks(c["widths"] or [1])
        ax.grid(alpha=0.3)
    plot_captions.finish(fig, suptitle, out_png, plt, footer=footer,
                         legend=plot_captions.legend_entries(axes.flat), ncol=4)


def draw(path, payload, out_png: str, plt, tau_label: str | None = None, **given) -> None:
    """``payload`` (read from ``path``) drawn to ``out_png`` with its title; RoundError when it has no rows."""
    rows = payload.get("rows") if isinstance(payload, dict) else None
    if not rows:
        raise RoundError(f"no 'rows' (its report failed?); re-assemble them with python -m benchmarks.kimi_round "
                         f"--from-json {path} --json NEW.json")
    try:
        cells = panels(rows)
    except (KeyError, TypeError, AttributeError) as exc:
        raise RoundError(f"a row lacks {exc} (rows need mode, bs, ctx, width and tok_s)") from None
    source = (payload.get("args") or {}).get("from_json")
    footer = f"data: {path}" + (f", remodelled from {source}" if source else "") + \
        "; the model and its assumptions: benchmarks/RESULTS.md, 'The Kimi round model'"
    plot(cells, out_png, plt, title(payload, tau_label, path, cells, **given), kv_notes(payload), footer)


def pyplot(prog: str, where: str):
    """matplotlib's pyplot on the Agg backend (no display needed), or None after saying on stderr that it is not
    importable and where the figures are instead (the plot scripts' shared exit 2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"{prog}: matplotlib is not importable ({exc}); install it where you plot (pip install matplotlib); "
              f"{where}", file=sys.stderr)
        return None
    return plt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_kimi_round", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a kimi_round.py --json output")
    p.add_argument("png", help="the PNG to write")
    p.add_argument("--tau-label", default=None,
                   help="names the accept lengths' source in the title (default: the saved curve's source, or "
                        "results/runs.json's for a checked-in file)")
    plot_captions.add_fact_options(p, "the pieces' run's",
                                   "results/runs.json for a checked-in file or its --from-json source")
    args = p.parse_args(argv)
    plt = pyplot("plot_kimi_round", "the same figures are in kimi_round's summary table")
    if plt is None:
        return 2
    try:
        with open(args.json) as f:
            payload = json.load(f)
        draw(args.json, payload, args.png, plt, args.tau_label, run=args.run, date=args.date, device=args.device,
             commit=args.commit)
    except (OSError, ValueError, AttributeError) as exc:
        print(f"plot_kimi_round: cannot read {args.json} as a kimi_round --json file ({exc})", file=sys.stderr)
        return 2
    except RoundError as exc:
        print(f"plot_kimi_round: {args.json}: {exc}", file=sys.stderr)
        return 2
    print(f"plot_kimi_round: wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
