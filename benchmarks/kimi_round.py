"""A measured model of one Kimi K2.6 decode round at TP 8: AR vs DFLASH (chain) vs KDTREE (DDTree), per GPU.

    python benchmarks/kimi_round.py [--batches 1 32] [--contexts 4096 16384] [--budget 64] [--deadline 150]
                                    [--json OUT] [--from-json IN] [--bookkeeping-us 32=TREE,ACCEPT ...]
    python -m sglang_kdtree bench --kimi-round [same options]

Every piece of the round is timed on the GPU at Kimi K2.6's per-GPU shapes under tensor parallelism 8, for
token counts T = batch x verify width (AR: width 1; DFLASH chain: width = drafter block 16; KDTREE: width =
budget + 1 = 65), then the round is assembled by plain arithmetic on those times (the pure functions below:
``verify_forward``, ``draft_forward``, ``round_row``, ``allreduce_us``, ``moonshot_verdict``; CPU-tested in
tests/test_kimi_round.py). ``--from-json`` re-assembles a saved measurement without a GPU.

Model shape (Kimi K2.6 = DeepSeek-V3 architecture; checked against public Kimi K2 / K2.5 / K2.6 configs:
``text_config`` of moonshotai/Kimi-K2.6 pins hidden 7168, 61 layers, 384 routed + 1 shared experts, top 8,
q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, routed scale 2.827; Kimi K2.5's config adds
intermediate 18432, moe_intermediate 2048, first_k_dense_replace 1, vocab 163,840):

* 61 layers: layer 0 dense (SwiGLU intermediate 18432), layers 1-60 MoE; hidden 7168; vocab 163,840.
* MLA: 64 heads (8 per GPU), q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128.
* MoE: 384 routed experts, top 8, moe_intermediate 2048 (256 per GPU), routed experts INT4 W4A16 group 32
  (Marlin); 1 shared expert, intermediate 2048 (256 per GPU), bf16; sigmoid router over 384 experts.

Pieces (one GPU, bf16 unless said; each is the median of CUDA-event-timed replays of a CUDA graph, falling
back to eager timing where a capture fails; marked in the output). Weights rotate over enough distinct
copies (up to one per layer) that they come from HBM, not the 50 MB L2, as in the real 61-layer forward:

* MLA projections per layer: fused q_a + kv_a (7168 -> 1536 + 576, replicated), q_b (1536 -> 8 x 192,
  column-parallel), the absorbed kv_b halves as batched matmuls over the 8 local heads (q_nope 128 -> latent
  512; attention output latent 512 -> v 128), o_proj (8 x 128 -> 7168, row-parallel); RMSNorms (input and
  post-attention over 7168, q_a over 1536, kv_a over 512) with ``torch.nn.functional.rms_norm``.
* tree-verify attention: ``sglang_kdtree.gpu.mla_attention.mla_tree_verify`` on ``synthetic_inputs`` with 8
  heads, every request at the given context (AR: the same kernel at width 1, a stand-in for SGLang's decode
  attention); captured in a graph, so its split factor is the one the server's graphs use.
* routed MoE: ``sglang_kdtree.moe.forward.fused_moe_marlin`` at bench_marlin_moe's ``tp8`` shape (384 experts,
  hidden 7168, intermediate 256, top 8), uniform random routings rotated over ``ROTATE`` draws so the touched
  experts come from HBM; where Marlin's JIT modules are not available within ``--marlin-prep-s`` (seeded from
  ``.dev-carry/jit`` or ``.jitcache/sm90a`` if carried; a cold compile takes ~6 min), the bf16 grouped path
  ``bench_marlin_moe.bf16_moe_grouped`` instead, and the output says so.
* router (7168 -> 384 GEMM, sigmoid, biased top 8), shared expert (7168 -> 2 x 256, SiLU, 256 -> 7168), the
  dense first layer's MLP (7168 -> 2 x 2304, SiLU, 2304 -> 7168), the lm_head slice (7168 -> 163,840 / 8).
* the drafter (ASSUMPTION: Kimi K2.6's DFlash drafter is not public): ``--draft-layers`` (default 5) dense
  layers at hidden 7168, GQA attention with 64 query heads and 8 KV heads of 128 (8 and 1 per GPU; the 8 query heads of
  a KV head folded into rows for torch SDPA), SwiGLU
  intermediate 18432 (the dense layer's piece), over a block of 16 positions that attend, unmasked, to the
  whole context plus the block (``scaled_dot_product_attention``); two all-reduces per layer and one for the
  block's embedding; its head: the lm_head slice over batch x 15 rows, then an all-gather of those logits.
  The head is part of the draft. Not modelled: the drafter's projection of the target's hidden states for
  the newly accepted tokens (a few rows per request) and its KV commit.
* our bookkeeping: ``benchmarks/round_parts.py``'s ``parts()`` at the same batch and budget (depth 15,
  vocab 163,840, KV compaction over 61 MLA layers): tree = ``tree graph replay`` (top-K -> tree -> verify
  inputs; the draft head is counted in the draft), accept+commit = ``accept_commit graph replay`` (device time
  of the two captured step graphs); ``--bookkeeping-us`` overrides.
* collectives (a model, not measured): per forward 2 all-reduces per layer (attention out, MLP/MoE out) plus
  one for the vocab-parallel embedding, of T x 7168 bf16, ring time ``2 (n-1)/n x bytes / bw + latency``,
  and an all-gather of the T x 163,840 bf16 logits (``(n-1)/n x bytes / bw + latency``; ``--no-logits-gather``
  drops it) with bw = ``--nvlink-gbps`` (default 450 GB/s per direction) and ``--allreduce-latency-us``
  (default 10 us per call).

Not modelled: RoPE, residual adds (fused into the norms in SGLang), the final norm, sampling, host time and
any overlap between pieces (the round is their sum). AR and DFLASH carry no bookkeeping at all (optimistic
for them, so conservative for KDTREE).

Tokens per round: AR 1; DFLASH ``--accept-dflash``; KDTREE ``--accept-kdtree``. Defaults: the DDTree paper's
published mean acceptance length tau (Ringel & Romano, arXiv 2604.12989, Table "Speedup over autoregressive
decoding and mean acceptance length", from github.com/liranringel/ddtree src/data/results.tex), Qwen3-Coder-
30B-A3B-Instruct (the paper's MoE target) at temperature 0, mean over its 10 datasets (``PAPER_TAU``). They are
not Kimi K2.6's numbers, and the paper's DDTree tau is at the best node budget per dataset from {16, ..., 1024},
not at 64: at budget 64 it is an optimistic figure. Pass measured values when there are some.

Moonshot line: bookkeeping (tree + accept+commit) < 3 % of the projected KDTREE round at batch 32, budget 64.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

from sglang_kdtree.bench_timing import cuda_time_us

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# ---------------------------------------------------------------------------------------------------------
# Shapes and assumptions
# ---------------------------------------------------------------------------------------------------------


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

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def heads_gpu(self) -> int:
        return self.heads // self.tp

    @property
    def moe_inter_gpu(self) -> int:
        return self.moe_inter // self.tp

    @property
    def shared_inter_gpu(self) -> int:
        return self.shared_inter // self.tp

    @property
    def dense_inter_gpu(self) -> int:
        return self.dense_inter // self.tp

    @property
    def vocab_gpu(self) -> int:
        return self.vocab // self.tp


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


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    model: ModelShape = ModelShape()
    drafter: DrafterShape = DrafterShape()
    net: Network = Network()
    budget: int = 64
    accept_dflash: float = 0.0
    accept_kdtree: float = 0.0

    @property
    def widths(self) -> dict:
        return {"AR": 1, "DFLASH": self.drafter.block, "KDTREE": self.budget + 1}


KIMI = ModelShape()

#: The DDTree paper's mean acceptance length tau, Qwen3-Coder-30B-A3B-Instruct, temperature 0:
#: dataset -> (DFlash, DFlash + DDTree at its best budget). Source: github.com/liranringel/ddtree,
#: src/data/results.tex (arXiv 2604.12989, "Speedup over autoregressive decoding and mean acceptance length").
PAPER_TAU = {
    "MATH-500": (5.58, 8.10),
    "GSM8K": (5.18, 7.55),
    "AIME 2024": (5.16, 7.87),
    "AIME 2025": (5.13, 7.63),
    "HumanEval": (8.02, 10.72),
    "MBPP": (7.19, 9.94),
    "LiveCodeBench": (6.32, 8.63),
    "SWE-bench Lite": (3.61, 5.71),
    "MT-Bench": (3.52, 5.36),
    "Alpaca": (2.22, 3.55),
}
PAPER_ACCEPT_DFLASH = round(statistics.mean(v[0] for v in PAPER_TAU.values()), 2)
PAPER_ACCEPT_KDTREE = round(statistics.mean(v[1] for v in PAPER_TAU.values()), 2)

MOONSHOT_BATCH = 32
MOONSHOT_BUDGET = 64
MOONSHOT_SHARE = 0.03

#: linear pieces of one verify forward at T tokens (per GPU)
VERIFY_PIECES = ("qkv_a", "q_b", "kv_absorb", "o_absorb", "o_proj", "rms_hidden", "rms_q", "rms_kv", "router",
                 "shared", "dense_mlp", "lm_head")
#: linear pieces of one drafter forward at T = batch x block
DRAFT_PIECES = ("draft_qkv", "draft_o", "dense_mlp", "rms_hidden")


def key(name: str, **dims) -> str:
    """The canonical key of a measured piece: ``name[a=1,b=2]`` (dims sorted by name)."""
    return f"{name}[" + ",".join(f"{k}={v}" for k, v in sorted(dims.items())) + "]"


# ---------------------------------------------------------------------------------------------------------
# Pure arithmetic (times in microseconds, plain dicts)
# ---------------------------------------------------------------------------------------------------------


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
    reduce = (2 * m.layers + 1) * allreduce_us(T * m.hidden * net.act_bytes, m.tp, net.gbps, net.latency_us)
    if net.gather_logits:
        reduce += allgather_us(T * m.vocab * net.act_bytes, m.tp, net.gbps, net.latency_us)
    return {"attention": attention, "moe": moe, "other": other, "allreduce": reduce,
            "total": attention + moe + other + reduce, "missing": acc.missing}


def draft_forward(times: dict, bs: int, ctx: int, cfg: RoundConfig, acc: _Acc | None = None) -> dict:
    """The drafter's forward over ``bs x block`` positions plus its head over ``bs x (block-1)`` rows (us)."""
    m, d, net = cfg.model, cfg.drafter, cfg.net
    acc = acc or _Acc(times)
    T = bs * d.block
    rows = bs * (d.block - 1)
    p = {name: acc.get(key(name, T=T)) for name in DRAFT_PIECES}
    attention = acc.get(key("draft_attention", bs=bs, ctx=ctx))
    layer = p["draft_qkv"] + p["draft_o"] + p["dense_mlp"] + 2 * p["rms_hidden"] + attention
    one_reduce = allreduce_us(T * m.hidden * net.act_bytes, m.tp, net.gbps, net.latency_us)
    body = d.layers * layer
    reduce = (2 * d.layers + 1) * one_reduce
    head = acc.get(key("lm_head", T=rows))
    if net.gather_logits:
        reduce += allgather_us(rows * m.vocab * net.act_bytes, m.tp, net.gbps, net.latency_us)
    return {"compute": body + head, "head": head, "allreduce": reduce, "total": body + head + reduce,
            "missing": acc.missing}


