"""The testbed pair's acceptance figures from ``python -m testbed.acceptance``'s ``acceptance.json``.

    python -m benchmarks.plot_acceptance ACCEPTANCE.json OUT_DIR

* ``OUT_DIR/acceptance_tau.png``: KDTREE's tau (pooled: completion tokens over verify rounds, as ``kimi_round``
  takes it) against the pinned node budget, one panel per temperature, DFLASH's tau as a horizontal line (left
  out, and said so, where its server fell back to greedy verification at T > 0);
* ``OUT_DIR/acceptance_calibration.png``: the drafter's calibration from the KDTREE round logs: per tree cut
  (one point per budget and temperature), its predicted accept length against the realised one, the diagonal
  being a calibrated drafter; and per depth, its probability of reaching the depth against the share of
  request-rounds that did, one line per budget, one panel per temperature.

* with ``--training METADATA`` (the pair's ``metadata.json``), ``OUT_DIR/pair_training.png``: the target's and
  the drafter's training and held-out losses against the step, and the drafter's held-out depth-1 accuracy.

Every figure's title names the run, its date and device (``--run`` / ``--date`` / ``--device``, and
``--training-run`` / ... for the training figure: the JSONs record the device only as "cuda", and no run or date;
default ``benchmarks/results/runs.json`` for a checked-in file), the pair (its trained target and drafter) and a reading
of the curves; its foot carries the run's command and commit, wrapped to the figure's width, and one legend below
the panels keeps the curves clear. Needs matplotlib (exit 2 and a message without it, as
``plot_kimi_round.py``); a file that is not an acceptance report exits 2 too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import plot_captions
from benchmarks.plot_kimi_round import pyplot
from benchmarks.server_kinds import overlapped, pinned_budget

#: one colour per temperature, in the report's order
COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple")


class PlotError(Exception):
    """An input the plots cannot use; the message says what is wrong."""


def _kdtree(servers: dict) -> list[tuple[int, dict]]:
    """``(budget, server)`` of the pinned-budget KDTREE servers that served, budget ascending; an ``-overlap`` twin
    accepts what its budget's server does, so it is not a second point."""
    out = [(pinned_budget(k), s) for k, s in servers.items()
           if pinned_budget(k) is not None and not overlapped(k) and not s.get("error")]
    return sorted(out, key=lambda x: x[0])


def tau_series(rep: dict) -> list[dict]:
    """Per temperature of the run: ``budgets`` / ``tau`` of the KDTREE servers that have that phase, ``dflash``
    (None where it was not measured) and ``dflash_note`` (why not, or None). PlotError without servers."""
    servers = rep.get("servers") if isinstance(rep, dict) else None
    temps = (rep.get("settings") or {}).get("temperatures") if isinstance(rep, dict) else None
    if not isinstance(servers, dict) or not servers or not temps:
        raise PlotError("no 'servers' / 'settings.temperatures' (is it testbed.acceptance's acceptance.json?)")
    out = []
    for t in temps:
        key = f"{t:g}"
        pts = [(b, s["phases"][key]["tau_pooled"]) for b, s in _kdtree(servers)
               if (s.get("phases", {}).get(key) or {}).get("tau_pooled") is not None]
        dflash, note = None, None
        d = servers.get("dflash") or {}
        phase = (d.get("phases") or {}).get(key) or {}
        if d.get("error"):
            note = "DFLASH did not serve (acceptance.json says why)"
        elif phase.get("sampling_preserved") is False:
            note = "DFLASH left out: its server fell back to greedy verification"
        elif phase.get("tau_pooled") is not None:
            dflash = phase["tau_pooled"]
        out.append({"temperature": t, "budgets": [b for b, _ in pts], "tau": [x for _, x in pts], "dflash": dflash,
                    "dflash_note": note})
    return out


def calibration_series(rep: dict) -> dict:
    """Per temperature: ``cuts``, ``(budget, predicted, realised)`` per KDTREE server whose round log has both;
    ``depth``, ``{budget: (predicted, realised)}`` per-depth reach lists."""
    cuts, depth = {}, {}
    for t in rep["settings"]["temperatures"]:
        key = f"{t:g}"
        for b, s in _kdtree(rep["servers"]):
            rounds = (s.get("phases", {}).get(key) or {}).get("rounds") or {}
            if rounds.get("predicted_raw") is not None and rounds.get("realised") is not None:
                cuts.setdefault(t, []).append((b, rounds["predicted_raw"], rounds["realised"]))
            if rounds.get("depth"):
                depth.setdefault(t, {})[b] = (rounds["depth"]["predicted"], rounds["depth"]["realised"])
    return {"cuts": cuts, "depth": depth}


