"""The arithmetic of the Kimi K2.6 decode-round model (TP 8, per GPU): shapes, the accept-length curve, the round
assembled from measured piece times, the automatic width choice, the summary and the target checks. Pure functions
over plain dicts (us by ``key``); ``kimi_measure.py`` times the pieces on a GPU, ``kimi_round.py`` reports.
Target shape: ``ModelShape``'s defaults (Kimi K2.6 = DeepSeek-V3 architecture, per its public configs).

Rows per (context, batch), each round = draft + tree + verify forward + accept+commit (a plain sum, no overlap):
AR (verify width 1, no draft), DFLASH (width = drafter block 16), ``KDTREE-B`` for each fixed node budget B of
``budgets`` (width B + 1; default 15/31/47/63: widths 16/32/48/64, tile-aligned) and ``KDTREE-auto``: the tree is
built at the largest budget and the target verifies its first w rows, w maximising tau(w - 1) / round(w) over the
fixed widths, chosen by the server's own rule ``sglang_kdtree.round.widths.best_width`` (the first n nodes of a best-first
tree are the budget-n tree, so a cut tree accepts as that budget's would).

Tokens per round: AR 1; DFLASH ``accept_dflash`` (default 5.19); KDTREE-B tau(B) from a ``TauCurve``, linear in
log2(budget) between its points, the end segments' slopes beyond them, never below 1. Default curve: the DDTree
paper's published budget sweep (Ringel & Romano, arXiv 2604.12989, Fig. 3: Qwen3-8B, MATH-500, T = 0, budgets
16/32/64/128/256/512/1024 -> tau 8.6/9.3/9.75/10.2/10.4/10.7/11.0, read off the figure; DFlash on the same setup
7.79) scaled by one factor so that tau(anchor budget, default 64) equals ``PAPER_ACCEPT_KDTREE`` = 7.51, the paper's
mean tau for its MoE target (Qwen3-Coder-30B-A3B, T = 0, mean over 10 datasets, each at its best budget from
{16, ..., 1024}, so anchoring it at 64 is optimistic). DFLASH's 5.19 is the same table's DFlash mean. Neither is
Kimi K2.6's: a measured curve replaces them (``kimi_round.py --tau-curve`` / ``--tau-curve-json``).

ASSUMPTION: the bookkeeping (tree + accept+commit) is one figure per batch for every KDTREE row; AR and DFLASH
carry none. A served rank corrects pieces (``kimi_served.py``): ``draft_excess`` adds to the drafter's forward,
``forward_excess:MODE`` to a mode's target attention. Collectives: ring all-reduce
``2 (n-1)/n x bytes / bw + latency`` (2 per layer + 1, of T x 7168 bf16), an all-gather of the T x 163,840 logits.

Moonshot line: bookkeeping < 3 % of the projected KDTREE round at batch 32, budget 63 (verify width 64).
Targets (check lines, PASS / FAIL, not an exit code): auto within 2 % of the best fixed budget in every cell; auto
>= 1.15x DFLASH per request at batch 1 and >= 1.10x at batch 32; auto never below DFLASH.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

from sglang_kdtree.round.widths import best_width

# ---- shapes -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The target's shape (defaults: Kimi K2.6) and its tensor-parallel degree."""

    layers: int = 61
    dense_layers: int = 1
    hidden: int = 7168
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    experts: int = 384
    top_k: int = 8
    moe_inter: int = 2048
    shared_inter: int = 2048
    dense_inter: int = 18432
    vocab: int = 163_840
    tp: int = 8

    moe_layers = property(lambda self: self.layers - self.dense_layers)
    heads_gpu = property(lambda self: self.heads // self.tp)
    moe_inter_gpu = property(lambda self: self.moe_inter // self.tp)
    shared_inter_gpu = property(lambda self: self.shared_inter // self.tp)
    dense_inter_gpu = property(lambda self: self.dense_inter // self.tp)
    vocab_gpu = property(lambda self: self.vocab // self.tp)


@dataclasses.dataclass(frozen=True)
class DrafterShape:
    """The DFlash drafter (ASSUMED shape): dense layers at the target's hidden width and dense intermediate."""

    layers: int = 5
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    block: int = 16


@dataclasses.dataclass(frozen=True)
class Network:
    """Collective model: ring all-reduce / all-gather over ``tp`` GPUs at ``gbps`` GB/s per direction."""

    gbps: float = 450.0
    latency_us: float = 10.0
    gather_logits: bool = True
    act_bytes: int = 2  # bf16 activations and logits

    def collective_us(self, nbytes: float, n_gpus: int, gather: bool = False) -> float:
        """One all-reduce of ``nbytes`` (``gather``: an all-gather with result ``nbytes``), us; kimi_box overrides."""
        return (allgather_us if gather else allreduce_us)(nbytes, n_gpus, self.gbps, self.latency_us)


KIMI = ModelShape()

# ---- accepted tokens per round -------------------------------------------------------------------------------

#: The DDTree paper's mean acceptance length tau, Qwen3-Coder-30B-A3B-Instruct, temperature 0: dataset -> (DFlash,
#: DFlash + DDTree at its best budget). Source: github.com/liranringel/ddtree, src/data/results.tex.
PAPER_TAU = {
    "MATH-500": (5.58, 8.10), "GSM8K": (5.18, 7.55), "AIME 2024": (5.16, 7.87), "AIME 2025": (5.13, 7.63),
    "HumanEval": (8.02, 10.72), "MBPP": (7.19, 9.94), "LiveCodeBench": (6.32, 8.63), "SWE-bench Lite": (3.61, 5.71),
    "MT-Bench": (3.52, 5.36), "Alpaca": (2.22, 3.55),
}
PAPER_ACCEPT_DFLASH = round(statistics.mean(v[0] for v in PAPER_TAU.values()), 2)
PAPER_ACCEPT_KDTREE = round(statistics.mean(v[1] for v in PAPER_TAU.values()), 2)
#: The paper's budget sweep read off its Fig. 3 (Qwen3-8B, MATH-500, T = 0): node budget -> tau; and DFlash's tau
#: on that setup. Only its shape is used: ``paper_curve`` scales it to the MoE target's mean.
PAPER_SWEEP = ((16, 8.6), (32, 9.3), (64, 9.75), (128, 10.2), (256, 10.4), (512, 10.7), (1024, 11.0))
PAPER_SWEEP_DFLASH = 7.79
DEFAULT_ANCHOR_BUDGET, DEFAULT_BUDGETS = 64, (15, 31, 47, 63)
CURVE_FIX = "e.g. --tau-curve 16=8.6 32=9.3 64=9.75"
PAPER_CURVE_SOURCE = "the DDTree paper's budget sweep"


@dataclasses.dataclass(frozen=True)
class TauCurve:
    """Mean accepted tokens per round (the bonus token included) against the node budget: ``points`` are
    ``(budget, tau)``; ``tau(b)`` is linear in log2(b) between them, follows the end segments' slopes beyond them and
    is never below 1; one point is a constant. ``source`` says where the points come from (and prefixes errors)."""

    points: tuple
    source: str = "tau curve"

    def __post_init__(self):
        if not self.points:
            raise ValueError(f"{self.source}: a tau curve needs at least one BUDGET=TAU point; {CURVE_FIX}")
        for b, t in self.points:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"{self.source}: budget {b!r} is not an integer >= 1; {CURVE_FIX}")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 1:
                raise ValueError(f"{self.source}: tau {t!r} at budget {b} is not a number >= 1 (tokens per round, "
                                 f"the bonus token included); {CURVE_FIX}")
        budgets = [b for b, _ in self.points]
        if len(set(budgets)) != len(budgets):
            raise ValueError(f"{self.source}: budget {max(budgets, key=budgets.count)} appears twice; {CURVE_FIX}")
        object.__setattr__(self, "points", tuple(sorted((b, float(t)) for b, t in self.points)))

    def tau(self, budget: float) -> float:
        """tau at ``budget`` (>= 1)."""
        if not budget >= 1:
            raise ValueError(f"tau is defined for budgets >= 1, not {budget!r}")
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        x, i = math.log2(budget), 1
        while i < len(pts) - 1 and math.log2(pts[i][0]) < x:  # the segment holding x, or an end segment
            i += 1
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        x0, x1 = math.log2(b0), math.log2(b1)
        return max(1.0, t0 + (t1 - t0) * (x - x0) / (x1 - x0))


def paper_curve(anchor_budget: int = DEFAULT_ANCHOR_BUDGET) -> TauCurve:
    """``PAPER_SWEEP`` times the one factor that makes tau(``anchor_budget``) equal ``PAPER_ACCEPT_KDTREE``."""
    factor = PAPER_ACCEPT_KDTREE / TauCurve(PAPER_SWEEP).tau(anchor_budget)
    return TauCurve(tuple((b, t * factor) for b, t in PAPER_SWEEP),
                    source=f"{PAPER_CURVE_SOURCE} (Qwen3-8B, MATH-500, T=0, its Fig. 3) x {factor:.4f}, "
                           f"so that tau({anchor_budget}) = {PAPER_ACCEPT_KDTREE}, the paper's mean for its MoE target")


def parse_tau_curve(entries) -> TauCurve:
    """``--tau-curve`` entries ``BUDGET=TAU`` -> ``TauCurve``; ValueError naming the entry."""
    points = []
    for entry in entries:
        budget, sep, tau = entry.partition("=")
        try:
            if not sep:
                raise ValueError(entry)
            points.append((int(budget), float(tau)))
        except ValueError:
            raise ValueError(f"--tau-curve {entry!r}: expected BUDGET=TAU (an integer node budget, a number of "
                             f"tokens per round); {CURVE_FIX}") from None
    return TauCurve(tuple(points), source="--tau-curve")


def curve_from_json(data, source: str) -> tuple[TauCurve, float | None]:
    """``{"budgets": [...], "tau": [...]}`` or ``{"curve": {"15": 6.1, ...}}``, optionally with ``"dflash": TAU``
    -> (curve, DFLASH's tau or None); ValueError naming ``source`` and the expected form."""
    form = 'expected {"budgets": [...], "tau": [...]} or {"curve": {"15": 6.1, ...}}, optionally with "dflash": TAU'
    if isinstance(data, dict) and isinstance(data.get("curve"), dict):
        items = list(data["curve"].items())
    elif isinstance(data, dict) and "budgets" in data and "tau" in data:
        budgets, taus = data["budgets"], data["tau"]
        if not isinstance(budgets, list) or not isinstance(taus, list) or len(budgets) != len(taus):
            raise ValueError(f'{source}: "budgets" and "tau" must be lists of one length; {form}')
        items = list(zip(budgets, taus))
    else:
        raise ValueError(f"{source}: {form}")
    try:
        points = tuple((int(b) if isinstance(b, str) else b, t) for b, t in items)
    except ValueError:
        raise ValueError(f"{source}: a budget is not an integer ({[b for b, _ in items]}); {form}") from None
    dflash = data.get("dflash")
    if dflash is not None and (isinstance(dflash, bool) or not isinstance(dflash, (int, float))
                               or not math.isfinite(dflash) or dflash < 1):
        raise ValueError(f'{source}: "dflash" {dflash!r} is not a number >= 1')
    return TauCurve(points, source=source), (None if dflash is None else float(dflash))


def load_tau_curve_json(path) -> tuple[TauCurve, float | None]:
    """``curve_from_json`` of the file at ``path``; ValueError when it cannot be read as JSON."""
    source = f"--tau-curve-json {path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source}: cannot read it as JSON ({exc})") from None
    return curve_from_json(data, source)


# ---- the round's configuration -------------------------------------------------------------------------------

AUTO = "KDTREE-auto"


def kdtree_mode(budget: int) -> str:
    return f"KDTREE-{budget}"


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Shapes, network, the fixed KDTREE budgets (sorted, unique) and the tokens per round of each mode."""

    model: ModelShape = ModelShape()
    drafter: DrafterShape = DrafterShape()
    net: Network = Network()
    budgets: tuple = DEFAULT_BUDGETS
    accept_dflash: float = PAPER_ACCEPT_DFLASH
    curve: TauCurve = dataclasses.field(default_factory=paper_curve)

    def __post_init__(self):
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"KDTREE budgets must be >= 1 and at least one: {self.budgets!r}")
        object.__setattr__(self, "budgets", tuple(sorted(set(self.budgets))))

    @property
    def kdtree_modes(self) -> tuple:
        return tuple(kdtree_mode(b) for b in self.budgets)

    @property
    def modes(self) -> tuple:
        """Every row's mode, in table order (the auto row last)."""
        return ("AR", "DFLASH", *self.kdtree_modes, AUTO)

    @property
    def widths(self) -> dict:
        """Verify width of each fixed mode (the auto row picks one of the KDTREE ones)."""
        return {"AR": 1, "DFLASH": self.drafter.block, **{kdtree_mode(b): b + 1 for b in self.budgets}}

    @property
    def verify_widths(self) -> list:
        return sorted(set(self.widths.values()))

    @property
    def bookkeeping_budget(self) -> int:
        """The budget the tree is built at (and its bookkeeping measured at): the largest."""
        return self.budgets[-1]


MOONSHOT_BATCH, MOONSHOT_BUDGET, MOONSHOT_SHARE = 32, 63, 0.03
#: auto / best fixed budget at least this in every cell; auto / DFLASH at least this at these batches
AUTO_VS_BEST_FIXED = 0.98
AUTO_VS_DFLASH = ((1, 1.15), (32, 1.10))

#: linear pieces of one verify forward at T tokens (per GPU)
VERIFY_PIECES = ("qkv_a", "q_b", "kv_absorb", "o_absorb", "o_proj", "rms_hidden", "rms_q", "rms_kv", "router",
                 "shared", "dense_mlp", "lm_head")
#: linear pieces of one drafter forward at T = batch x block
DRAFT_PIECES = ("draft_qkv", "draft_o", "dense_mlp", "rms_hidden")


def key(name: str, **dims) -> str:
    """The canonical key of a measured piece: ``name[a=1,b=2]`` (dims sorted by name)."""
    return f"{name}[" + ",".join(f"{k}={v}" for k, v in sorted(dims.items())) + "]"


# ---- the round (times in microseconds) ------------------------------------------------------------------------


def allreduce_us(nbytes: float, n_gpus: int, gbps: float, latency_us: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n_gpus``: ``2 (n-1)/n x bytes / bw + latency`` (0 on one GPU)."""
    if n_gpus <= 1:
        return 0.0
    return 2 * (n_gpus - 1) / n_gpus * nbytes / (gbps * 1e9) * 1e6 + latency_us


def allgather_us(total_bytes: float, n_gpus: int, gbps: float, latency_us: float) -> float:
    """Ring all-gather whose result is ``total_bytes``: ``(n-1)/n x bytes / bw + latency`` (0 on one GPU)."""
    if n_gpus <= 1:
        return 0.0
    return (n_gpus - 1) / n_gpus * total_bytes / (gbps * 1e9) * 1e6 + latency_us


class _Acc:
    """Sums looked-up piece times; a missing piece counts 0 and is listed (so sums are lower bounds)."""

    def __init__(self, times: dict):
        self.times, self.missing = times, []

    def get(self, k: str) -> float:
        v = self.times.get(k)
        if v is None or not math.isfinite(v):
            if k not in self.missing:
                self.missing.append(k)
            return 0.0
        return float(v)


def verify_forward(times: dict, bs: int, width: int, ctx: int, cfg: RoundConfig, acc: _Acc | None = None) -> dict:
    """One target forward over ``bs x width`` tokens at context ``ctx``, per GPU: attention / MoE / other /
    all-reduce (us) and the pieces it lacks."""
    m, net = cfg.model, cfg.net
    acc = acc or _Acc(times)
    T = bs * width
    p = {name: acc.get(key(name, T=T)) for name in VERIFY_PIECES}
    attention = m.layers * acc.get(key("attention", bs=bs, width=width, ctx=ctx))
    moe = m.moe_layers * acc.get(key("moe", T=T))
    per_layer = (p["qkv_a"] + p["q_b"] + p["kv_absorb"] + p["o_absorb"] + p["o_proj"]
                 + 2 * p["rms_hidden"] + p["rms_q"] + p["rms_kv"])
    other = (m.layers * per_layer + m.moe_layers * (p["router"] + p["shared"]) + m.dense_layers * p["dense_mlp"]
             + p["lm_head"])
    reduce = (2 * m.layers + 1) * net.collective_us(T * m.hidden * net.act_bytes, m.tp)
    reduce += net.collective_us(T * m.vocab * net.act_bytes, m.tp, gather=True) if net.gather_logits else 0.0
    return {"attention": attention, "moe": moe, "other": other, "allreduce": reduce,
            "total": attention + moe + other + reduce, "missing": acc.missing}


def draft_forward(times: dict, bs: int, ctx: int, cfg: RoundConfig, acc: _Acc | None = None) -> dict:
    """The drafter's forward over ``bs x block`` positions plus its head over ``bs x (block-1)`` rows (us), plus a
    served rank's excess over them where given (``draft_excess``, ``kimi_served.py``)."""
    m, d, net = cfg.model, cfg.drafter, cfg.net
    acc = acc or _Acc(times)
    T, rows = bs * d.block, bs * (d.block - 1)
    reduce = (2 * d.layers + 1) * net.collective_us(T * m.hidden * net.act_bytes, m.tp)
    reduce += net.collective_us(rows * m.vocab * net.act_bytes, m.tp, gather=True) if net.gather_logits else 0.0
    p = {name: acc.get(key(name, T=T)) for name in DRAFT_PIECES}
    attention = acc.get(key("draft_attention", bs=bs, ctx=ctx))
    body = d.layers * (p["draft_qkv"] + p["draft_o"] + p["dense_mlp"] + 2 * p["rms_hidden"] + attention)
    head, excess = acc.get(key("lm_head", T=rows)), times.get(key("draft_excess", bs=bs, ctx=ctx), 0.0)
    return {"compute": body + head + excess, "head": head, "allreduce": reduce,
            "total": body + head + excess + reduce, "missing": acc.missing}


def round_row(times: dict, mode: str, bs: int, ctx: int, cfg: RoundConfig) -> dict:
    """One decode round of a fixed ``mode`` (AR, DFLASH or KDTREE-B) at batch ``bs``, context ``ctx``: the split
    (us), tokens per round, projected tokens/s per request and for the batch, bookkeeping share, missing pieces."""
    if mode not in cfg.widths:
        raise ValueError(f"unknown mode {mode!r}; this configuration's fixed modes: {', '.join(cfg.widths)}")
    acc = _Acc(times)
    width = cfg.widths[mode]
    kd = mode.startswith("KDTREE-")
    verify = verify_forward(times, bs, width, ctx, cfg, acc)
    excess = times.get(key(f"forward_excess:{mode}", bs=bs, ctx=ctx), 0.0)  # a served rank's (kimi_served.py)
    verify.update(attention=verify["attention"] + excess, total=verify["total"] + excess)
    draft = draft_forward(times, bs, ctx, cfg, acc)["total"] if mode != "AR" else 0.0
    # the tree and accept+commit of the largest budget for every KDTREE row (the module docstring's ASSUMPTION)
    tree = acc.get(key("tree", bs=bs)) if kd else 0.0
    accept = acc.get(key("accept_commit", bs=bs)) if kd else 0.0
    tokens = cfg.curve.tau(width - 1) if kd else 1.0 if mode == "AR" else cfg.accept_dflash
    total = draft + tree + verify["total"] + accept
    bk_missing = kd and any(k.startswith(("tree[", "accept_commit[")) for k in acc.missing)
    tok_s = tokens / total * 1e6 if total > 0 else float("nan")
    return {
        "mode": mode, "bs": bs, "ctx": ctx, "width": width, "draft": draft, "tree": tree,
        "attention": verify["attention"], "moe": verify["moe"], "other": verify["other"],
        "allreduce": verify["allreduce"], "accept_commit": accept, "verify": verify["total"], "round": total,
        "tokens": tokens, "tok_s": tok_s, "tok_s_batch": tok_s * bs, "bookkeeping": tree + accept,
        "share": None if not kd or bk_missing or total <= 0 else (tree + accept) / total,
        "missing": list(acc.missing),
    }


def auto_row(fixed: list[dict]) -> dict:
    """``KDTREE-auto`` of one (batch, context) cell from its fixed KDTREE rows (which share the largest budget's
    bookkeeping): the row of the width ``best_width`` picks from tau(w - 1) / round(w), ties to the smaller, with
    ``chose`` = that width; with no positive round time at all, tokens/s n/a and ``chose`` None. Its ``missing``
    lists every piece any candidate lacked: the choice compared them all."""
    try:
        chose = best_width({r["width"]: r["tokens"] for r in fixed}, {r["width"]: r["round"] * 1e-6 for r in fixed})
        row = dict(next(r for r in fixed if r["width"] == chose))
    except ValueError:
        chose = None
        row = dict(fixed[-1], tok_s=float("nan"), tok_s_batch=float("nan"), share=None)
    missing = list(dict.fromkeys(k for r in fixed for k in r["missing"]))
    return dict(row, mode=AUTO, chose=chose, missing=missing)


def assemble(times: dict, cfg: RoundConfig, batches, contexts) -> list[dict]:
    """Every (context, batch) cell's rows in ``cfg.modes`` order."""
    rows = []
    for ctx in contexts:
        for bs in batches:
            fixed = [round_row(times, mode, bs, ctx, cfg) for mode in cfg.widths]
            rows += fixed + [auto_row([r for r in fixed if r["mode"] in cfg.kdtree_modes])]
    return rows


def _ratio(a, b):
    ok = all(x is not None and math.isfinite(x) for x in (a, b)) and b > 0
    return a / b if ok else None


def summarize(rows: list[dict], cfg: RoundConfig) -> list[dict]:
    """Per (context, batch) cell: tokens/s per request by mode, auto's width, the best fixed KDTREE mode, auto /
    DFLASH and auto / best fixed (None where undefined), and whether any row of the cell lacks pieces."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["ctx"], r["bs"]), {})[r["mode"]] = r
    out = []
    for (ctx, bs), by in cells.items():
        auto, fixed = by.get(AUTO), [by[m] for m in cfg.kdtree_modes if m in by]
        rate = [r["tok_s"] if math.isfinite(r["tok_s"]) else -math.inf for r in fixed]
        best = fixed[rate.index(max(rate))] if fixed else None
        a = auto["tok_s"] if auto else None
        out.append({"ctx": ctx, "bs": bs, "tok_s": {m: r["tok_s"] for m, r in by.items()},
                    "auto_width": auto["chose"] if auto else None, "best_fixed": best["mode"] if best else None,
                    "auto_vs_dflash": _ratio(a, by["DFLASH"]["tok_s"] if "DFLASH" in by else None),
                    "auto_vs_best_fixed": _ratio(a, best["tok_s"] if best else None),
                    "partial": any(r["missing"] for r in by.values())})
    return out


def _check(target: str, cells: list[dict], field: str, floor: float, absent: str) -> dict:
    """PASS when every cell's ``field`` >= ``floor``; FAIL when a complete cell's is below; UNDETERMINED when the
    rest lack pieces (their rounds are lower bounds, so their ratios prove nothing); n/a without cells."""
    if not cells:
        return {"target": target, "state": "n/a", "line": f"check: {target}: n/a ({absent})"}
    known = [c for c in cells if c[field] is not None and not c["partial"]]
    state = ("FAIL" if any(c[field] < floor for c in known) else "PASS" if len(known) == len(cells)
             else "UNDETERMINED")
    worst = min((c for c in cells if c[field] is not None), key=lambda c: c[field], default=None)
    detail = "no figures" if worst is None else f"lowest {worst[field]:.3f}x at ctx {worst['ctx']}, batch {worst['bs']}"
    if len(known) < len(cells):
        detail += f"; {len(cells) - len(known)} cell(s) lack pieces"
    return {"target": target, "state": state, "line": f"check: {target}: {state} ({detail})"}


def check_targets(summary: list[dict]) -> list[dict]:
    """The targets of the module docstring, one ``{"target", "state", "line"}`` each."""
    checks = [_check(f"auto within {100 * (1 - AUTO_VS_BEST_FIXED):.0f} % of the best fixed budget in every cell",
                     summary, "auto_vs_best_fixed", AUTO_VS_BEST_FIXED, "no cells")]
    for bs, floor in AUTO_VS_DFLASH:
        checks.append(_check(f"auto >= {floor:.2f}x DFLASH per request at batch {bs}",
                             [c for c in summary if c["bs"] == bs], "auto_vs_dflash", floor,
                             f"batch {bs} not in --batches"))
    checks.append(_check("auto never below DFLASH in any cell", summary, "auto_vs_dflash", 1.0, "no cells"))
    return checks


def moonshot_verdict(rows: list[dict], batch: int = MOONSHOT_BATCH, budget: int = MOONSHOT_BUDGET,
                     threshold: float = MOONSHOT_SHARE) -> tuple[str, str]:
    """``("holds" | "fails" | "undetermined", line)`` for: bookkeeping < ``threshold`` of the KDTREE-``budget`` round
    at ``batch`` at every context. A row with missing non-bookkeeping pieces has a lower-bound round, so its share is
    an upper bound: below the threshold it still proves the line; above it decides nothing."""
    head = f"moonshot line (bookkeeping < {threshold:.0%} of the projected round at batch {batch}, budget {budget})"
    kd = [r for r in rows if r["mode"] == kdtree_mode(budget) and r["bs"] == batch]
    if not kd:
        why = f"budget {budget} not in --budgets" if any(r["bs"] == batch for r in rows) else \
            f"batch {batch} not in --batches"
        return "undetermined", f"{head}: UNDETERMINED ({why})"
    parts, states = [], []
    for r in kd:
        if r["share"] is None:
            states.append("undetermined")
            parts.append(f"ctx {r['ctx']}: bookkeeping not measured")
            continue
        exact, below = not r["missing"], r["share"] < threshold
        states.append("holds" if below else ("fails" if exact else "undetermined"))
        parts.append(f"ctx {r['ctx']}: {'' if exact else '<= '}{100 * r['share']:.2f} % "
                     f"({r['bookkeeping']:.0f} of {'' if exact else '>= '}{r['round']:.0f} us)")
    state = "fails" if "fails" in states else "undetermined" if "undetermined" in states else "holds"
    return state, f"{head}: {state.upper()}; " + "; ".join(parts)


def needed_tokens(batches, cfg: RoundConfig) -> dict:
    """Token counts each kind of piece is needed at: {"verify": [...], "draft": [...], "head": [...]}."""
    return {"verify": sorted({bs * w for bs in batches for w in cfg.verify_widths}, reverse=True),
            "draft": sorted({bs * cfg.drafter.block for bs in batches}, reverse=True),
            "head": sorted({bs * (cfg.drafter.block - 1) for bs in batches}, reverse=True)}


def required_keys(batches, contexts, cfg: RoundConfig) -> list[str]:
    """Every piece key the assembled rows read (the measurement's to-do list; tests fill it)."""
    acc = _Acc({})
    for ctx in contexts:
        for bs in batches:
            for width in cfg.verify_widths:
                verify_forward({}, bs, width, ctx, cfg, acc)
            draft_forward({}, bs, ctx, cfg, acc)
            acc.get(key("tree", bs=bs)), acc.get(key("accept_commit", bs=bs))
    return acc.missing