def round_row(times: dict, mode: str, bs: int, ctx: int, cfg: RoundConfig) -> dict:
    """One decode round of ``mode`` (AR, DFLASH or KDTREE) at batch ``bs``, context ``ctx``: the split (us),
    tokens per round, projected tokens/s per request and for the batch, bookkeeping share, missing pieces."""
    if mode not in ("AR", "DFLASH", "KDTREE"):
        raise ValueError(f"unknown mode {mode!r}")
    acc = _Acc(times)
    width = cfg.widths[mode]
    verify = verify_forward(times, bs, width, ctx, cfg, acc)
    draft = draft_forward(times, bs, ctx, cfg, acc)["total"] if mode != "AR" else 0.0
    tree = acc.get(key("tree", bs=bs)) if mode == "KDTREE" else 0.0
    accept = acc.get(key("accept_commit", bs=bs)) if mode == "KDTREE" else 0.0
    tokens = {"AR": 1.0, "DFLASH": cfg.accept_dflash, "KDTREE": cfg.accept_kdtree}[mode]
    total = draft + tree + verify["total"] + accept
    bookkeeping = tree + accept
    bk_missing = mode == "KDTREE" and any(k.startswith(("tree[", "accept_commit[")) for k in acc.missing)
    tok_s = tokens / total * 1e6 if total > 0 else float("nan")
    return {
        "mode": mode, "bs": bs, "ctx": ctx, "width": width, "draft": draft, "tree": tree,
        "attention": verify["attention"], "moe": verify["moe"], "other": verify["other"],
        "allreduce": verify["allreduce"], "accept_commit": accept, "verify": verify["total"], "round": total,
        "tokens": tokens, "tok_s": tok_s, "tok_s_batch": tok_s * bs,
        "bookkeeping": bookkeeping,
        "share": (None if mode != "KDTREE" or bk_missing or total <= 0 else bookkeeping / total),
        "missing": list(acc.missing),
    }