PAIR = "the testbed pair (testbed/): a trained Llama target and its trained DFlash drafter"


def _temp(t: float) -> str:
    return "greedy" if t == 0 else f"T = {t:g}"


def footer(rep: dict) -> str:
    s = rep.get("settings") or {}
    return (f"{s.get('command', '')}  |  commit {s.get('commit', plot_captions.UNRECORDED)}  |  {s.get('device')} "
            f"{s.get('dtype')}, {s.get('prompts')} prompts x {s.get('new_tokens')} tokens")


def _head(rep: dict, f: dict, what: str) -> str:
    pair, s = rep.get("pair") or {}, rep.get("settings") or {}
    preset = f" (preset {pair['preset']})" if pair.get("preset") else ""
    graphs = {True: ", CUDA graphs on", False: ", CUDA graphs off"}.get(s.get("cuda_graph"), "")
    return (f"Testbed pair: {what}, {plot_captions.run_text(f)}\n"
            f"{PAIR}{preset}; SGLang servers, {s.get('dtype', '?')}{graphs}, {s.get('prompts', '?')} held-out "
            f"prompts x {s.get('new_tokens', '?')} tokens")


def tau_caption(rep: dict, series: list[dict], f: dict) -> str:
    """Title and caption of acceptance_tau.png: the run (``f``), the pair, and per temperature KDTREE's tau from
    the smallest to the largest budget against DFLASH's."""
    parts = []
    for c in series:
        if not c["budgets"]:
            continue
        part = (f"{_temp(c['temperature'])}: {c['tau'][0]:.2f} at budget {c['budgets'][0]} to {c['tau'][-1]:.2f} "
                f"at {c['budgets'][-1]}")
        if c["dflash"] is not None:
            part += (f", above DFLASH's {c['dflash']:.2f} at every budget" if min(c["tau"]) > c["dflash"]
                     else f", not above DFLASH's {c['dflash']:.2f} at every budget")
        parts.append(part)
    return (_head(rep, f, "accept length (tau) against the tree budget") + "\n"
            + ("Reading: KDTREE's tau rises with the budget: " + "; ".join(parts) if parts
               else "Reading: no KDTREE server has a tau"))


