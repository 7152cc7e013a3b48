"""The served Kimi rank's round beside the Kimi round model, from ``bench_rank.py``'s report: one panel per batch size,
the round at each verify width as served (the cycle server's round log), as the model predicts from its pieces, and
as the corrected model predicts (``rank_report.corrected_rounds``: the verify priced for the rank's device, the
drafter and bookkeeping served).

    python -m benchmarks.plot_rank benchmarks/results/rank_h100_12layers.json OUT.png [--device-scale 1.4328]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import kimi_served, plot_captions, rank_report

#: the model's device bandwidth over the rank's, when the report's model and rank devices are an H200 and an H100
DEFAULT_SCALE = kimi_served.H200_OVER_H100


def series(report: dict, scale: float) -> dict:
    """``{bs: {"widths": [...], "served": [...], "model": [...], "corrected": [...]}}`` (ms) for every KDTREE
    cell that has a model prediction."""
    cells = (report.get("model") or {}).get("cells", {})
    out: dict = {}
    for r in rank_report.corrected_rounds(report, scale):
        if r["server"] == "plain":
            continue
        model = cells[str(r["bs"])][f"KDTREE-{r['width'] - 1}"]["round"]
        s = out.setdefault(r["bs"], {"widths": [], "served": [], "model": [], "corrected": []})
        s["widths"].append(r["width"])
        s["served"].append(r["served"])
        s["model"].append(model)
        s["corrected"].append(r["model"])
    return dict(sorted(out.items()))


def caption(report: dict, data: dict, f: dict) -> str:
    """The title: what was served where, what the model is, and the reading."""
    rank = report["rank"]
    corr = [s / c for d in data.values() for s, c in zip(d["served"], d["corrected"])]
    raw = [s / m for d in data.values() for s, m in zip(d["served"], d["model"])]
    return (f"Served: one Kimi K2.6 rank's KDTREE round ({rank['layers']} of 61 layers, dummy weights, context "
            f"{report['settings']['context']}) against the benchmarks/kimi_round.py model\n"
            f"{plot_captions.run_text(f)}; target: one TP 8 GPU's share of Kimi K2.6 (MLA, Marlin INT4 MoE, whole "
            f"vocabulary); drafter: a {rank.get('draft_layers', 5)}-layer DFlash drafter, assumed shape\n"
            f"Reading: served / corrected model {plot_captions.ratio_range(corr)} in every cell; served / the "
            f"model's H200 pieces {plot_captions.ratio_range(raw)}")


def draw(report: dict, path, out_png, plt, scale: float, **given) -> None:
    data = series(report, scale)
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.2), layout="constrained", squeeze=False)
    for ax, (bs, d) in zip(axes[0], data.items()):
        x = range(len(d["widths"]))
        for i, (key, label, color) in enumerate((("served", "served round", "tab:blue"),
                                                 ("model", "model (H200 pieces)", "tab:gray"),
                                                 ("corrected", "corrected model", "tab:orange"))):
            ax.bar([v + (i - 1) * 0.27 for v in x], d[key], width=0.27, label=label, color=color)
        ax.set_xticks(list(x), [str(w) for w in d["widths"]])
        ax.set_xlabel("verify width")
        ax.set_ylabel("ms per round")
        ax.set_title(f"batch {bs}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    f = plot_captions.facts(path, report.get("run"), **given)
    plot_captions.finish(fig, caption(report, data, f), out_png, plt, legend=plot_captions.legend_entries(axes[0]),
                         footer=f"data: {path}; python -m benchmarks.plot_rank {Path(path).name} OUT.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="bench_rank.py's rank.json")
    ap.add_argument("png", type=Path)
    ap.add_argument("--device-scale", type=float, default=DEFAULT_SCALE,
                    help="the model's device bandwidth over the rank's (default 4800 / 3350: H200 pieces, an H100 rank)")
    plot_captions.add_fact_options(ap, "the run's", "the JSON's run record, else results/runs.json")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_rank: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    given = {k: getattr(args, k) for k in plot_captions.FACTS}
    draw(json.loads(args.json.read_text()), args.json, args.png, plt, args.device_scale, **given)
    print(f"plot_rank: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
