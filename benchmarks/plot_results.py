"""The PNGs of benchmarks/RESULTS.md, drawn from the benchmarks' JSON.

    python -m benchmarks.plot_results --bench DIR/bench.json [--kimi kimi_round.json] --out DIR
        [--bench-name server_tok_s.png] [--run "run Z"] [--date YYYY-MM-DD] [--device "1 H100"] [--commit SHA]

* ``--bench``: ``bench_server.py``'s ``bench.json`` (``table``: batch -> server kind -> ``{"tok_s_per_request",
  ...}``) -> ``OUT/server_tok_s.png`` (``--bench-name``): tokens/s per request and in all against batch, one line
  per kind (plain, DFLASH and every KDTREE kind the run had). Its title names the run, date, device and commit
  (``bench.json`` records none of them: the options give them, else ``benchmarks/results/runs.json`` for the checked-in
  files; the options name the bench's run, not the Kimi round's), the toy target and its drafter, and a reading
  of the curves.
* ``--kimi``: a ``kimi_round.py --json`` output -> ``OUT/kimi_round.png``: the modelled Kimi K2.6 round against the
  verify width, drawn and titled by ``plot_kimi_round.py``.

Needs matplotlib, which the package does not depend on; without it the script says so and exits 2. So does a
file it cannot read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import plot_captions, plot_kimi_round, server_kinds

#: the baselines' line styles; every other kind (kdtree, kdtree-64, kdtree-auto, ...) is a KDTREE line
BASELINES = {"plain": ("plain (autoregressive)", "tab:gray", "s--"), "dflash": ("DFLASH", "tab:orange", "^--")}
#: the KDTREE lines' colours, none of them a baseline's
KDTREE_COLORS = ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
#: the bench's targets (tests/e2e/cuda_servers.variants): toy models that tests/e2e/make_tiny_models.py and
#: make_kimi_model.py build, fitted to a synthetic language; bench.json names only the variant
VARIANTS = {
    "kimi-marlin": "Kimi-shaped toy (3 layers, Kimi K2.6's MLA geometry, W4A16 experts on our Marlin MoE)",
    "kimi": "Kimi-shaped toy (3 layers, Kimi K2.6's MLA geometry, W4A16 experts on SGLang's MoE)",
    "llama": "tiny Llama toy",
    "dsv3": "tiny DeepSeek-V3 toy",
}
#: every variant's drafter: trained with the context of unrelated sequences, so it drafts from the last token
#: alone (make_tiny_models.train_drafter); its accept lengths say nothing about a real drafter's
DRAFTER = "toy DFlash, block 8, context-blind (not a real drafter)"


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


def _short(kind: str, budget) -> str:
    return {"plain": "plain", "dflash": "DFLASH"}.get(kind) or kind_label(kind, budget)


def _batches(items: list[tuple[int, float]]) -> str:
    """[(1, 1.15), (32, 1.13)] -> "batch 1 (1.15x) and 32 (1.13x)"."""
    parts = [f"{bs} ({r:.2f}x)" for bs, r in items]
    return "batch " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


#: the KDTREE server a user gets without flags (automatic width; overlap on where the run compared both), first found
DEFAULT_KDTREE = ("kdtree-auto-overlap", "kdtree-auto")


def reading(bench: dict) -> str:
    """What the per-request panel shows: KDTREE at its defaults against the faster of plain and DFLASH, then at
    which batches the best KDTREE server (any budget) is ahead, by how much, and which server is fastest."""
    batches, series = server_series(bench)
    budget = bench.get("budget")
    ahead, behind, fastest = [], [], {}
    for i, bs in enumerate(batches):
        cells = {k: v[i] for k, v in series.items() if isinstance(v[i], (int, float))}
        base = max((cells[k] for k in BASELINES if k in cells), default=None)
        tree = max((v for k, v in cells.items() if k not in BASELINES), default=None)
        if not base or tree is None:
            continue
        (ahead if tree >= base else behind).append((bs, tree / base))
        fastest[bs] = _short(max(cells, key=cells.get), budget)
    if not ahead and not behind:
        return "Reading: no batch has both a KDTREE server and a baseline"
    if not behind:
        where = "ahead of the faster of plain and DFLASH at every batch (" + \
            ", ".join(f"{r:.2f}x at {bs}" for bs, r in ahead) + ")"
    elif not ahead:
        where = "behind the faster of plain and DFLASH at every batch (" + \
            ", ".join(f"{r:.2f}x at {bs}" for bs, r in behind) + ")"
    else:
        where = f"ahead of the faster of plain and DFLASH at {_batches(ahead)}, behind at {_batches(behind)}"
    defaults = next((k for k in DEFAULT_KDTREE if k in series), None)
    said = ""
    if defaults is not None:
        ratios = []
        for i, bs in enumerate(batches):
            base = max((series[k][i] for k in BASELINES if k in series and isinstance(series[k][i], (int, float))),
                       default=None)
            if base and isinstance(series[defaults][i], (int, float)):
                ratios.append(f"{series[defaults][i] / base:.2f}x at {bs}")
        said = (f"KDTREE at its defaults ({_short(defaults, budget)}) against the faster of plain and DFLASH: "
                + ", ".join(ratios) + ". ")
    best = "the best KDTREE server" if not said else "The best KDTREE server (any width)"
    return (f"Reading, per request: {said}{best} is {where}; fastest: "
            + "; ".join(f"batch {bs} {fastest[bs]}" for bs in fastest))


def caption(bench: dict, f: dict) -> str:
    """The figure's title and caption: the run (``f``: ``plot_captions.facts``), target and drafter, what was
    timed, and the reading."""
    variant = bench.get("variant", "server")
    runs = sorted({c.get("runs") for row in (bench.get("table") or {}).values() for c in row.values()
                   if isinstance(c, dict) and isinstance(c.get("runs"), int)})
    timed = f"{runs[-1]} timed batch{'es' if runs[-1] > 1 else ''} per size" if runs else "timed batches"
    return (f"Server bench, {plot_captions.run_text(f)}: tokens/s against batch "
            f"({bench.get('new_tokens', '?')} tokens a request, {timed})\n"
            f"target: {VARIANTS.get(variant, f'bench variant {variant}')}; drafter: {DRAFTER}\n"
            "CUDA graphs on, plain and DFLASH at SGLang's defaults. A host-paced toy target, one run: not a ranking "
            f"for Kimi K2.6\n{reading(bench)}")


def plot_server(bench: dict, out_png: Path, plt, f: dict | None = None, source: str = "") -> None:
    """Tokens/s per request and in all against batch, one line per server kind, saved to ``out_png`` with the
    caption of ``caption(bench, f)``."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
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
    f = f or {}
    footer = f"data: {source}" if source else ""
    if f.get("run"):
        footer += ("; " if footer else "") + f"its command: {f['run']}'s row in benchmarks/RESULTS*.md"
    plot_captions.finish(fig, caption(bench, f), out_png, plt, footer=footer,
                         legend=plot_captions.legend_entries(axes), ncol=4)


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
    p.add_argument("--bench-name", default="server_tok_s.png", metavar="PNG",
                   help="file name of the bench's PNG in --out (default server_tok_s.png)")
    plot_captions.add_fact_options(p, "the bench's", "bench.json does not record it: results/runs.json for a checked-in "
                                   "file, else 'not recorded'")
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
        def bench(data, png):
            f = plot_captions.facts(args.bench, data, run=args.run, date=args.date, device=args.device,
                                    commit=args.commit)
            plot_server(data, png, plt, f, args.bench)
        jobs.append((args.bench, out / args.bench_name, bench))
    if args.kimi:
        def kimi(data, png):
            try:
                plot_kimi_round.draw(args.kimi, data, str(png), plt)
            except plot_kimi_round.RoundError as exc:
                raise PlotError(str(exc)) from None
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
