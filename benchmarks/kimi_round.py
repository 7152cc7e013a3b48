"""A measured model of one Kimi K2.6 decode round at TP 8, per GPU: AR vs DFLASH (chain) vs KDTREE (DDTree) at
fixed node budgets and at the verify width the server would choose (KDTREE-auto).

    python -m benchmarks.kimi_round [--batches 1 8 32 64] [--contexts 4096 16384] [--budgets 15 31 47 63]
        [--tau-curve B=TAU ... | --tau-curve-json FILE | --accept-kdtree TAU] [--tau-anchor-budget 64]
        [--accept-dflash TAU] [--deadline 240] [--json OUT] [--from-json IN] [--bookkeeping-us [BS=]TREE,ACCEPT ...]
        [--box h200 | rtx-pro-6000 | rtx-pro-6000-pcie-ipc] [--price-rule excess | ratio] [--served-rank RANK_JSON ...]
    python -m sglang_kdtree bench --kimi-round [same options]
    python -m benchmarks.plot_kimi_round OUT.json OUT.png

Every piece of the round is timed on the GPU at Kimi K2.6's per-GPU shapes (``kimi_measure.py`` says how) at token
counts T = batch x verify width (AR 1, DFLASH the drafter block 16, KDTREE-B B + 1), then the round is assembled
by plain arithmetic (``kimi_model.py``: rows, the accept-length curve, the auto choice, the summary, the target
checks; CPU-tested in tests/test_kimi_round.py). ``--from-json`` re-assembles a saved measurement without a GPU
(on the saved run's batches, contexts and budgets unless given; pieces it lacks show as missing).

Tokens per round: AR 1; DFLASH ``--accept-dflash`` (default 5.19, the DDTree paper's DFlash mean for its MoE target
Qwen3-Coder-30B-A3B at T = 0); KDTREE-B tau(B), interpolated linearly in log2(budget) between the curve's points and
extrapolated with the end segments' slopes (never below 1). Default curve: the DDTree paper's published sweep
(Qwen3-8B, MATH-500, T = 0, read off its Fig. 3: budgets 16/32/64/128/256/512/1024 -> tau
8.6/9.3/9.75/10.2/10.4/10.7/11.0; DFlash on the same setup 7.79) scaled so that tau(``--tau-anchor-budget``,
default 64) equals the paper's mean 7.51 (``PAPER_ACCEPT_KDTREE``: its MoE target, mean over 10 datasets, each at its
best budget, so at 64 an optimistic figure). Not Kimi K2.6's numbers: pass a measured curve instead with
``--tau-curve 16=8.6 32=9.3 ...`` or ``--tau-curve-json FILE`` (``{"budgets": [...], "tau": [...]}`` or
``{"curve": {"15": 6.1, ...}}``, optionally ``"dflash": TAU``; ``python -m testbed.acceptance`` writes its served
greedy curve and DFLASH's tau so, in its ``acceptance.json``).

KDTREE-auto: the tree is built at the largest budget (its bookkeeping is that budget's) and verified at the width w
maximising tau(w - 1) / round(w) among the fixed rows' widths, by ``sglang_kdtree.round.widths.best_width``, the server's
rule. ASSUMPTION: the bookkeeping is measured at the largest budget and used for every KDTREE row (~0.2 % of the
round). The report ends with a summary per (context, batch) and one check line per target: auto within 2 % of the
best fixed budget in every cell, auto >= 1.15x DFLASH per request at batch 1 and >= 1.10x at batch 32, auto never
below DFLASH (PASS / FAIL printed; the exit code does not depend on them).

``--box`` (default ``h200``, the box the pieces are measured on): another box's round as an ESTIMATE, the H200
pieces repriced at its bandwidth and bf16 rate by ``--price-rule`` and its collectives from published measurements
(``kimi_box.py`` says how); the report and the JSON's ``estimate`` record say so and list every assumption.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
from pathlib import Path

from benchmarks import kimi_box, kimi_model, kimi_served  # tests reach the arithmetic as kimi_round.kimi_model
from benchmarks.kimi_measure import DeadlineExceeded, _oneline, measure
from benchmarks.kimi_model import (AUTO, DEFAULT_ANCHOR_BUDGET, DEFAULT_BUDGETS, PAPER_ACCEPT_DFLASH,
                                   PAPER_CURVE_SOURCE, PAPER_SWEEP, PAPER_SWEEP_DFLASH, VERIFY_PIECES, DrafterShape,
                                   Network, RoundConfig, TauCurve, assemble, check_targets, key, load_tau_curve_json,
                                   moonshot_verdict, needed_tokens, paper_curve, parse_tau_curve, summarize)
from sglang_kdtree.state import MAX_BUDGET

REPO = Path(__file__).resolve().parents[1]  # the checkout, where the device carries sit (default_marlin_seed)

# ---- inputs ----------------------------------------------------------------------------------------------------


def parse_bookkeeping(entries) -> dict:
    """``--bookkeeping-us`` entries ``BS=TREE,ACCEPT`` (or ``TREE,ACCEPT`` for every batch) -> ``{bs or None:
    (tree_us, accept_commit_us)}``; ValueError on a malformed entry."""
    out = {}
    for entry in entries or ():
        bs, _, vals = entry.rpartition("=")
        try:
            tree, accept = (float(v) for v in vals.split(","))
            b = int(bs) if bs else None
        except ValueError:
            raise ValueError(f"--bookkeeping-us {entry!r}: expected BS=TREE_US,ACCEPT_US or TREE_US,ACCEPT_US")
        if tree < 0 or accept < 0 or (b is not None and b < 1):
            raise ValueError(f"--bookkeeping-us {entry!r}: times must be >= 0 and the batch >= 1")
        out[b] = (tree, accept)
    return out


def apply_bookkeeping(times: dict, overrides: dict, batches) -> list[int]:
    """Write overridden tree / accept+commit times into ``times``; returns the batches overridden."""
    done = []
    for bs in batches:
        pick = overrides.get(bs, overrides.get(None))
        if pick is not None:
            times[key("tree", bs=bs)], times[key("accept_commit", bs=bs)] = pick
            done.append(bs)
    return done


def curve_of(args) -> tuple[TauCurve, float]:
    """The KDTREE curve and DFLASH's tokens per round the options ask for; ValueError naming the option."""
    dflash = args.accept_dflash
    given = args.tau_curve or args.tau_curve_json or args.accept_kdtree is not None
    if given and args.tau_anchor_budget != DEFAULT_ANCHOR_BUDGET:
        raise ValueError("--tau-anchor-budget scales the default (paper) curve only; a --tau-curve, --tau-curve-json "
                         "or --accept-kdtree curve is used as given: drop one of them")
    if args.tau_curve:
        curve = parse_tau_curve(args.tau_curve)
    elif args.tau_curve_json:
        curve, from_file = load_tau_curve_json(args.tau_curve_json)
        dflash = from_file if dflash is None else dflash
    elif args.accept_kdtree is not None:
        curve = TauCurve(((1, args.accept_kdtree),), source="--accept-kdtree (the same tau at every budget)")
    elif args.tau_anchor_budget < 1:
        raise ValueError(f"--tau-anchor-budget {args.tau_anchor_budget}: a node budget must be >= 1")
    else:
        curve = paper_curve(args.tau_anchor_budget)
    if dflash is not None and not (math.isfinite(dflash) and dflash >= 1):
        raise ValueError(f"--accept-dflash {dflash}: tokens per round must be a number >= 1")
    return curve, PAPER_ACCEPT_DFLASH if dflash is None else dflash


