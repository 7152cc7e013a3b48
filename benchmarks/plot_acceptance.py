"""The testbed pair's acceptance figures from ``python -m testbed.acceptance``'s ``acceptance.json``.

    python -m benchmarks.plot_acceptance ACCEPTANCE.json OUT_DIR

* ``OUT_DIR/acceptance_tau.png``: KDTREE's tau (pooled: completion tokens over verify rounds, as ``kimi_round`` takes it) against the
  pinned node budget, one panel per temperature, DFLASH's tau as a horizontal line (left out, and said so, where
  its server fell back to greedy verification at T > 0);
* ``OUT_DIR/acceptance_calibration.png``: the drafter's calibration from the KDTREE round logs: per tree cut
  (one point per budget and temperature), its predicted accept length against the realised one, the diagonal
  being a calibrated drafter; and per depth, its probability of reaching the depth against the share of
  request-rounds that did, one line per budget, one panel per temperature.

* with ``--training METADATA`` (the pair's ``metadata.json``), ``OUT_DIR/pair_training.png``: the target's and
  the drafter's training and held-out losses against the step, and the drafter's held-out depth-1 accuracy.

Every figure carries the run's command and commit. Needs matplotlib (exit 2 and a message without it, as
``plot_kimi_round.py``); a file that is not an acceptance report exits 2 too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def _stamp(fig, rep: dict) -> None:
    s = rep["settings"]
    fig.text(0.005, 0.005, f"{s.get('command', '')}  |  commit {str(s.get('commit', ''))[:12]}  |  {s.get('device')} "
             f"{s.get('dtype')}, {s.get('prompts')} prompts x {s.get('new_tokens')} tokens", fontsize=6, alpha=0.7)


def plot_tau(rep: dict, series: list[dict], out_png: Path, plt) -> None:
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.8), squeeze=False)
    for ax, c, color in zip(axes[0], series, COLORS):
        if c["budgets"]:
            ax.plot(c["budgets"], c["tau"], "o-", color=color, label="KDTREE, pinned budget")
            for b, t in zip(c["budgets"], c["tau"]):
                ax.annotate(f"{t:.2f}", (b, t), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        if c["dflash"] is not None:
            ax.axhline(c["dflash"], color="tab:orange", linestyle="--", label=f"DFLASH {c['dflash']:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(c["budgets"] or [1])
        ax.set_xticklabels([str(b) for b in c["budgets"]] or ["1"])
        ax.set_xlabel("node budget (verify width - 1)")
        ax.set_ylabel("tau: tokens per round")
        ax.set_title(("greedy" if c["temperature"] == 0 else f"T = {c['temperature']:g}")
                     + ("\n" + c["dflash_note"] if c["dflash_note"] else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _finish(fig, "testbed pair: accept length against the tree budget", rep, out_png, plt)


def _finish(fig, title: str, rep: dict, out_png: Path, plt) -> None:
    """Title, layout, the run's command and commit at the foot, saved and closed."""
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _stamp(fig, rep)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def plot_calibration(rep: dict, cal: dict, out_png: Path, plt) -> None:
    temps = list(cal["depth"]) or [0.0]
    fig, axes = plt.subplots(1, 1 + len(temps), figsize=(5 * (1 + len(temps)), 4.2), squeeze=False)
    cut_ax = axes[0][0]
    top = 1.0
    for (t, pts), color in zip(cal["cuts"].items(), COLORS):
        cut_ax.plot([p for _, p, _ in pts], [r for _, _, r in pts], "o-", color=color,
                    label="greedy" if t == 0 else f"T = {t:g}")
        for b, p, r in pts:
            cut_ax.annotate(str(b), (p, r), textcoords="offset points", xytext=(4, -8), fontsize=7)
        top = max([top] + [max(p, r) for _, p, r in pts])
    cut_ax.plot([1, top], [1, top], color="gray", linestyle=":", label="calibrated")
    cut_ax.set_xlabel("drafter's expected accept length of the cut")
    cut_ax.set_ylabel("realised accept length")
    cut_ax.set_title("per tree cut (labels: budget)", fontsize=9)
    cut_ax.legend(fontsize=7)
    cut_ax.grid(alpha=0.3)
    cmap = plt.get_cmap("viridis")
    for t, depth_ax in zip(temps, axes[0][1:]):
        by_budget = sorted(cal["depth"].get(t, {}).items())
        for i, (b, (pred, real)) in enumerate(by_budget):
            color = cmap(i / max(len(by_budget) - 1, 1))
            depths = range(1, len(pred) + 1)
            depth_ax.plot(depths, real, "o-", color=color, markersize=3, label=f"budget {b}: realised")
            depth_ax.plot(depths, pred, "x--", color=color, markersize=4, label=f"budget {b}: drafter")
        depth_ax.set_xlabel("draft depth d")
        depth_ax.set_ylabel("P(accept reaches depth d)")
        depth_ax.set_title(f"per depth, {'greedy' if t == 0 else f'T = {t:g}'} (o solid: realised, x dashed: "
                           "drafter)", fontsize=9)
        depth_ax.legend(fontsize=6, ncol=2)
        depth_ax.grid(alpha=0.3)
    _finish(fig, "testbed pair: the drafter's predicted vs realised acceptance", rep, out_png, plt)


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


def plot_training(meta: dict, series: dict, out_png: Path, plt) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("target", "drafter")):
        c = series[name]
        for key, style, label in (("train", "-", "training batch"), ("heldout", "o-", "held-out")):
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
            acc.plot(c["step"], c["acc1"], "s--", color="tab:green", label="held-out depth-1 accuracy")
            acc.set_ylabel("depth-1 accuracy")
            acc.legend(fontsize=8, loc="center right")
        ax.legend(fontsize=8, loc="upper center")
    fig.suptitle("testbed pair: training curves")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.text(0.005, 0.005, f"python -m testbed.build_pair ({meta.get('preset')}, seed {meta.get('seed')}, "
             f"{meta.get('device')})  |  commit {str(meta.get('commit'))[:12]}", fontsize=6, color="0.35")
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="testbed.acceptance's acceptance.json")
    p.add_argument("out", type=Path, help="folder for acceptance_tau.png and acceptance_calibration.png")
    p.add_argument("--training", default=None, metavar="METADATA", help="the pair's metadata.json: pair_training.png")
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
    plot_tau(rep, series, args.out / "acceptance_tau.png", plt)
    plot_calibration(rep, cal, args.out / "acceptance_calibration.png", plt)
    print(f"plot_acceptance: wrote {args.out / 'acceptance_tau.png'} and {args.out / 'acceptance_calibration.png'}")
    if training:
        plot_training(meta, training, args.out / "pair_training.png", plt)
        print(f"plot_acceptance: wrote {args.out / 'pair_training.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
