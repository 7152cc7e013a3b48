"""Tokens/s per request against verify width from a ``kimi_round.py --json`` file: one panel per (batch, context),
the fixed KDTREE budgets as a line, DFLASH and AR as horizontal lines, KDTREE-auto's chosen width marked.

    python -m benchmarks.plot_kimi_round ROUND.json OUT.png [--tau-label TEXT]

A ``kimi_round.py --box`` file (its ``estimate`` record) is titled as what it is: the box, ESTIMATE, the pricing
rule, the tau source and the date, and a panel whose KV would not fit the card says so.

Needs matplotlib, which the package does not depend on; without it the script says so and exits 2 (the same
figures are in the kimi_round report's summary table).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

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


def tau_text(payload: dict, label: str | None = None) -> str:
    """Where the round's accept lengths come from: ``label`` or the saved curve's source (up to its first
    parenthesis) with its points, and DFLASH's tau."""
    cfg = payload.get("config") or {}
    curve, dflash = cfg.get("curve") or {}, cfg.get("accept_dflash")
    source = label or str(curve.get("source", "tau curve")).split(" (")[0]
    points = " ".join(f"{b}={t:.2f}" for b, t in curve.get("points", [])[:4])
    return f"tau: {source}" + (f" ({points})" if points else "") + \
        (f", DFLASH {dflash:.2f}" if isinstance(dflash, (int, float)) else "")


def title(payload: dict, tau_label: str | None = None) -> str:
    """The figure's title: an ``estimate`` names its box, ESTIMATE, the pricing rule, the tau source and its date;
    a measured run keeps the measured title, with its tau source."""
    est = payload.get("estimate")
    if not est:
        return f"{MEASURED_TITLE}\n{tau_text(payload, tau_label)}"
    return (f"ESTIMATE, not measured: Kimi K2.6 decode round at TP 8 on {est.get('box_label', est.get('box'))}\n"
            f"H200 pieces repriced for the box (rule '{est.get('rule', '?')}'); {tau_text(payload, tau_label)}; "
            f"{est.get('date', 'undated')}")


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


def plot(cells: list[dict], out_png: str, plt, suptitle: str = MEASURED_TITLE, notes: dict | None = None) -> None:
    """A grid of panels (rows: contexts, columns: batches) saved to ``out_png``; ``notes`` by (batch, context) go
    under a panel's title."""
    batches = list(dict.fromkeys(c["bs"] for c in cells))
    contexts = list(dict.fromkeys(c["ctx"] for c in cells))
    fig, axes = plt.subplots(len(contexts), len(batches), figsize=(4 * len(batches), 3.2 * len(contexts)),
                             squeeze=False)
    for c in cells:
        ax = axes[contexts.index(c["ctx"])][batches.index(c["bs"])]
        pts = [(w, t) for w, t in zip(c["widths"], c["tok_s"]) if t is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color="tab:blue", label="KDTREE, fixed budget")
        for value, label, style in ((c["dflash"], "DFLASH", "tab:orange"), (c["ar"], "AR", "tab:gray")):
            if value is not None:
                ax.axhline(value, color=style, linestyle="--", label=label)
        if c["auto_width"] is not None and c["auto_tok_s"] is not None:
            ax.plot([c["auto_width"]], [c["auto_tok_s"]], "*", color="tab:red", markersize=14,
                    label=f"auto: width {c['auto_width']}")
        note = (notes or {}).get((c["bs"], c["ctx"]))
        ax.set_title(f"batch {c['bs']}, ctx {c['ctx']}" + (" (missing pieces: bounds)" if c["partial"] else "")
                     + (f"\n{note}" if note else ""), fontsize=9, color="tab:red" if note else "black")
        ax.set_xlabel("verify width (budget + 1)")
        ax.set_ylabel("tokens/s per request")
        ax.set_xticks(c["widths"] or [1])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


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
                   help="names the accept lengths' source in the title (default: the saved curve's source)")
    args = p.parse_args(argv)
    plt = pyplot("plot_kimi_round", "the same figures are in kimi_round's summary table")
    if plt is None:
        return 2
    try:
        with open(args.json) as f:
            payload = json.load(f)
        rows = payload.get("rows")
    except (OSError, ValueError, AttributeError) as exc:
        print(f"plot_kimi_round: cannot read {args.json} as a kimi_round --json file ({exc})", file=sys.stderr)
        return 2
    if not rows:
        print(f"plot_kimi_round: {args.json} holds no rows (its report failed?); re-assemble them with "
              f"python -m benchmarks.kimi_round --from-json {args.json} --json NEW.json", file=sys.stderr)
        return 2
    plot(panels(rows), args.png, plt, title(payload, args.tau_label), kv_notes(payload))
    print(f"plot_kimi_round: wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