def assemble(times: dict, cfg: RoundConfig, batches, contexts) -> list[dict]:
    """Every (context, batch, mode) row."""
    return [round_row(times, mode, bs, ctx, cfg)
            for ctx in contexts for bs in batches for mode in ("AR", "DFLASH", "KDTREE")]


def moonshot_verdict(rows: list[dict], batch: int = MOONSHOT_BATCH, budget: int | None = None,
                     threshold: float = MOONSHOT_SHARE) -> tuple[str, str]:
    """``("holds" | "fails" | "undetermined", line)`` for: bookkeeping < ``threshold`` of the KDTREE round at
    ``batch`` at every context. A row with missing non-bookkeeping pieces has a lower-bound round, so its
    share is an upper bound: below the threshold it still proves the line; above it decides nothing."""
    if budget is not None and budget != MOONSHOT_BUDGET:
        return "undetermined", (f"moonshot line (bookkeeping < {threshold:.0%} of the round at batch {batch}, "
                                f"budget {MOONSHOT_BUDGET}): UNDETERMINED (this run's budget is {budget})")
    kd = [r for r in rows if r["mode"] == "KDTREE" and r["bs"] == batch]
    head = f"moonshot line (bookkeeping < {threshold:.0%} of the projected round at batch {batch}, budget " \
           f"{MOONSHOT_BUDGET})"
    if not kd:
        return "undetermined", f"{head}: UNDETERMINED (batch {batch} not in --batches)"
    parts, states = [], []
    for r in kd:
        if r["share"] is None:
            states.append("undetermined")
            parts.append(f"ctx {r['ctx']}: bookkeeping not measured")
            continue
        exact = not r["missing"]
        below = r["share"] < threshold
        states.append("holds" if below else ("fails" if exact else "undetermined"))
        bound = "" if exact else "<= "
        parts.append(f"ctx {r['ctx']}: {bound}{100 * r['share']:.2f} % "
                     f"({r['bookkeeping']:.0f} of {'>= ' if not exact else ''}{r['round']:.0f} us)")
    state = "fails" if "fails" in states else "undetermined" if "undetermined" in states else "holds"
    return state, f"{head}: {state.upper()}; " + "; ".join(parts)


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


def needed_tokens(batches, cfg: RoundConfig) -> dict:
    """Token counts each kind of piece is needed at: {"verify": [...], "draft": [...], "head": [...]}."""
    verify = sorted({bs * w for bs in batches for w in cfg.widths.values()}, reverse=True)
    draft = sorted({bs * cfg.drafter.block for bs in batches}, reverse=True)
    head = sorted({bs * (cfg.drafter.block - 1) for bs in batches}, reverse=True)
    return {"verify": verify, "draft": draft, "head": head}


