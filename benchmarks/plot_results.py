"""The PNGs of benchmarks/RESULTS.md, drawn from the benchmarks' JSON.

    python -m benchmarks.plot_results --bench DIR/bench.json [--kimi kimi_round.json] --out DIR

* ``--bench``: ``bench_server.py``'s ``bench.json`` (``table``: batch -> server kind -> ``{"tok_s_per_request",
  ...}``) -> ``OUT/server_tok_s.png``: tokens/s per request and in all against batch, one line per kind (plain, DFLASH and
  every KDTREE kind the run had).
* ``--kimi``: a ``kimi_round.py --json`` output -> ``OUT/kimi_round.png``: the modelled Kimi K2.6 round against the
  verify width, drawn by ``plot_kimi_round.py``.

Needs matplotlib, which the package does not depend on; without it the script says so and exits 2. So does a
file it cannot read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import plot_kimi_round, server_kinds

#: the baselines' line styles; every other kind (kdtree, kdtree-64, kdtree-auto, ...) is a KDTREE line
BASELINES = {"plain": ("plain (autoregressive)", "tab:gray", "s--"), "dflash": ("DFLASH", "tab:orange", "^--")}
#: the KDTREE lines' colours, none of them a baseline's
KDTREE_COLORS = ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


class PlotError(Exception):
    """An input the plots cannot use; the message names the file and what is wrong."""


def server_series(bench: dict, figure: str = "tok_s_per_request") -> tuple[list[int], dict[str, list[float | None]]]:
    """``bench.json`` -> (batches ascending, kind -> ``figure`` (tokens/s per request, or ``tok_s_total``) at each
    batch, None where the kind did not run). PlotError when there is no ``table`` or no row."""
    table = bench.get("table") if isinstance(bench, dict) else None
    if not isinstance(table, dict) or not table:
        raise PlotError("no 'table' of batch -> kind -> figures (is it bench_server.py's bench.json?)")
    try:
        batches = sorted(int(b) for b in table)
    except ValueError:
        raise PlotError(f"'table' keys must be batch sizes, got {sorted(table)}") from None
    kinds = list(dict.fromkeys(kind for b in table.values() for kind in b))
    try:
        series = {kind: [table[str(bs)].get(kind, {}).get(figure) for bs in batches] for kind in kinds}
    except AttributeError:
        raise PlotError("a 'table' row is not kind -> figures (is it bench_server.py's bench.json?)") from None
    return batches, series


def kind_label(kind: str, budget) -> str:
    """A server kind as a reader names it: ``kdtree-15`` is budget 15, ``kdtree-auto`` the automatic width,
    ``kdtree-63-overlap`` budget 63 on the overlap scheduler."""
    if server_kinds.overlapped(kind):
        return kind_label(kind.removesuffix(server_kinds.OVERLAP_SUFFIX), budget) + ", overlap on"
    if kind == "kdtree":
        return f"KDTREE budget {budget}" if budget else "KDTREE"
    rest = kind.removeprefix("kdtree-")
    if rest.isdigit():
        return f"KDTREE budget {rest}"
    if rest.startswith("auto"):
        return "KDTREE automatic width" + (" (round log on)" if rest.endswith("-log") else "")
    return f"KDTREE ({kind})"


def plot_server(bench: dict, out_png: Path, plt) -> None:
    """Tokens/s per request and in all against batch, one line per server kind, saved to ``out_png``."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    budget = bench.get("budget")
    for ax, figure, ylabel in ((axes[0], "tok_s_per_request", "tokens/s per request (median)"),
                               (axes[1], "tok_s_total", "tokens/s, all requests")):
        batches, series = server_series(bench, figure)
        trees = 0
        for kind, values in series.items():
            pts = [(bs, v) for bs, v in zip(batches, values) if isinstance(v, (int, float))]
            if not pts:
                continue
            if kind in BASELINES:
                label, color, style = BASELINES[kind]
            else:
                label, color, style = kind_label(kind, budget), KDTREE_COLORS[trees % len(KDTREE_COLORS)], "o-"
                trees += 1
            ax.plot(*zip(*pts), style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (concurrent requests)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{bench.get('variant', 'server')} target, CUDA graphs on", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise PlotError(f"cannot read it as JSON ({exc})") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_results", description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", default=None, metavar="JSON", help="bench_server.py's bench.json")
    p.add_argument("--kimi", default=None, metavar="JSON", help="a kimi_round.py --json output")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs (created if missing)")
    args = p.parse_args(argv)
    if not args.bench and not args.kimi:
        p.error("give --bench, --kimi or both")
    plt = plot_kimi_round.pyplot("plot_results", "the figures themselves are in benchmarks/RESULTS.md")
    if plt is None:
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    if args.bench:
        jobs.append((args.bench, out / "server_tok_s.png", lambda data, png: plot_server(data, png, plt)))
    if args.kimi:
        def kimi(data, png):
            rows = data.get("rows") if isinstance(data, dict) else None
            if not rows:
                raise PlotError("no 'rows' (is it a kimi_round.py --json output? re-assemble a failed report with "
                                "python -m benchmarks.kimi_round --from-json IN --json NEW.json)")
            try:
                cells = plot_kimi_round.panels(rows)
            except (KeyError, TypeError, AttributeError) as exc:
                raise PlotError(f"a row lacks {exc} (rows need mode, bs, ctx, width and tok_s)") from None
            plot_kimi_round.plot(cells, str(png), plt)
        jobs.append((args.kimi, out / "kimi_round.png", kimi))
    for path, png, draw in jobs:
        try:
            draw(_load(path), png)
        except PlotError as exc:
            print(f"plot_results: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"plot_results: wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