# ---- report ----------------------------------------------------------------------------------------------------


def _f(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


TABLE_COLUMNS = ("ctx", "bs", "mode", "width", "draft", "tree", "attn", "MoE", "other", "all-reduce",
                 "accept+commit", "round us", "tok/round", "tok/s/req", "tok/s batch", "bookkeeping")


def format_table(rows: list[dict]) -> str:
    """The round split (us), tokens/s per request and batch, bookkeeping share. Rows with missing pieces: ``*`` on
    the round (a lower bound) and ``<=`` on tokens/s and the share."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in rows:
        le = "<= " if r["missing"] else ""
        share = "-" if not r["mode"].startswith("KDTREE") else \
            "n/a" if r["share"] is None else f"{le}{100 * r['share']:.2f} %"
        width = "n/a" if r["mode"] == AUTO and r["chose"] is None else str(r["width"])
        cells = [str(r["ctx"]), str(r["bs"]), r["mode"], width, _f(r["draft"]), _f(r["tree"]),
                 _f(r["attention"]), _f(r["moe"]), _f(r["other"]), _f(r["allreduce"]), _f(r["accept_commit"]),
                 _f(r["round"]) + ("*" if le else ""), f"{r['tokens']:.2f}", le + _f(r["tok_s"]),
                 le + _f(r["tok_s_batch"]), share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_summary(summary: list[dict], cfg: RoundConfig) -> str:
    """Tokens/s per request by mode per (context, batch), auto's width and its ratios; ``*``: the cell lacks
    pieces (its figures are bounds)."""
    modes = ("AR", "DFLASH", *cfg.kdtree_modes, AUTO)
    cols = ("ctx", "bs", *modes, "auto width", "auto / DFLASH", "auto / best fixed")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in summary:
        cells = [str(c["ctx"]), str(c["bs"]) + ("*" if c["partial"] else "")]
        cells += [_f(c["tok_s"].get(m)) for m in modes]
        cells += [str(c["auto_width"] or "n/a"), _x(c["auto_vs_dflash"]), _x(c["auto_vs_best_fixed"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def assumptions_text(cfg: RoundConfig, moe_path: str | None) -> list[str]:
    m, d, n = cfg.model, cfg.drafter, cfg.net
    taus = ", ".join(f"tau({b}) = {cfg.curve.tau(b):.2f}" for b in cfg.budgets)
    collectives = kimi_box.collectives_text(n, m, d) if isinstance(n, kimi_box.TableNetwork) else (
        f"collectives (MODEL): ring all-reduce 2(n-1)/n x bytes / {n.gbps:g} GB/s + {n.latency_us:g} us per call, "
        f"{2 * m.layers + 1} per target forward and {2 * d.layers + 1} per draft forward of T x {m.hidden} bf16; "
        + (f"logits all-gather (n-1)/n x T x {m.vocab} x 2 B / bw + latency" if n.gather_logits
           else "no logits all-gather (--no-logits-gather)"))
    out = [
        f"target: Kimi K2.6 per GPU at TP {m.tp}: {m.layers} layers ({m.dense_layers} dense, {m.moe_layers} MoE), "
        f"hidden {m.hidden}, MLA {m.heads_gpu} heads/GPU (q_lora {m.q_lora}, kv_lora {m.kv_lora}, qk {m.qk_nope}+"
        f"{m.qk_rope}, v {m.v_head}), {m.experts} experts top {m.top_k} at intermediate {m.moe_inter_gpu}/GPU "
        f"(INT4 W4A16 g32), shared expert {m.shared_inter_gpu}/GPU bf16, dense intermediate {m.dense_inter_gpu}/GPU, "
        f"lm_head {m.vocab_gpu} of {m.vocab} columns",
        f"routed MoE path: {moe_path or 'not measured'}; routings uniform random (real routing is skewed)",
        f"drafter (ASSUMED): {d.layers} dense layers at hidden {m.hidden}, {d.heads} q / {d.kv_heads} kv heads x "
        f"{d.head_dim}, intermediate {m.dense_inter}, block {d.block} attending the whole context; head = lm_head "
        f"slice over batch x {d.block - 1} rows (part of the draft)",
        collectives,
        f"tokens/round: AR 1; DFLASH {cfg.accept_dflash:g}"
        + (" (DDTree paper: DFlash mean, Qwen3-Coder-30B-A3B, T=0, 10 datasets)"
           if cfg.accept_dflash == PAPER_ACCEPT_DFLASH else "")
        + f"; KDTREE-B tau(B) from {cfg.curve.source}; linear in log2(budget) between its points, the end slopes "
        f"beyond, >= 1: {taus}",
    ]
    if cfg.curve.source.startswith(PAPER_CURVE_SOURCE):
        low_b, low_tau = PAPER_SWEEP[0]
        out.append(f"the default curve's shape is one dense model on one dataset (there DFlash reaches "
                   f"{PAPER_SWEEP_DFLASH}, {PAPER_SWEEP_DFLASH / low_tau:.2f}x DDTree's tau at budget {low_b}), its "
                   "level the MoE target's mean at each dataset's best budget (optimistic at 64); neither is Kimi "
                   "K2.6's: pass a measured curve with --tau-curve or --tau-curve-json")
    out += [f"bookkeeping (tree + accept+commit) measured per batch at the largest budget, {cfg.bookkeeping_budget}, "
            "and used for every KDTREE row (ASSUMPTION: ~0.2 % of the round); KDTREE-auto builds its tree there and "
            f"verifies the width w of {', '.join(str(b + 1) for b in cfg.budgets)} maximising tau(w-1) / round(w) "
            "(sglang_kdtree.round.widths.best_width, the server's rule; ties: the smaller)",
            "AR / DFLASH carry no bookkeeping; RoPE, residual adds, final norm, sampling, host time and overlap are "
            "not modelled; the round is the sum of its pieces"]
    return out


def report(measured: dict, cfg: RoundConfig, batches, contexts, out=None) -> dict:
    """Print the report (the summary table and the check lines last) and return ``{"rows", "moonshot", "summary",
    "checks"}``."""
    out = out or sys.stdout
    times = measured.get("times", {})
    rows = assemble(times, cfg, batches, contexts)
    state, line = moonshot_verdict(rows)
    summary = summarize(rows, cfg)
    checks = check_targets(summary)

    def say(s=""):
        print(s, file=out)

    say(f"\n# Kimi K2.6 decode round at TP {cfg.model.tp} (per GPU), budgets {', '.join(map(str, cfg.budgets))}, "
        f"block {cfg.drafter.block}; device: {measured.get('device', '?')}")
    if measured.get("elapsed_s") is not None:
        say(f"measurement: {measured['elapsed_s']:.1f} s of a {measured.get('deadline_s', '?')} s deadline")
    for note in measured.get("notes", []):
        say(f"note: {note}")
    eager = sorted(k for k, v in measured.get("modes", {}).items() if v != "graph")
    if eager:
        say(f"timed without a CUDA graph ({len(eager)}): " + ", ".join(eager[:12])
            + (" ..." if len(eager) > 12 else ""))
    for name, err in measured.get("errors", {}).items():
        say(f"FAILED {name}: {err}")
    if measured.get("skipped"):
        sk = measured["skipped"]
        say(f"SKIPPED ({len(sk)}, deadline or SIGTERM): " + ", ".join(sk[:16]) + (" ..." if len(sk) > 16 else ""))
    say("\nassumptions:")
    for a in assumptions_text(cfg, measured.get("moe_path")):
        say(f"- {a}")
    say("\npieces (us per call, one GPU; blank = not needed at that T, or not measured):")
    tokens = needed_tokens(batches, cfg)
    names = [*VERIFY_PIECES, "moe", "draft_qkv", "draft_o"]
    say("| T | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
    for T in sorted(set(tokens["verify"]) | set(tokens["draft"]) | set(tokens["head"])):
        say(f"| {T} | " + " | ".join("" if times.get(key(n, T=T)) is None else _f(times[key(n, T=T)]) for n in names)
            + " |")
    other = sorted((k, v) for k, v in times.items() if k.startswith(("attention[", "draft_attention[", "tree[",
                                                                       "accept_commit[")))
    if other:
        say("\n" + "; ".join(f"{k} {_f(v)}" for k, v in other))
    missing = sorted({k for r in rows for k in r["missing"]})
    if missing:
        say("\nmissing pieces (counted as 0 us; rows marked *): " + ", ".join(missing))
    say("\n" + line)
    say("\nround split per GPU (us; attn/MoE/other/all-reduce = the verify forward; tok/s = tokens per round / "
        "round time):\n")
    say(format_table(rows))
    say("\nsummary: tokens/s per request (auto width: the verify width KDTREE-auto chose):\n")
    say(format_summary(summary, cfg))
    say("")
    for c in checks:
        say(c["line"])
    return {"rows": rows, "moonshot": {"state": state, "line": line}, "summary": summary, "checks": checks}


# ---- CLI -------------------------------------------------------------------------------------------------------


def gpu_reason() -> str | None:
    """None when torch sees a CUDA device, else why not."""
    try:
        import torch
    except Exception as exc:
        return f"torch does not import: {exc}"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def default_marlin_seed():
    for cand in (REPO / ".dev-carry" / "jit", REPO / ".jitcache" / "sm90a"):
        if cand.is_dir():
            return cand
    return None


def parser(prog: str = "python -m benchmarks.kimi_round") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64], help="batch sizes (requests per round)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384], help="context lengths (tokens)")
    p.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS),
                   help="fixed KDTREE node budgets, a row each (verify width budget+1); KDTREE-auto builds its tree at "
                        "the largest, where the bookkeeping is measured")
    p.add_argument("--block", type=int, default=16, help="drafter block (DFLASH verify width; draft depth block-1)")
    p.add_argument("--draft-layers", type=int, default=5, help="drafter layers (ASSUMPTION)")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds of GPU measurement; later pieces skipped")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="NVLink bandwidth per direction, GB/s (model)")
    p.add_argument("--allreduce-latency-us", type=float, default=10.0, help="latency per collective call, us")
    p.add_argument("--logits-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="count the all-gather of the vocab-parallel logits")
    p.add_argument("--accept-dflash", type=float, default=None, metavar="TAU",
                   help=f"DFLASH tokens per round; unset: the --tau-curve-json file's \"dflash\", else "
                        f"{PAPER_ACCEPT_DFLASH} (DDTree paper: DFlash mean, Qwen3-Coder-30B-A3B, T=0)")
    curve = p.add_mutually_exclusive_group()
    curve.add_argument("--tau-curve", nargs="+", default=None, metavar="B=TAU",
                       help="KDTREE tokens per round at node budgets B (e.g. 16=8.6 32=9.3), linear in log2(budget) "
                            "between them, end slopes beyond; unset: the DDTree paper's sweep, scaled (see "
                            "--tau-anchor-budget)")
    curve.add_argument("--tau-curve-json", default=None, metavar="FILE",
                       help='the curve from a file: {"budgets": [...], "tau": [...]} or {"curve": {"15": 6.1, ...}}, '
                            'optionally with "dflash": TAU; testbed.acceptance\'s acceptance.json is one (greedy)')
    curve.add_argument("--accept-kdtree", type=float, default=None, metavar="TAU",
                       help="one KDTREE tau at every budget (a constant curve)")
    p.add_argument("--tau-anchor-budget", type=int, default=DEFAULT_ANCHOR_BUDGET,
                   help="the default curve (DDTree paper, Qwen3-8B, MATH-500, T=0, its Fig. 3) is scaled so that tau "
                        "at this budget is the paper's mean 7.51; a given curve is used as is")
    p.add_argument("--bookkeeping-us", nargs="+", default=None, metavar="[BS=]TREE,ACCEPT",
                   help="tree and accept+commit device us instead of measuring them with round_parts.parts()")
    p.add_argument("--served-rank", nargs="+", default=None, metavar="RANK_JSON",
                   help="take the drafter and the bookkeeping from a served rank's report (bench_rank.py's rank.json; "
                        "the first with a cycle server; benchmarks/kimi_served.py says why), and --served-forward's "
                        "target forwards from them all, priced for the measured device by bandwidth")
    p.add_argument("--served-forward", nargs="*", default=None, choices=list(kimi_served.FORWARD_MODES),
                   help="with --served-rank: the modes whose target forward comes from the served ranks, KDTREE's "
                        "from those served under --served-profile (default: none on the h200 box, whose SGLang "
                        "default is fa3, which the ranks did not serve; AR DFLASH on the sm_120 boxes, whose default "
                        "is the Triton backend the ranks ran)")
    p.add_argument("--served-profile", default=None, choices=["sm_120"],
                   help="the KDTREE_DEVICE_PROFILE of the ranks whose KDTREE verify --served-forward KDTREE takes "
                        "(default: the ranks served without one)")
    p.add_argument("--marlin-seed", default=None,
                   help="prebuilt Marlin JIT modules to seed SGLang's cache from (default: .dev-carry/jit or "
                        ".jitcache/sm90a when present)")
    p.add_argument("--marlin-prep-s", type=float, default=45.0,
                   help="seconds the Marlin seed/load/repack may take before the bf16 fallback is timed instead")
    p.add_argument("--allow-marlin-compile", action="store_true",
                   help="let an uncached Marlin JIT compile run (~6 min; over the default deadline)")
    p.add_argument("--box", default=kimi_box.REFERENCE, choices=list(kimi_box.BOXES),
                   help="the box to report: h200 as measured, or an ESTIMATE for another box from the H200 pieces "
                        "repriced at its bandwidth and bf16 rate and its published collective times "
                        "(benchmarks/kimi_box.py)")
    p.add_argument("--price-rule", default=kimi_box.DEFAULT_RULE, choices=list(kimi_box.RULES),
                   help="how a piece's H200 time becomes another box's, R the piece's roofline: " + "; ".join(
                       f"{r}: {f}" for r, f in kimi_box.RULES.items()))
    p.add_argument("--json", default=None, help="write the measurement, the rows, the summary and the checks here")
    p.add_argument("--from-json", default=None,
                   help="re-assemble a saved --json measurement (no GPU needed; its batches, contexts and budgets "
                        "unless given)")
    return p


def _given(p: argparse.ArgumentParser, argv) -> set:
    """The options given on the command line (not defaulted), by dest."""
    for action in p._actions:  # not set_defaults: that would fill the namespace with the marker
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _saved_grid(args, saved: dict, given: set) -> None:
    """A --from-json run's batches, contexts and budgets (or its single ``budget``) where not given."""
    grid = {"batches": saved.get("batches"), "contexts": saved.get("contexts"),
            "budgets": saved.get("budgets") or ([saved["budget"]] if isinstance(saved.get("budget"), int) else None)}
    for name, value in grid.items():
        if name not in given and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            setattr(args, name, value)


def main(argv=None, prog: str = "python -m benchmarks.kimi_round") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(prog)
    args = p.parse_args(argv)
    measured = None
    if args.from_json:
        try:
            with open(args.from_json) as f:
                data = json.load(f)
            measured = data.get("measured", data)
        except (OSError, ValueError, AttributeError) as exc:
            p.error(f"--from-json {args.from_json}: cannot read a saved measurement ({exc})")
        _saved_grid(args, data.get("args") or {}, _given(parser(prog), argv))
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.block < 2 or args.draft_layers < 0:
        p.error("--batches and --contexts must be >= 1, --block >= 2, --draft-layers >= 0")
    bad = [b for b in args.budgets if not 1 <= b <= MAX_BUDGET]
    if bad:
        p.error(f"--budgets: {bad[0]} is outside [1, {MAX_BUDGET}] (a node budget; the verify width is budget + 1)")
    if args.nvlink_gbps <= 0 or args.allreduce_latency_us < 0 or args.deadline <= 0:
        p.error("--nvlink-gbps and --deadline must be > 0, --allreduce-latency-us >= 0")
    given = _given(parser(prog), argv)
    if args.box == kimi_box.REFERENCE and "price_rule" in given:
        p.error(f"--price-rule prices the {kimi_box.REFERENCE} pieces for another box: add --box, e.g. "
                "--box rtx-pro-6000")
    net_options = {"nvlink_gbps", "allreduce_latency_us"} & given
    if isinstance(kimi_box.BOXES[args.box].net, kimi_box.TableNetwork) and net_options:
        p.error(f"--box {args.box} prices its collectives from measured NCCL / IPC times; drop "
                + " and ".join("--" + o.replace("_", "-") for o in sorted(net_options)))
    try:
        overrides = parse_bookkeeping(args.bookkeeping_us)
        curve, accept_dflash = curve_of(args)
    except ValueError as exc:
        p.error(str(exc))
    batches, contexts = list(dict.fromkeys(args.batches)), list(dict.fromkeys(args.contexts))
    cfg = RoundConfig(drafter=DrafterShape(layers=args.draft_layers, block=args.block),
                      net=Network(gbps=args.nvlink_gbps, latency_us=args.allreduce_latency_us,
                                  gather_logits=args.logits_gather),
                      budgets=tuple(args.budgets), accept_dflash=accept_dflash, curve=curve)
    if measured is not None:
        return _finish(args, cfg, measured, overrides, batches, contexts)
    reason = gpu_reason()
    if reason is not None:
        print(f"kimi_round: measuring the pieces needs a CUDA GPU ({reason}). Re-assemble a saved run without one: "
              f"--from-json OUT.json (from a GPU run's --json).", file=sys.stderr)
        return 2
    seed = Path(args.marlin_seed) if args.marlin_seed else default_marlin_seed()

    def stop(signum, frame):  # `timeout` sends SIGTERM: the pieces measured so far are still reported
        raise DeadlineExceeded("SIGTERM")

    old_term = _set_sigterm(stop)
    try:
        try:
            measured = measure(cfg, batches, contexts, args.deadline,
                               skip_bookkeeping=[bs for bs in batches if bs in overrides or None in overrides],
                               allow_marlin_compile=args.allow_marlin_compile, marlin_seed=seed,
                               marlin_prep_s=args.marlin_prep_s)
        finally:
            _set_sigterm(signal.SIG_IGN)  # measuring is over: a late SIGTERM must not cut the report short
        return _finish(args, cfg, measured, overrides, batches, contexts)
    finally:
        _set_sigterm(old_term)


def _set_sigterm(handler):
    """Install ``handler`` for SIGTERM; returns the previous one (None where signals cannot be set here)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _finish(args, cfg, measured, overrides, batches, contexts) -> int:
    """Overrides, report, JSON. The measurement is saved before the report and printed raw should the report itself
    fail, so one GPU run is never lost."""
    measured = dict(measured)
    measured["times"] = dict(measured.get("times", {}))
    measured["notes"] = list(measured.get("notes", []))
    if args.served_rank:
        forward = args.served_forward if args.served_forward is not None else (
            [] if args.box == kimi_box.REFERENCE else ["AR", "DFLASH"])
        served, notes = kimi_served.load(args.served_rank, measured.get("device") or "H200", batches,
                                         measured["times"], cfg, forward, args.served_profile)
        measured["times"].update(served)
        measured["notes"] += notes
    done = apply_bookkeeping(measured["times"], overrides, batches)
    if done:
        measured["notes"].append(f"bookkeeping from --bookkeeping-us at batch {done}")
    payload = {"args": vars(args), "config": dataclasses.asdict(cfg), "measured": measured}

    def save():
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(payload, f, indent=1, default=str)
            except Exception as exc:
                print(f"kimi_round: could not write {args.json}: {exc}", file=sys.stderr)

    save()
    report_measured, est = measured, None
    if args.box != kimi_box.REFERENCE:  # the H200 measurement stays in "measured"; the priced pieces in "estimate"
        try:
            report_measured, cfg, est = kimi_box.estimate(measured, cfg, args.box, args.price_rule)
        except ValueError as exc:
            print(f"kimi_round: {exc}", file=sys.stderr)
            return 2
        est["kv"] = kimi_box.kv_fit(batches, contexts, cfg.model, kimi_box.BOXES[args.box])
        payload.update(config=dataclasses.asdict(cfg), estimate=est)
    try:
        if est is not None:
            print(f"# {est['label']}: {est['box_label']}")
        result = report(report_measured, cfg, batches, contexts)
        if est is not None:
            est["published"] = kimi_box.published_block(result["rows"])
            print(kimi_box.format_estimate(est))
    except Exception as exc:
        import traceback

        traceback.print_exc()
        print(f"kimi_round: the report failed ({_oneline(exc)}); the measured pieces (us):")
        for k, v in sorted(measured["times"].items()):
            print(f"{k} {v:.2f}")
        return 1
    payload.update(result)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