def required_keys(batches, contexts, cfg: RoundConfig) -> list[str]:
    """Every piece key the assembled rows read (the measurement's to-do list; tests fill it)."""
    rows_acc = _Acc({})
    for ctx in contexts:
        for bs in batches:
            for mode in ("AR", "DFLASH", "KDTREE"):
                verify_forward({}, bs, cfg.widths[mode], ctx, cfg, rows_acc)
            draft_forward({}, bs, ctx, cfg, rows_acc)
            rows_acc.get(key("tree", bs=bs))
            rows_acc.get(key("accept_commit", bs=bs))
    return rows_acc.missing


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _f(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


TABLE_COLUMNS = ("ctx", "bs", "mode", "width", "draft", "tree", "attn", "MoE", "other", "all-reduce",
                 "accept+commit", "round us", "tok/round", "tok/s/req", "tok/s batch", "bookkeeping")


def format_table(rows: list[dict]) -> str:
    """The short markdown table: the round split (us), tokens/s per request and batch, bookkeeping share.
    Rows with missing pieces: ``*`` on the round (a lower bound) and ``<=`` on tokens/s and the share."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in rows:
        partial = bool(r["missing"])
        le = "<= " if partial else ""
        share = "-" if r["mode"] != "KDTREE" else ("n/a" if r["share"] is None else f"{le}{100 * r['share']:.2f} %")
        cells = [str(r["ctx"]), str(r["bs"]), r["mode"], str(r["width"]), _f(r["draft"]), _f(r["tree"]),
                 _f(r["attention"]), _f(r["moe"]), _f(r["other"]), _f(r["allreduce"]), _f(r["accept_commit"]),
                 _f(r["round"]) + ("*" if partial else ""), f"{r['tokens']:.2f}", le + _f(r["tok_s"]),
                 le + _f(r["tok_s_batch"]), share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def assumptions_text(cfg: RoundConfig, moe_path: str | None) -> list[str]:
    m, d, n = cfg.model, cfg.drafter, cfg.net
    return [
        f"target: Kimi K2.6 per GPU at TP {m.tp}: {m.layers} layers ({m.dense_layers} dense, {m.moe_layers} MoE), "
        f"hidden {m.hidden}, MLA {m.heads_gpu} heads/GPU (q_lora {m.q_lora}, kv_lora {m.kv_lora}, qk {m.qk_nope}+"
        f"{m.qk_rope}, v {m.v_head}), {m.experts} experts top {m.top_k} at intermediate {m.moe_inter_gpu}/GPU "
        f"(INT4 W4A16 g32), shared expert {m.shared_inter_gpu}/GPU bf16, dense intermediate {m.dense_inter_gpu}/GPU, "
        f"lm_head {m.vocab_gpu} of {m.vocab} columns",
        f"routed MoE path: {moe_path or 'not measured'}; routings uniform random (real routing is skewed)",
        f"drafter (ASSUMED): {d.layers} dense layers at hidden {m.hidden}, {d.heads} q / {d.kv_heads} kv heads x "
        f"{d.head_dim}, intermediate {m.dense_inter}, block {d.block} attending the whole context; head = lm_head "
        f"slice over batch x {d.block - 1} rows (part of the draft)",
        f"collectives (MODEL): ring all-reduce 2(n-1)/n x bytes / {n.gbps:g} GB/s + {n.latency_us:g} us per call, "
        f"{2 * m.layers + 1} per target forward and {2 * d.layers + 1} per draft forward of T x {m.hidden} bf16; "
        + (f"logits all-gather (n-1)/n x T x {m.vocab} x 2 B / bw + latency" if n.gather_logits
           else "no logits all-gather (--no-logits-gather)"),
        f"tokens/round: AR 1, DFLASH {cfg.accept_dflash:g}, KDTREE {cfg.accept_kdtree:g}"
        + (" (DDTree paper, Qwen3-Coder-30B-A3B T=0 mean over 10 datasets; DDTree at its best budget, not 64; "
           "not Kimi's figures)" if (cfg.accept_dflash, cfg.accept_kdtree) == (PAPER_ACCEPT_DFLASH,
                                                                              PAPER_ACCEPT_KDTREE) else ""),
        "AR / DFLASH carry no bookkeeping; RoPE, residual adds, final norm, sampling, host time and overlap are "
        "not modelled; the round is the sum of its pieces",
    ]


def report(measured: dict, cfg: RoundConfig, batches, contexts, out=None) -> dict:
    """Print the report (short markdown table last) and return ``{"rows", "moonshot"}``."""
    out = out or sys.stdout
    times = measured.get("times", {})
    rows = assemble(times, cfg, batches, contexts)
    state, line = moonshot_verdict(rows, budget=cfg.budget)

    def say(s=""):
        print(s, file=out)

    say(f"\n# Kimi K2.6 decode round at TP {cfg.model.tp} (per GPU), budget {cfg.budget}, block "
        f"{cfg.drafter.block}; device: {measured.get('device', '?')}")
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
    names = [n for n in VERIFY_PIECES] + ["moe", "draft_qkv", "draft_o"]
    say("| T | " + " | ".join(names) + " |")
    say("|---" * (len(names) + 1) + "|")
    for T in sorted(set(tokens["verify"]) | set(tokens["draft"]) | set(tokens["head"])):
        cells = []
        for n in names:
            v = times.get(key(n, T=T))
            cells.append("" if v is None else _f(v))
        say(f"| {T} | " + " | ".join(cells) + " |")
    attn = sorted((k, v) for k, v in times.items() if k.startswith(("attention[", "draft_attention[", "tree[",
                                                                      "accept_commit[")))
    if attn:
        say("\n" + "; ".join(f"{k} {_f(v)}" for k, v in attn))
    missing = sorted({k for r in rows for k in r["missing"]})
    if missing:
        say("\nmissing pieces (counted as 0 us; rows marked *): " + ", ".join(missing))
    say("\n" + line)
    say("\nround split per GPU (us; attn/MoE/other/all-reduce = the verify forward; tok/s = tokens per round / "
        "round time):\n")
    say(format_table(rows))
    return {"rows": rows, "moonshot": {"state": state, "line": line}}


# ---------------------------------------------------------------------------------------------------------
# Measurement (GPU; torch imported lazily)
# ---------------------------------------------------------------------------------------------------------


class DeadlineExceeded(BaseException):
    """The deadline (or a piece's shorter budget) passed. A BaseException, like KeyboardInterrupt, so library
    code's ``except Exception`` (e.g. ``moe.jit.seed_prebuilt`` falling back to a compile) cannot swallow it."""

    def __init__(self, label: str = "deadline"):
        super().__init__(label)
        self.label = label


class _Alarm:
    """Raise ``DeadlineExceeded`` in the main thread when the global deadline (or a shorter budget) passes
    (SIGALRM; where that is unavailable, only the checks between pieces apply)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.label = "deadline"
        self.enabled = hasattr(signal, "setitimer")
        self._old = None
        if self.enabled:
            try:
                self._old = signal.signal(signal.SIGALRM, self._fire)
            except ValueError:  # not the main thread
                self.enabled = False

    def _fire(self, signum, frame):
        raise DeadlineExceeded(self.label)

    def left(self) -> float:
        return self.end - time.monotonic()

    def arm(self, seconds: float | None = None, label: str = "deadline") -> None:
        left = self.left()
        t = left if seconds is None else min(seconds, left)
        self.label = "deadline" if t >= left else label
        if t <= 0:
            raise DeadlineExceeded(self.label)
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, t)

    def disarm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if self._old is not None:
                signal.signal(signal.SIGALRM, self._old)
                self._old = None
            self.enabled = False


def _oneline(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:limit]


def _import_bench(name: str):
    """A sibling benchmark module (``bench_marlin_moe``, ``round_parts``) by import."""
    import importlib

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


L2_FLUSH_BYTES = 256 << 20  # weights a piece rotates over: well past the H200's 50 MB L2
MIN_CALLS = 16  # calls per timed replay


def cuda_graph_us(fns, trials: int = 5) -> tuple[float, str]:
    """Median device microseconds per call of ``fns`` (each run once per pass, passes repeated to at least
    MIN_CALLS calls) from CUDA-event-timed replays of one CUDA graph; eager passes where the capture fails."""
    import torch

    repeat = max(1, math.ceil(MIN_CALLS / len(fns)))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, autotunes) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                for f in fns:
                    f()
        run = graph.replay
    except DeadlineExceeded:
        raise
    except Exception:
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for _ in range(repeat):
                for f in fns:
                    f()
    # one warm-up pass, then the median of `trials` CUDA-event-timed passes (the benchmarks' one timer)
    return cuda_time_us(run, calls=repeat * len(fns), trials=trials), mode


class _Bench:
    """State of one measurement run: shapes, device, timer, weight caches, results."""

    def __init__(self, cfg: RoundConfig, device: str, timer, alarm: _Alarm, log):
        self.cfg, self.device, self.timer, self.alarm, self.log = cfg, device, timer, alarm, log
        self.times, self.errors, self.modes, self.notes, self.skipped = {}, {}, {}, [], []
        self.extra: dict = {}
        self.weights: dict = {}
        self.moe = None

    def record(self, k: str, fns) -> None:
        us, mode = self.timer(fns)
        self.times[k] = float(us)
        self.modes[k] = mode

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    # --- linear pieces -------------------------------------------------------------------------------

    def _copies(self, nbytes: int) -> int:
        return max(2, min(self.cfg.model.layers, math.ceil(L2_FLUSH_BYTES / max(1, nbytes))))

    def _weights(self, name: str, shapes, scale: float = 0.02):
        """Distinct weight sets for ``name`` (each a tuple of bf16 tensors of ``shapes``), cached."""
        import torch

        if name not in self.weights:
            count = self._copies(sum(math.prod(s) * 2 for s in shapes))
            self.weights[name] = [tuple(torch.randn(s, device=self.device, dtype=torch.bfloat16) * scale
                                        for s in shapes) for _ in range(count)]
        return self.weights[name]

    def linear_fns(self, name: str, T: int):
        """Callables of one linear piece at ``T`` tokens, one per distinct weight set."""
        import torch
        import torch.nn.functional as F

        m, d, dev = self.cfg.model, self.cfg.drafter, self.device
        H, h = m.hidden, m.heads_gpu

        def x_of(k):
            return (torch.randn((T, k), device=dev)).to(torch.bfloat16)

        def mm(k, n):
            x = x_of(k)
            return [lambda w=w: torch.matmul(x, w[0].t()) for w in self._weights(name, [(n, k)])]

        def mlp(inter):
            x = x_of(H)

            def run(w13, w2):
                g = torch.matmul(x, w13.t())
                return torch.matmul(F.silu(g[:, :inter]) * g[:, inter:], w2.t())
            return [lambda w=w: run(*w) for w in self._weights(name, [(2 * inter, H), (H, inter)])]

        def bmm(a, b):
            x = torch.randn((h, T, a), device=dev).to(torch.bfloat16)
            return [lambda w=w: torch.bmm(x, w[0]) for w in self._weights(name, [(h, a, b)])]

        def rms(dim):
            x = x_of(dim)
            w = torch.ones(dim, device=dev, dtype=torch.bfloat16)
            if hasattr(F, "rms_norm"):
                return [lambda: F.rms_norm(x, (dim,), w, 1e-6)]
            return [lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w]

        if name == "qkv_a":
            return mm(H, m.q_lora + m.kv_lora + m.qk_rope)
        if name == "q_b":
            return mm(m.q_lora, h * (m.qk_nope + m.qk_rope))
        if name == "kv_absorb":
            return bmm(m.qk_nope, m.kv_lora)
        if name == "o_absorb":
            return bmm(m.kv_lora, m.v_head)
        if name == "o_proj":
            return mm(h * m.v_head, H)
        if name == "lm_head":
            return mm(H, m.vocab_gpu)
        if name == "shared":
            return mlp(m.shared_inter_gpu)
        if name == "dense_mlp":
            return mlp(m.dense_inter_gpu)
        if name == "rms_hidden":
            return rms(H)
        if name == "rms_q":
            return rms(m.q_lora)
        if name == "rms_kv":
            return rms(m.kv_lora)
        if name == "draft_qkv":
            return mm(H, (d.heads + 2 * d.kv_heads) // m.tp * d.head_dim)
        if name == "draft_o":
            return mm(d.heads // m.tp * d.head_dim, H)
        if name == "router":
            x = x_of(H)
            bias = torch.zeros(m.experts, device=dev)

            def route(wg):
                scores = torch.sigmoid(torch.matmul(x, wg.t()).float())
                ids = torch.topk(scores + bias, m.top_k, dim=1).indices
                w = scores.gather(1, ids)
                return ids, w / w.sum(dim=1, keepdim=True)
            return [lambda w=w: route(w[0]) for w in self._weights(name, [(m.experts, H)])]
        raise KeyError(name)

    # --- routed MoE --------------------------------------------------------------------------------------

    def moe_prepare(self, allow_compile: bool, seed_dir, prep_s: float) -> None:
        """Marlin INT4 experts at the tp8 shape, or the bf16 grouped fallback (the reason goes in the notes)."""
        import torch

        bmm = _import_bench("bench_marlin_moe")
        m = self.cfg.model
        E, K, N = m.experts, m.hidden, m.moe_inter_gpu
        if m == KIMI and (E, K, N) != tuple(bmm.SHAPES["tp8"]):
            self.notes.append(f"bench_marlin_moe.SHAPES['tp8'] is {bmm.SHAPES['tp8']}, not {(E, K, N)}")
        reason = None
        try:
            if self.device != "cuda":
                raise RuntimeError("no CUDA device")
            from sglang_kdtree.moe import forward as fwd
            from sglang_kdtree.moe import jit
            from sglang_kdtree.moe import weights as mw

            self.alarm.arm(prep_s, "marlin")
            try:
                if not jit.marlin_kernels_cached():
                    if seed_dir is not None:
                        seeded = jit.seed_prebuilt(seed_dir)
                        self.notes.append(f"Marlin JIT modules seeded from {seed_dir}: {seeded or 'none matched'}")
                    if not jit.marlin_kernels_cached() and not allow_compile:
                        raise RuntimeError("Marlin JIT modules are neither cached nor seeded (a compile takes ~6 "
                                           "min; --allow-marlin-compile permits it)")
                took = jit.ensure_marlin_kernels("bfloat16")
                packed = mw.random_packed_weights(E, K, N, device="cuda", seed=1)
                marlin = mw.repack_for_marlin(packed)
                del packed
            finally:
                self.alarm.arm()  # back to the global deadline (raises if it has passed)
            self.moe = ("marlin", marlin, fwd)
            self.extra["moe_path"] = f"Marlin INT4 W4A16 (sglang_kdtree.moe, {fwd.DEFAULT_REDUCE} reduce; " \
                                     f"kernels ready in {took:.1f} s)"
            return
        except DeadlineExceeded as exc:
            if exc.label != "marlin":
                raise
            reason = f"Marlin preparation passed its {prep_s:g} s budget (--marlin-prep-s)"
        except Exception as exc:
            reason = _oneline(exc, 200)
        w13 = torch.randn((E, 2 * N, K), device=self.device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn((E, K, N), device=self.device, dtype=torch.bfloat16) * 0.02
        self.moe = ("bf16", (w13, w2), bmm)
        self.extra["moe_path"] = f"bf16 FALLBACK (Marlin unavailable: {reason}); benchmarks/bench_marlin_moe " \
                                 "bf16 grouped path"
        self.notes.append(f"routed MoE timed on the bf16 fallback, NOT Marlin INT4: {reason}")

    def moe_fns(self, T: int):
        import torch

        bmm = _import_bench("bench_marlin_moe")
        m = self.cfg.model
        gen = torch.Generator(device=self.device)
        gen.manual_seed(7 + T)
        cases = []
        for _ in range(bmm.ROTATE):
            ids = torch.topk(torch.rand((T, m.experts), device=self.device, generator=gen), m.top_k,
                             dim=1).indices.to(torch.int32)
            w = torch.rand((T, m.top_k), device=self.device, generator=gen) + 0.1
            w = w / w.sum(dim=1, keepdim=True)
            x = torch.randn((T, m.hidden), device=self.device, generator=gen).to(torch.bfloat16)
            cases.append((x, ids, w))
        if self.moe is None:
            raise RuntimeError("the routed-MoE weights were not prepared (see 'moe preparation')")
        kind, weights, mod = self.moe
        if kind == "marlin":
            return [lambda c=c: mod.fused_moe_marlin(c[0], weights, c[2], c[1], bmm.FACTOR) for c in cases]
        w13, w2 = weights
        try:
            bmm.bf16_moe_grouped(cases[0][0], cases[0][1], cases[0][2], w13, w2, bmm.FACTOR)
            return [lambda c=c: bmm.bf16_moe_grouped(c[0], c[1], c[2], w13, w2, bmm.FACTOR) for c in cases]
        except DeadlineExceeded:
            raise
        except Exception as exc:
            note = f"torch._grouped_mm unavailable ({type(exc).__name__}); bf16 per-expert loop"
            if note not in self.notes:
                self.notes.append(note)
            plans = [bmm.bf16_moe_loop_plan(c[1]) for c in cases]
            return [lambda c=c, p=p: bmm.bf16_moe_loop(c[0], c[1], c[2], w13, w2, bmm.FACTOR, p)
                    for c, p in zip(cases, plans)]

    # --- attention -----------------------------------------------------------------------------------

    def attention_fns(self, bs: int, width: int, ctx: int):
        import torch

        from sglang_kdtree.gpu import mla_attention as mla

        if self.device == "cuda":
            mla.prepare("cuda")
        m = self.cfg.model
        case_bytes = bs * (ctx + width) * (mla.QK_HEAD_DIM * 2)
        copies = max(1, min(16, math.ceil((128 << 20) / case_bytes)))  # small cases: more than the L2 in all
        fns = []
        for i in range(copies):
            c = mla.synthetic_inputs(bs, width, m.heads_gpu, [ctx] * bs, seed=i, device=self.device, spare_slots=0)
            out = torch.empty((bs * width, m.heads_gpu, mla.KV_LORA_RANK), dtype=torch.bfloat16, device=self.device)
            lse = torch.empty((bs * width, m.heads_gpu), dtype=torch.float32, device=self.device)
            args = (c["q"], c["kv_buffer"], c["kv_indptr"], c["kv_indices"], c["tree_slots"], c["ancestor_bits"],
                    c["sm_scale"])
            fns.append(lambda a=args, o=out, s=lse: mla.mla_tree_verify(*a, out=o, lse=s))
        return fns

    def draft_attention_fns(self, bs: int, ctx: int):
        """The drafter block's attention: ``block`` queries x local heads over ``ctx + block`` keys, unmasked.
        The query heads sharing a KV head are folded into query rows (exact without a mask), so the standard
        SDPA kernels run it with ``kv_heads / tp`` heads."""
        import torch
        import torch.nn.functional as F

        m, d = self.cfg.model, self.cfg.drafter
        hq, hkv = max(1, d.heads // m.tp), max(1, d.kv_heads // m.tp)
        group = max(1, hq // hkv)
        keys = ctx + d.block
        nbytes = 2 * bs * hkv * keys * d.head_dim * 2
        copies = max(1, min(64, math.ceil((128 << 20) / nbytes)))
        fns = []
        for _ in range(copies):
            q = torch.randn((bs, hkv, group * d.block, d.head_dim), device=self.device).to(torch.bfloat16)
            k = torch.randn((bs, hkv, keys, d.head_dim), device=self.device).to(torch.bfloat16)
            v = torch.randn((bs, hkv, keys, d.head_dim), device=self.device).to(torch.bfloat16)
            fns.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
        return fns

    # --- bookkeeping ---------------------------------------------------------------------------------

    def bookkeeping(self, bs: int) -> None:
        rp = _import_bench("round_parts")
        m, d = self.cfg.model, self.cfg.drafter
        out = rp.parts(bs, self.cfg.budget, d.block - 1, m.vocab, 256, m.layers, 0.75)
        # the captured step graphs replayed alone (device time, as in a server whose host runs ahead); the tree
        # graph holds top-K -> tree -> verify inputs (the drafter's head GEMM runs before it, in the draft)
        self.times[key("tree", bs=bs)] = float(out["tree graph replay"])
        self.times[key("accept_commit", bs=bs)] = float(out["accept_commit graph replay"])
        self.extra.setdefault("round_parts", {})[str(bs)] = {k: (float(v) if isinstance(v, (int, float)) else v)
                                                            for k, v in out.items()}
        if out.get("errors"):
            self.notes.append(f"round_parts at batch {bs} reported error bits {out['errors']}")


def _jobs(b: _Bench, batches, contexts, skip_bookkeeping, marlin):
    """(name, callable) in priority order: the linear pieces (cheap), then per batch, largest first (the
    moonshot batch), the routed MoE, attention, bookkeeping and the drafter's attention."""
    cfg = b.cfg
    tokens = needed_tokens(batches, cfg)
    jobs = []
    for T in tokens["verify"]:
        for name in VERIFY_PIECES:
            jobs.append((key(name, T=T), lambda n=name, T=T: b.record(key(n, T=T), b.linear_fns(n, T))))
    for T in tokens["draft"]:
        for name in DRAFT_PIECES:
            if key(name, T=T) not in {j[0] for j in jobs}:
                jobs.append((key(name, T=T), lambda n=name, T=T: b.record(key(n, T=T), b.linear_fns(n, T))))
    for T in tokens["head"]:
        jobs.append((key("lm_head", T=T), lambda T=T: b.record(key("lm_head", T=T), b.linear_fns("lm_head", T))))
    jobs.append(("release linear weights", lambda: (b.weights.clear(), b.free())))
    jobs.append(("moe preparation", lambda: b.moe_prepare(*marlin)))
    for bs in sorted(set(batches), reverse=True):
        for width in sorted(set(cfg.widths.values()), reverse=True):
            T = bs * width
            jobs.append((key("moe", T=T), lambda T=T: b.record(key("moe", T=T), b.moe_fns(T))))
    jobs.append(("release MoE weights", lambda: (setattr(b, "moe", None), b.free())))
    for bs in sorted(set(batches), reverse=True):
        for ctx in contexts:
            for width in sorted(set(cfg.widths.values()), reverse=True):
                k = key("attention", bs=bs, width=width, ctx=ctx)
                jobs.append((k, lambda k=k, bs=bs, w=width, c=ctx: (b.record(k, b.attention_fns(bs, w, c)), b.free())))
        if bs not in skip_bookkeeping:
            jobs.append((f"bookkeeping[bs={bs}]", lambda bs=bs: (b.bookkeeping(bs), b.free())))
        for ctx in contexts:
            k = key("draft_attention", bs=bs, ctx=ctx)
            jobs.append((k, lambda k=k, bs=bs, c=ctx: (b.record(k, b.draft_attention_fns(bs, c)), b.free())))
    return jobs


def measure(cfg: RoundConfig, batches, contexts, deadline_s: float, *, skip_bookkeeping=(), allow_marlin_compile=False,
            marlin_seed=None, marlin_prep_s: float = 45.0, device: str = "cuda", timer=None, log=None) -> dict:
    """Time every piece the rows need, in priority order, each in its own try/except; stop at ``deadline_s``
    (the pieces not reached are listed as skipped). Returns plain data: ``times`` (us by ``key``), ``errors``,
    ``skipped``, ``notes``, ``modes`` (graph / eager), ``device``, ``moe_path``, ``elapsed_s``, ``extra``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    alarm = _Alarm(deadline_s)
    b = _Bench(cfg, device, timer or cuda_graph_us, alarm, log)
    name_dev = device
    jobs, finished = [], set()
    try:
        alarm.arm()
        if device == "cuda":
            import torch

            torch.cuda.init()
            name_dev = torch.cuda.get_device_name()
        jobs = _jobs(b, batches, contexts, set(skip_bookkeeping),
                     (allow_marlin_compile, marlin_seed, marlin_prep_s))
        for i, (name, job) in enumerate(jobs):
            if alarm.left() <= 0:
                b.skipped.extend(n for n, _ in jobs[i:])
                break
            start = time.monotonic()
            try:
                job()
                finished.add(name)
                if time.monotonic() - start > 2:  # only the slow pieces, to keep the log short
                    log(f"[{time.monotonic() - t0:6.1f} s] {name}: {time.monotonic() - start:.1f} s")
            except DeadlineExceeded as exc:
                b.skipped.extend(n for n, _ in jobs[i:])
                log(f"[{time.monotonic() - t0:6.1f} s] {exc.label} reached during {name}; {len(jobs) - i} "
                    "pieces skipped")
                break
            except Exception as exc:  # record and go on
                b.errors[name] = _oneline(exc)
                log(f"[{time.monotonic() - t0:6.1f} s] {name}: FAILED {b.errors[name][:160]}")
                try:
                    b.sync()
                except Exception:
                    pass
    except DeadlineExceeded:  # between pieces (e.g. while logging)
        b.skipped.extend(n for n, _ in jobs if n not in finished and n not in b.errors and n not in b.skipped)
    except Exception as exc:
        b.errors["setup"] = _oneline(exc)
    finally:
        alarm.disarm()
    log(f"[{time.monotonic() - t0:6.1f} s] measured {len(b.times)} pieces, {len(b.errors)} failed, "
        f"{len(b.skipped)} skipped")
    b.skipped = [n for n in b.skipped if not n.startswith("release ")]
    return {"times": b.times, "errors": b.errors, "skipped": b.skipped, "notes": b.notes, "modes": b.modes,
            "device": name_dev, "moe_path": b.extra.get("moe_path"), "elapsed_s": time.monotonic() - t0,
            "deadline_s": deadline_s, "extra": {k: v for k, v in b.extra.items() if k != "moe_path"}}


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


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


def parser(prog: str = "python benchmarks/kimi_round.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes (requests per round)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384], help="context lengths (tokens)")
    p.add_argument("--budget", type=int, default=MOONSHOT_BUDGET, help="KDTREE node budget (verify width budget+1)")
    p.add_argument("--block", type=int, default=16, help="drafter block (DFLASH verify width; draft depth block-1)")
    p.add_argument("--draft-layers", type=int, default=5, help="drafter layers (ASSUMPTION)")
    p.add_argument("--deadline", type=float, default=150.0, help="seconds of GPU measurement; later pieces skipped")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="NVLink bandwidth per direction, GB/s (model)")
    p.add_argument("--allreduce-latency-us", type=float, default=10.0, help="latency per collective call, us")
    p.add_argument("--logits-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="count the all-gather of the vocab-parallel logits")
    p.add_argument("--accept-dflash", type=float, default=PAPER_ACCEPT_DFLASH,
                   help="DFLASH tokens per round (default: DDTree paper, Qwen3-Coder-30B-A3B, T=0 mean)")
    p.add_argument("--accept-kdtree", type=float, default=PAPER_ACCEPT_KDTREE,
                   help="KDTREE tokens per round (default: DDTree paper, best budget, not 64: optimistic)")
    p.add_argument("--bookkeeping-us", nargs="+", default=None, metavar="[BS=]TREE,ACCEPT",
                   help="tree and accept+commit device us instead of measuring them with round_parts.parts()")
    p.add_argument("--marlin-seed", default=None,
                   help="prebuilt Marlin JIT modules to seed SGLang's cache from (default: .dev-carry/jit or "
                        ".jitcache/sm90a when present)")
    p.add_argument("--marlin-prep-s", type=float, default=45.0,
                   help="seconds the Marlin seed/load/repack may take before the bf16 fallback is timed instead")
    p.add_argument("--allow-marlin-compile", action="store_true",
                   help="let an uncached Marlin JIT compile run (~6 min; over the default deadline)")
    p.add_argument("--json", default=None, help="write the measurement and the rows here")
    p.add_argument("--from-json", default=None, help="re-assemble a saved --json measurement (no GPU needed)")
    return p


def main(argv=None, prog: str = "python benchmarks/kimi_round.py") -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.budget < 1 or args.block < 2 or args.draft_layers < 0:
        p.error("--batches, --contexts and --budget must be >= 1, --block >= 2, --draft-layers >= 0")
    if args.nvlink_gbps <= 0 or args.allreduce_latency_us < 0 or args.deadline <= 0:
        p.error("--nvlink-gbps and --deadline must be > 0, --allreduce-latency-us >= 0")
    try:
        overrides = parse_bookkeeping(args.bookkeeping_us)
    except ValueError as exc:
        p.error(str(exc))
    batches, contexts = list(dict.fromkeys(args.batches)), list(dict.fromkeys(args.contexts))
    cfg = RoundConfig(drafter=DrafterShape(layers=args.draft_layers, block=args.block),
                      net=Network(gbps=args.nvlink_gbps, latency_us=args.allreduce_latency_us,
                                  gather_logits=args.logits_gather),
                      budget=args.budget, accept_dflash=args.accept_dflash, accept_kdtree=args.accept_kdtree)
    overridden = [bs for bs in batches if bs in overrides or None in overrides]
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        measured = data.get("measured", data)
    else:
        reason = gpu_reason()
        if reason is not None:
            print(f"kimi_round: measuring the pieces needs a CUDA GPU ({reason}). Re-assemble a saved run "
                  f"without one: --from-json OUT.json (from a GPU run's --json).", file=sys.stderr)
            return 2
        seed = Path(args.marlin_seed) if args.marlin_seed else default_marlin_seed()

        def stop(signum, frame):  # `timeout` sends SIGTERM: the pieces measured so far are still reported
            raise DeadlineExceeded("SIGTERM")

        old_term = _set_sigterm(stop)
        try:
            measured = measure(cfg, batches, contexts, args.deadline, skip_bookkeeping=overridden,
                               allow_marlin_compile=args.allow_marlin_compile, marlin_seed=seed,
                               marlin_prep_s=args.marlin_prep_s)
        finally:
            _set_sigterm(signal.SIG_IGN)  # measuring is over: a late SIGTERM must not cut the report short
        try:
            return _finish(args, cfg, measured, overrides, batches, contexts)
        finally:
            _set_sigterm(old_term)
    return _finish(args, cfg, measured, overrides, batches, contexts)


def _set_sigterm(handler):
    """Install ``handler`` for SIGTERM; returns the previous one (None where signals cannot be set here)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _finish(args, cfg, measured, overrides, batches, contexts) -> int:
    """Overrides, report, JSON. The measurement is saved before the report and printed raw should the
    report itself fail, so one GPU run is never lost."""
    measured = dict(measured)
    measured["times"] = dict(measured.get("times", {}))
    measured["notes"] = list(measured.get("notes", []))
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
    try:
        result = report(measured, cfg, batches, contexts)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        print(f"kimi_round: the report failed ({_oneline(exc)}); the measured pieces (us):")
        for k, v in sorted(measured["times"].items()):
            print(f"{k} {v:.2f}")
        return 1
    payload.update(rows=result["rows"], moonshot=result["moonshot"])
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