def plot_tau(rep: dict, series: list[dict], out_png: Path, plt, f: dict | None = None) -> None:
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 3.8), squeeze=False, layout="constrained")
    for ax, c, color in zip(axes[0], series, COLORS):
        if c["budgets"]:
            ax.plot(c["budgets"], c["tau"], "o-", color=color,
                    label=f"KDTREE, pinned budget: {_temp(c['temperature'])}")
            for b, t in zip(c["budgets"], c["tau"]):
                ax.annotate(f"{t:.2f}", (b, t), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
            ax.margins(y=0.12)  # room for the top point's label inside the axes
        if c["dflash"] is not None:
            ax.axhline(c["dflash"], color="tab:orange", linestyle="--", label="DFLASH (SGLang's defaults)")
            ax.annotate(f"DFLASH {c['dflash']:.2f}", (c["budgets"][0] if c["budgets"] else 1, c["dflash"]),
                        textcoords="offset points", xytext=(2, 4), fontsize=7, color="tab:orange")
        ax.set_xscale("log", base=2)
        ax.set_xticks(c["budgets"] or [1])
        ax.set_xticklabels([str(b) for b in c["budgets"]] or ["1"])
        ax.set_xlabel("node budget (verify width - 1)")
        ax.set_ylabel("tau: tokens per round (pooled)")
        ax.set_title(_temp(c["temperature"]) + ("\n" + c["dflash_note"] if c["dflash_note"] else ""), fontsize=9)
        ax.grid(alpha=0.3)
    plot_captions.finish(fig, tau_caption(rep, series, f or {}), out_png, plt, footer=footer(rep),
                         legend=plot_captions.legend_entries(axes.flat), ncol=3)


def calibration_caption(rep: dict, cal: dict, f: dict) -> str:
    """Title and caption of acceptance_calibration.png: the run (``f``), the pair, and per temperature how far the
    drafter's expected accept length of a cut lies from the realised one."""
    parts = []
    for t, pts in cal["cuts"].items():
        gaps = [p - r for _, p, r in pts]
        lo, hi = min(gaps), max(gaps)
        when = "greedy" if t == 0 else f"at T = {t:g}"
        if hi < 0:
            parts.append(f"{when}, {-hi:.2f}-{-lo:.2f} tokens fewer than realised (under-confident)")
        elif lo > 0:
            parts.append(f"{when}, {lo:.2f}-{hi:.2f} more than realised (over-confident)")
        else:
            parts.append(f"{when}, within {max(-lo, hi):.2f} of the realised length")
    return (_head(rep, f, "the drafter's predicted against realised acceptance") + "\n"
            + ("Reading: per tree cut the drafter expects, " + "; ".join(parts) if parts
               else "Reading: no round log has both figures"))


def plot_calibration(rep: dict, cal: dict, out_png: Path, plt, f: dict | None = None) -> None:
    temps = list(cal["depth"]) or [0.0]
    fig, axes = plt.subplots(1, 1 + len(temps), figsize=(5.5 * (1 + len(temps)), 4.2), squeeze=False,
                             layout="constrained")
    cut_ax = axes[0][0]
    top = 1.0
    for (t, pts), color in zip(cal["cuts"].items(), COLORS):
        cut_ax.plot([p for _, p, _ in pts], [r for _, _, r in pts], "o-", color=color,
                    label=f"tree cuts, {_temp(t)}")
        for i, (b, p, r) in enumerate(pts):  # above and below in turn: close points' labels would overlap
            cut_ax.annotate(str(b), (p, r), textcoords="offset points", xytext=(0, 7 if i % 2 else -11),
                            ha="center", fontsize=7)
        top = max([top] + [max(p, r) for _, p, r in pts])
    cut_ax.plot([1, top], [1, top], color="gray", linestyle=":", label="calibrated (diagonal)")
    cut_ax.set_xlabel("drafter's expected accept length of the cut")
    cut_ax.set_ylabel("realised accept length")
    cut_ax.set_title("per tree cut (labels: budget)", fontsize=9)
    cut_ax.grid(alpha=0.3)
    cmap = plt.get_cmap("viridis")
    for t, depth_ax in zip(temps, axes[0][1:]):
        by_budget = sorted(cal["depth"].get(t, {}).items())
        for i, (b, (pred, real)) in enumerate(by_budget):
            color = cmap(i / max(len(by_budget) - 1, 1))
            depths = range(1, len(pred) + 1)
            depth_ax.plot(depths, real, "o-", color=color, markersize=3, label=f"budget {b}")
            depth_ax.plot(depths, pred, "x--", color=color, markersize=4)
        depth_ax.set_xlabel("draft depth d")
        depth_ax.set_ylabel("P(accept reaches depth d)")
        depth_ax.set_title(f"per depth, {_temp(t)} (o solid: realised, x dashed: drafter)", fontsize=9)
        depth_ax.grid(alpha=0.3)
    plot_captions.finish(fig, calibration_caption(rep, cal, f or {}), out_png, plt, footer=footer(rep),
                         legend=plot_captions.legend_entries(axes.flat), ncol=8)


def training_series(meta: dict) -> dict:
    """``metadata.json`` -> per model (target, drafter): steps, train and held-out losses (None where a point has
    none), and the drafter's held-out depth-1 accuracy. PlotError without both curves."""
    out = {}
    for name in ("target", "drafter"):
        curve = (meta.get(name) or {}).get("curve")
        if not curve:
            raise PlotError(f"no {name} curve (is it the pair's metadata.json?)")
        out[name] = {k: [p.get(src) for p in curve] for k, src in
                     (("step", "step"), ("train", "train_loss"), ("heldout", "heldout_loss"),
                      ("acc1", "heldout_acc_depth1"))}
    return out


def training_caption(meta: dict, series: dict, f: dict) -> str:
    """Title and caption of pair_training.png: the run (``f``), both models, and where their losses ended."""
    def model(name):
        m = meta.get(name) or {}
        layers = (m.get("shape") or {}).get("layers")
        return (f"{name}: {m.get('architecture', '?')}" + (f", {layers} layers" if layers else "")
                + f", {m.get('params', 0) / 1e6:.1f} M parameters")

    def last(name, key):
        pts = [(s, v) for s, v in zip(series[name]["step"], series[name][key]) if v is not None and v == v]
        return pts[-1] if pts else (None, None)

    on = " on the target's greedy continuations" if meta.get("continuations") else ""
    step, loss = last("target", "heldout")
    prev = [v for v in series["target"]["heldout"] if v is not None and v == v][-2:]
    falling = ", still falling" if len(prev) == 2 and prev[1] < prev[0] else ""
    ppl = (meta.get("target") or {}).get("heldout_perplexity")
    d_step, d_loss = last("drafter", "heldout")
    _, acc = last("drafter", "acc1")
    reading = (f"Reading: the target's held-out loss ends at {loss:.2f} nats per token"
               + (f" (perplexity {ppl:.1f})" if ppl else "") + f" at step {step}{falling}; the drafter's at "
               f"{d_loss:.2f}" + (f", held-out depth-1 accuracy {acc:.2f}" if acc is not None else "")
               + f" at step {d_step}") if loss is not None and d_loss is not None else "Reading: no held-out loss"
    return (f"Testbed pair: training curves, {plot_captions.run_text(f)}\n"
            f"{model('target')}; {model('drafter')}, trained{on} (preset {meta.get('preset')}, seed "
            f"{meta.get('seed')})\n{reading}")


def plot_training(meta: dict, series: dict, out_png: Path, plt, f: dict | None = None) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    twins = []
    for ax, name in zip(axes, ("target", "drafter")):
        c = series[name]
        for key, style, label in (("train", "-", "training batch loss"), ("heldout", "o-", "held-out loss")):
            pts = [(s, v) for s, v in zip(c["step"], c[key]) if v is not None and v == v and s > 0]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        m = meta[name]
        last = next((v for v in reversed(c["heldout"]) if v is not None), float("nan"))
        ax.set_title(f"{name}: {m.get('architecture', '')}, {m.get('params', 0) / 1e6:.1f} M parameters, "
                     f"held-out loss {m.get('heldout_loss', last):.3f}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per token)")
        ax.grid(alpha=0.3)
        if name == "drafter" and any(a is not None for a in c["acc1"]):
            acc = ax.twinx()
            acc.plot(c["step"], c["acc1"], "s--", color="tab:green", label="held-out depth-1 accuracy (right axis)")
            acc.set_ylabel("depth-1 accuracy")
            twins.append(acc)
    foot = (f"python -m testbed.build_pair ({meta.get('preset')}, seed {meta.get('seed')}, {meta.get('device')})  |  "
            f"commit {str(meta.get('commit'))[:12]}")
    plot_captions.finish(fig, training_caption(meta, series, f or {}), out_png, plt, footer=foot,
                         legend=plot_captions.legend_entries([*axes, *twins]), ncol=3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="testbed.acceptance's acceptance.json")
    p.add_argument("out", type=Path, help="folder for acceptance_tau.png and acceptance_calibration.png")
    p.add_argument("--training", default=None, metavar="METADATA", help="the pair's metadata.json: pair_training.png")
    for prefix, what in (("", "the acceptance run's"), ("training-", "the training run's")):
        plot_captions.add_fact_options(p, what, "results/runs.json for a checked-in file, else 'not recorded'",
                                       facts=("run", "date", "device"), prefix=prefix)
    args = p.parse_args(argv)
    plt = pyplot("plot_acceptance", "the same figures are in acceptance.json and the run's table")
    if plt is None:
        return 2
    try:
        rep = json.loads(Path(args.json).read_text())
        series = tau_series(rep)
        cal = calibration_series(rep)
    except (OSError, ValueError, PlotError) as exc:
        print(f"plot_acceptance: cannot use {args.json}: {exc}", file=sys.stderr)
        return 2
    try:
        meta = json.loads(Path(args.training).read_text()) if args.training else None
        training = training_series(meta) if args.training else None
    except (OSError, ValueError, PlotError) as exc:
        print(f"plot_acceptance: cannot use {args.training}: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    f = run_facts(args.json, rep, run=args.run, date=args.date, device=args.device)
    plot_tau(rep, series, args.out / "acceptance_tau.png", plt, f)
    plot_calibration(rep, cal, args.out / "acceptance_calibration.png", plt, f)
    print(f"plot_acceptance: wrote {args.out / 'acceptance_tau.png'} and {args.out / 'acceptance_calibration.png'}")
    if training:
        f = training_facts(args.training, meta, run=args.training_run, date=args.training_date,
                           device=args.training_device)
        plot_training(meta, training, args.out / "pair_training.png", plt, f)
        print(f"plot_acceptance: wrote {args.out / 'pair_training.png'}")
    return 0


def run_facts(path, rep: dict, **given) -> dict:
    """The acceptance run's facts: its settings' commit (up to the stamp's note), then ``plot_captions.facts``;
    the settings' device ("cuda") names no card, so it is not taken."""
    commit = str((rep.get("settings") or {}).get("commit") or "").split(" (")[0]
    return plot_captions.facts(path, {"commit": commit}, **given)


def training_facts(path, meta: dict, **given) -> dict:
    """The training run's facts: its metadata's commit, then ``plot_captions.facts`` (its device is "cuda")."""
    return plot_captions.facts(path, {"commit": str(meta.get("commit") or "")}, **given)


if __name__ == "__main__":
    raise SystemExit(main())
