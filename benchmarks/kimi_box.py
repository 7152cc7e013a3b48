"""Device profiles ("boxes") for the Kimi round model and the pricing of the pieces measured on one H200 for another
box. ``kimi_round.py --box rtx-pro-6000`` turns the H200 measurement into an ESTIMATE for 8x RTX PRO 6000 Blackwell
Server Edition (sm_120, PCIe, no NVLink); nothing is measured on that card here.

Pricing (one rule for every piece): a piece's bytes B and FLOPs F follow from its shapes (``piece_work``), its
roofline on a box is R = max(B / bandwidth, F / bf16 rate), and its H200 time t_H200 becomes, by ``--price-rule``:

    excess (default):  t_box = t_H200 + R_box - R_H200
    ratio:             t_box = t_H200 x R_box / R_H200

Both reprice the work at the box's rates: memory-bound work costs 4,800 / 1,792 = 2.68x, compute-bound 784 / 417
= 1.88x. They differ in the H200 time above its roofline (launch gaps, small-kernel floors, Marlin's glue): "excess"
keeps it in microseconds, "ratio" scales it too. Most pieces at a few tokens are mostly that excess (an RMSNorm
over 7168 values: 6.7 us against a 0.01 us roofline), so "ratio" is the pessimistic side: checked against the
published serving figures on these cards, its forward times come out 1.7-2.7x theirs and "excess"'s 1.0-1.6x
(RESULTS, "8x RTX PRO 6000 (estimate)"). A piece without a shape model (the tree and accept+commit bookkeeping:
many small kernels) scales by the bandwidth ratio under either rule. Bandwidth is spec against spec (no measured
GDDR7 figure was found); bf16 is measured against measured (cuBLAS-class matmul on each card).

Collectives: the H200 box keeps ``kimi_model``'s ring model (NVLink, 450 GB/s + 10 us). The RTX box prices each
all-reduce from a table of published NCCL times on 8 of these cards, linear in message bytes between its points
(``table_us``): custom all-reduce is off for more than two PCIe-only GPUs in SGLang, so TP 8 runs NCCL. A logits
all-gather whose result is S bytes is priced as an all-reduce of S / 2 (a ring moves the same bytes per GPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import math

from benchmarks.kimi_model import AUTO, DrafterShape, ModelShape, Network, RoundConfig
from benchmarks.marlin_moe_report import expert_bytes, moe_flops

ESTIMATE_LABEL = "ESTIMATE (no RTX PRO 6000 measured: H200 pieces repriced at the box's bandwidth and bf16 rate)"
SM120_NOTES = "shared/notes/sm120.md"
RTX6KPRO_PCIE = "voipmonitor/rtx6kpro hardware/pcie-bandwidth.md"

# ---- collectives priced from measured points ----------------------------------------------------------------


def table_us(points, nbytes: float) -> float:
    """Microseconds for a message of ``nbytes`` from ``points`` ``((bytes, us, source), ...)`` sorted by bytes:
    linear in bytes between two points, the first point's time below it (small messages cost the NCCL launch and
    handshake, not bytes), the last segment's slope beyond the last point (bandwidth-bound there)."""
    if not points:
        raise ValueError("a collective table needs at least one (bytes, us, source) point")
    if nbytes <= points[0][0] or len(points) == 1:
        return float(points[0][1])
    i = next((j for j in range(1, len(points)) if nbytes <= points[j][0]), len(points) - 1)
    (b0, t0, _), (b1, t1, _) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)


@dataclasses.dataclass(frozen=True)
class TableNetwork(Network):
    """Collectives priced from ``points`` (an all-reduce of B bytes: ``table_us(points, B)``; an all-gather whose
    result is S bytes: an all-reduce of S / 2). ``gbps`` / ``latency_us`` are unused."""

    points: tuple = ()
    name: str = ""

    def collective_us(self, nbytes: float, n_gpus: int, gather: bool = False) -> float:
        if n_gpus <= 1:
            return 0.0
        return table_us(self.points, nbytes / 2 if gather else nbytes)


def collectives_text(net: TableNetwork, m: ModelShape, d: DrafterShape) -> str:
    """``kimi_round``'s assumption line for a box whose collectives come from a table."""
    pts = ", ".join(f"{b:,} B {t:.1f} us" for b, t, _ in net.points)
    return (f"collectives (PUBLISHED TIMES, {net.name}): each all-reduce from the table {pts}, linear in message "
            f"bytes between points, the last slope beyond; {2 * m.layers + 1} per target forward and "
            f"{2 * d.layers + 1} per draft forward of T x {m.hidden} x {net.act_bytes} B; "
            + ("the logits all-gather of S bytes priced as an all-reduce of S / 2" if net.gather_logits
               else "no logits all-gather (--no-logits-gather)"))


def _busbw_point(nbytes: int, busbw_gbps: float, n_gpus: int, source: str) -> tuple:
    """nccl-tests reports bus bandwidth = algbw x 2(n-1)/n, so an all-reduce of ``nbytes`` takes
    2(n-1)/n x bytes / busbw."""
    return nbytes, 2 * (n_gpus - 1) / n_gpus * nbytes / (busbw_gbps * 1e3), source


#: Default NCCL all-reduce on 8x RTX PRO 6000 (bf16 message bytes -> us). Small messages: nccl-tests on luke's 8
#: cards behind PCIe switches (24-25 us, the upper end of the 17-25 us the notes give up to 64 KB); 256 / 512 KiB:
#: PyNCCL on a Kimi host (its slope between them, 21 us per 256 KiB, is a bus bandwidth of 21.8 GB/s); 32 MiB:
#: default NCCL on a dual-Turin 8-card box at 22.2 GB/s bus bandwidth (tuned NCCL_MIN_NCHANNELS=8 boxes reach
#: 37.6-41.1 GB/s: bandwidth-bound messages are priced at the default).
NCCL_PCIE_8 = (
    (1_024, 24.1, f"nccl-tests, 8 cards on PCIe switches (luke), {RTX6KPRO_PCIE}"),
    (8_192, 24.2, f"nccl-tests, 8 cards on PCIe switches (luke), {RTX6KPRO_PCIE}"),
    (32_768, 24.5, f"nccl-tests, 8 cards on PCIe switches (luke), {RTX6KPRO_PCIE}"),
    (65_536, 24.1, f"nccl-tests, 8 cards on PCIe switches (luke), {RTX6KPRO_PCIE}"),
    (262_144, 39.0, f"PyNCCL on a Kimi host, rtx6kpro hardware pages ({SM120_NOTES}); nccl-tests: 25-28 us"),
    (524_288, 60.0, f"PyNCCL on a Kimi host, rtx6kpro hardware pages ({SM120_NOTES})"),
    _busbw_point(32 << 20, 22.2, 8, f"nccl-tests default config, 32 MiB, bus bandwidth 22.2 GB/s on a dual-Turin "
                                    f"8-card box (Festr), {RTX6KPRO_PCIE}"),
)
#: The opt-in FlashInfer PCIe IPC all-reduce (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1) up to 384 KiB, NCCL above (its
#: workspace is sized from the draft tokens x the CUDA-graph batch; a wider message falls back to NCCL).
IPC_PCIE_8 = (
    (12_288, 5.3, "FlashInfer PCIe IPC all-reduce, bf16, one 8x sm_120 host (sglang#34528)"),
    (98_304, 15.3, "FlashInfer PCIe IPC all-reduce, bf16, one 8x sm_120 host (sglang#34528)"),
    (393_216, 34.6, "FlashInfer PCIe IPC all-reduce, bf16, one 8x sm_120 host (sglang#34528)"),
    *NCCL_PCIE_8[5:],
)

# ---- the boxes ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Box:
    """One 8-GPU box: per-GPU memory bandwidth (GB/s) and dense bf16 rate (TFLOP/s), SMs, its collectives, and
    ``sources``: (figure, source) lines. ``device`` is what a measurement's device string holds on this box."""

    name: str
    label: str
    device: str
    mem_gbps: float
    bf16_tflops: float
    sms: int
    memory_gb: float
    net: Network
    sources: tuple


H200_SOURCES = (
    ("4,800 GB/s HBM3e", "NVIDIA H200 SXM datasheet (spec; this project's 1 GiB copies reach 4.14-4.22 TB/s)"),
    ("784 TFLOP/s dense bf16", "cuBLAS bf16 matmul measured on the project's H200 (777-802 TFLOP/s across runs, "
                               "benchmarks/RESULTS-archive.md)"),
    ("132 SMs, 141 GB", "NVIDIA spec"),
    ("NVLink: ring all-reduce 2(n-1)/n x bytes / 450 GB/s + 10 us", "kimi_round's model (--nvlink-gbps, "
                                                                     "--allreduce-latency-us)"),
)
RTX_SOURCES = (
    ("1,792 GB/s GDDR7, 96 GB", f"NVIDIA spec (no measured figure found; {SM120_NOTES})"),
    ("417 TFLOP/s dense bf16 (spec 503.8)", f"measured at 8192^3, community wiki local-inference-lab/rtx6kpro "
                                            f"({SM120_NOTES})"),
    ("188 SMs", "NVIDIA spec"),
    ("PCIe Gen5, no NVLink; SGLang's custom all-reduce off for > 2 PCIe-only GPUs, so TP 8 runs NCCL",
     f"SGLang 0.5.23 custom_all_reduce_utils.py ({SM120_NOTES})"),
)
BOXES = {
    "h200": Box("h200", "8x NVIDIA H200 (NVLink)", "H200", 4800.0, 784.0, 132, 141.0, Network(),
                H200_SOURCES),
    "rtx-pro-6000": Box("rtx-pro-6000", "8x RTX PRO 6000 Blackwell Server Edition (PCIe, NCCL)",
                        "RTX PRO 6000", 1792.0, 417.0, 188, 96.0, TableNetwork(points=NCCL_PCIE_8, name="NCCL"),
                        RTX_SOURCES),
    "rtx-pro-6000-pcie-ipc": Box("rtx-pro-6000-pcie-ipc",
                                 "8x RTX PRO 6000 Blackwell Server Edition (PCIe, IPC all-reduce)", "RTX PRO 6000",
                                 1792.0, 417.0, 188, 96.0,
                                 TableNetwork(points=IPC_PCIE_8, name="PCIe IPC (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1)"),
                                 RTX_SOURCES + (("PCIe IPC all-reduce up to 384 KiB (its workspace assumed to hold "
                                                 "every such message), NCCL above", "sglang#34528, SGLang 0.5.23 "
                                                 f"({SM120_NOTES})"),)),
}
REFERENCE = "h200"  # the box the saved pieces were measured on

# ---- pricing one piece -----------------------------------------------------------------------------------------


def parse_key(k: str) -> tuple[str, dict]:
    """``kimi_model.key``'s inverse: ``"moe[T=8]"`` -> ``("moe", {"T": 8})``."""
    name, _, rest = k.partition("[")
    dims = dict(part.split("=") for part in rest.rstrip("]").split(",") if part)
    return name, {d: int(v) for d, v in dims.items()}


def piece_work(name: str, dims: dict, m: ModelShape, d: DrafterShape) -> tuple[float, float] | None:
    """(bytes read and written, FLOPs) of one call of a measured piece at Kimi's per-GPU shapes (bf16 unless said),
    as ``kimi_measure`` times it; None for the bookkeeping (no shape model; priced as memory-bound)."""
    H, h, e, T = m.hidden, m.heads_gpu, 2, dims.get("T")
    linear = {"qkv_a": (H, m.q_lora + m.kv_lora + m.qk_rope), "q_b": (m.q_lora, h * (m.qk_nope + m.qk_rope)),
              "o_proj": (h * m.v_head, H), "lm_head": (H, m.vocab_gpu), "router": (H, m.experts),
              "draft_qkv": (H, (d.heads + 2 * d.kv_heads) // m.tp * d.head_dim),
              "draft_o": (d.heads // m.tp * d.head_dim, H),
              "kv_absorb": (m.qk_nope, m.kv_lora), "o_absorb": (m.kv_lora, m.v_head)}
    if name in linear:  # x[T, k] @ w[k, n]; the absorbed kv_b halves once per local head
        k, n = linear[name]
        g = h if name in ("kv_absorb", "o_absorb") else 1
        return e * g * (k * n + T * k + T * n), 2.0 * g * T * k * n
    if name in ("shared", "dense_mlp"):  # gate|up (H -> 2i) and down (i -> H)
        i = m.shared_inter_gpu if name == "shared" else m.dense_inter_gpu
        return e * (3 * i * H + 2 * T * H + 3 * T * i), 2.0 * T * 3 * i * H
    if name in ("rms_hidden", "rms_q", "rms_kv"):
        dim = {"rms_hidden": H, "rms_q": m.q_lora, "rms_kv": m.kv_lora}[name]
        return e * 2 * T * dim, 4.0 * T * dim
    if name == "moe":  # INT4 g32 experts; uniform routing touches E (1 - (1 - k/E)^T) of them, as measured
        touched = m.experts * (1 - (1 - m.top_k / m.experts) ** T)
        return (touched * expert_bytes(H, m.moe_inter_gpu) + e * 2 * T * H,
                moe_flops(T, m.top_k, H, m.moe_inter_gpu))
    if name == "attention":  # absorbed MLA: latent 512 + rope 64 keys, values the 512 latent, 8 heads per GPU
        bs, w, keys = dims["bs"], dims["width"], dims["ctx"] + dims["width"]
        qk, v = m.kv_lora + m.qk_rope, m.kv_lora
        return e * bs * (keys * qk + w * h * (qk + v)), 2.0 * bs * h * w * keys * (qk + v)
    if name == "draft_attention":  # GQA: 8 query / 1 KV heads per GPU, the block attending context + block
        bs, keys = dims["bs"], dims["ctx"] + d.block
        qh, kvh = d.heads // m.tp, max(1, d.kv_heads // m.tp)
        return (e * bs * (2 * keys * kvh * d.head_dim + 2 * d.block * qh * d.head_dim),
                2.0 * bs * qh * d.block * keys * 2 * d.head_dim)
    return None


def roofline_us(nbytes: float, flops: float, box: Box) -> float:
    """max(bytes / bandwidth, FLOPs / bf16 rate) on ``box``, us."""
    return max(nbytes / (box.mem_gbps * 1e3), flops / (box.bf16_tflops * 1e6))


#: How a piece's H200 time becomes the box's, with R(box) = max(B / bandwidth, F / bf16 rate) the piece's roofline:
#: "excess" keeps the H200 time above its roofline (launch gaps, small-kernel floors, inefficiency) in microseconds
#: and reprices the roofline part; "ratio" scales the whole H200 time by R(box) / R(H200).
RULES = {
    "excess": "t_box = t_H200 + R_box - R_H200",
    "ratio": "t_box = t_H200 x R_box / R_H200",
}
DEFAULT_RULE = "excess"


def price_piece(k: str, t: float, cfg: RoundConfig, ref: Box, box: Box, rule: str = DEFAULT_RULE) -> float:
    """The box's time for the piece ``k`` that took ``t`` us on ``ref``, by ``rule`` (``RULES``); a piece without a
    shape model (the bookkeeping) scales by the bandwidth ratio under either rule."""
    name, dims = parse_key(k)
    if "excess" in name:  # a served rank's time above the model's pieces (kimi_served.py): an excess like any other
        return t if rule == "excess" else t * ref.mem_gbps / box.mem_gbps
    work = piece_work(name, dims, cfg.model, cfg.drafter)
    if work is None or roofline_us(*work, ref) <= 0:
        return t * ref.mem_gbps / box.mem_gbps
    if rule == "ratio":
        return t * roofline_us(*work, box) / roofline_us(*work, ref)
    if rule == "excess":
        return t + roofline_us(*work, box) - roofline_us(*work, ref)
    raise ValueError(f"unknown pricing rule {rule!r}; one of {', '.join(RULES)}")


def price_times(times: dict, cfg: RoundConfig, ref: Box, box: Box, rule: str = DEFAULT_RULE) -> tuple[dict, dict]:
    """(every finite piece time priced for ``box``, box time / H200 time per key)."""
    priced = {k: price_piece(k, v, cfg, ref, box, rule) for k, v in times.items()
              if isinstance(v, (int, float)) and math.isfinite(v)}
    return priced, {k: v / times[k] if times[k] > 0 else 1.0 for k, v in priced.items()}


def ratio_ranges(ratios: dict) -> dict:
    """Per piece name, the [lowest, highest] box / H200 time over its keys."""
    out: dict = {}
    for k, r in ratios.items():
        lo, hi = out.get(parse_key(k)[0], (r, r))
        out[parse_key(k)[0]] = (min(lo, r), max(hi, r))
    return {n: [round(lo, 3), round(hi, 3)] for n, (lo, hi) in sorted(out.items())}


# ---- the estimate -----------------------------------------------------------------------------------------------

#: Kimi K2.6's INT4 experts plus bf16 dense weights per card at TP 8 (an estimate, SM120_NOTES) and the largest
#: --mem-fraction-static stock SGLang ran it at on these cards (soulmachine/skills llm-inference-benchmark).
WEIGHTS_GB = 74.0
MEM_FRACTION = 0.85


def kv_gb(bs: int, ctx: int, m: ModelShape) -> float:
    """Latent KV of ``bs`` requests at ``ctx`` tokens on one card: MLA's cache is not split by TP (every rank holds
    the 512 + 64 latent of every token in every layer, bf16)."""
    return bs * ctx * (m.kv_lora + m.qk_rope) * 2 * m.layers / 1e9


def kv_room_gb(box: Box) -> tuple[float, float]:
    """The KV room per card, GB: (card memory read as decimal GB, read as GiB) x MEM_FRACTION - WEIGHTS_GB; which
    one the card reports is not settled here (the BAR1 of an RTX PRO 6000 is 98,304 MiB, RTX6KPRO_PCIE)."""
    return tuple(round(MEM_FRACTION * box.memory_gb * unit - WEIGHTS_GB, 2) for unit in (1.0, 2 ** 30 / 1e9))


def kv_fit(batches, contexts, m: ModelShape, box: Box) -> dict:
    """The KV room per card (GB, ``kv_room_gb``) and per ``"ctx,bs"`` the cell's KV (GB) and whether it fits: "yes"
    within the smaller room, "marginal" within the larger only, "no" over both."""
    low, high = kv_room_gb(box)

    def fits(gb):
        return "yes" if gb <= low else "marginal" if gb <= high else "no"
    return {"room_gb": [low, high], "cells": {f"{ctx},{bs}": {"kv_gb": round(kv_gb(bs, ctx, m), 2),
                                                               "fits": fits(kv_gb(bs, ctx, m))}
                                              for ctx in contexts for bs in batches}}


def assumptions(box: Box, ref: Box, ratios: dict, rule: str) -> list[str]:
    bw, fl = ref.mem_gbps / box.mem_gbps, ref.bf16_tflops / box.bf16_tflops
    rng = ratio_ranges(ratios)
    moe, att = rng.get("moe", ["n/a"] * 2), rng.get("attention", ["n/a"] * 2)
    roof = (f"R = max(B / bandwidth, F / bf16 rate), B and F the piece's bytes and FLOPs from its shapes; bandwidth "
            f"{box.mem_gbps:g} against {ref.mem_gbps:g} GB/s (spec against spec: x{bw:.3f} for memory-bound "
            f"work), bf16 {box.bf16_tflops:g} against {ref.bf16_tflops:g} TFLOP/s (measured against measured: "
            f"x{fl:.3f} for compute-bound work)")
    why = {"excess": "the H200 time above its roofline (launch gaps, small-kernel floors such as the 2-7 us "
                     "RMSNorms, Marlin's glue) is taken to cost the same microseconds on the box; optimistic where "
                     "that excess is inefficiency that grows with the work (Marlin at 21 % of its weight floor at "
                     "2,080 tokens, RESULTS 'Marlin W4A16 MoE')",
           "ratio": "the ratio scales the H200's fixed costs too (launch gaps, small-kernel floors: the RMSNorms "
                    "take 2-7 us on the H200): pessimistic for the many small pieces, most at batch 1"}[rule]
    return [
        f"{ESTIMATE_LABEL}: every piece was timed on one H200 ({ref.label}) and priced for {box.label}",
        f"pricing rule '{rule}': {RULES[rule]}, {roof}; the box / H200 time that gave: MoE x{moe[0]}-{moe[1]}, "
        f"attention x{att[0]}-{att[1]} (every piece: 'box / H200 time per piece'); the other rule: "
        + "; ".join(f"'{r}' {f}" for r, f in RULES.items() if r != rule),
        why,
        "Marlin INT4 runs mma.sync on both cards and stays well below wgmma's rate on the H200, so repricing "
        "compute-bound MoE (large T) at the cuBLAS-class bf16 rates is pessimistic for the box",
        "attention is the wgmma MLA tree-verify kernel's H200 time repriced; sm_120 has no wgmma, and the kernel it "
        "runs (mma_compact) took 1.7-4.8x wgmma's time on the same H200 (RESULTS, 'MLA tree verify for sm_120'): "
        "optimistic, most for wide verifies at 16k and large batches",
        "bookkeeping (tree, accept+commit) priced at the bandwidth ratio; on sm_120 the accept kernels spill "
        f"registers ({SM120_NOTES})",
        f"collectives: {box.net.name if isinstance(box.net, TableNetwork) else 'ring model'} table interpolated "
        "linearly on message bytes (first point's time below it, last slope beyond), 2 all-reduces per layer + "
        "1 for the embedding per forward of T x 14,336 B; the logits all-gather of S bytes priced as an "
        "all-reduce of S / 2; no overlap of collectives with compute",
        "no host time, sampling, scheduling or overlap (the published serving figures include them)",
        f"memory: {WEIGHTS_GB:g} GB of weights per card (an estimate) and --mem-fraction-static {MEM_FRACTION} "
        f"({SM120_NOTES}) leave {kv_room_gb(box)[0]:g}-{kv_room_gb(box)[1]:g} GB per card for the latent KV "
        "(70,272 B per token, on every rank): a cell over it would not hold its batch at that context",
    ]


def estimate(measured: dict, cfg: RoundConfig, box_name: str, rule: str = DEFAULT_RULE
             ) -> tuple[dict, RoundConfig, dict]:
    """(the measurement with its pieces priced for ``box_name`` by ``rule``, the config with the box's
    collectives, the estimate's record for the JSON). ValueError when the pieces were not measured on the
    reference box."""
    box, ref = BOXES[box_name], BOXES[REFERENCE]
    device = str(measured.get("device", ""))
    if ref.device not in device:
        raise ValueError(f"--box {box_name} prices pieces measured on an {ref.device}; this measurement's device "
                         f"is {device or 'unknown'!r}: measure on an {ref.device} or drop --box")
    priced, ratios = price_times(measured.get("times", {}), cfg, ref, box, rule)
    net = dataclasses.replace(box.net, gather_logits=cfg.net.gather_logits, act_bytes=cfg.net.act_bytes)
    out = dict(measured, times=priced, device=f"none: {ESTIMATE_LABEL}, for {box.label}, from pieces measured "
                                              f"on {device}")
    info = {"estimate": True, "label": ESTIMATE_LABEL, "box": box.name, "box_label": box.label,
            "reference_box": ref.name, "reference_device": device, "date": datetime.date.today().isoformat(),
            "profile": dataclasses.asdict(box), "reference_profile": dataclasses.asdict(ref),
            "rule": rule, "rule_formula": RULES[rule], "ratios": ratio_ranges(ratios),
            "assumptions": assumptions(box, ref, ratios, rule), "priced_times": priced}
    return out, dataclasses.replace(cfg, net=net), info


# ---- beside the published figures ---------------------------------------------------------------------------

PUBLISHED = {
    "ar_batch1": (("stock SGLang 0.5.12, triton MLA, NCCL (TPOT 14.9 ms)", 1e3 / 14.9,
                   "soulmachine/skills llm-inference-benchmark/REFERENCE.md"),
                  ("tuned vLLM, TRITON_MLA", 92.4, "rtx6kpro kimi-k26-v4.md")),
    "forward_ms": {1: 10.8, 8: 22.8, 16: 25.2, 32: 33.4, 64: 42.7, 128: 57.6},
    "forward_source": "tuned vLLM's concurrency sweep on Kimi K2.6 INT4 (rtx6kpro kimi-k26-v4.md): time per "
                      f"decode step at N requests ({SM120_NOTES}); its context length is not stated",
    "batch_tok_s": (("tuned vLLM", {8: 351, 32: 958, 64: 1497}, "rtx6kpro kimi-k26-v4.md"),
                    ("stock SGLang 0.5.12", {8: 197, 64: 368}, "soulmachine/skills llm-inference-benchmark")),
    "speculative_batch1": (("EAGLE3 chain of 3, tuned vLLM", "122-144", "rtx6kpro kimi-k26-v4.md, -v8.md"),
                           ("DFlash 7 tokens, Kimi K2.7-Code", "139", "rtx6kpro kimi-k27-code_v3.md")),
}


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b and math.isfinite(a) else None


def _forward_row(by: dict, n: int, ctx: int) -> tuple[dict | None, str | None]:
    """The grid's forward of ``n`` tokens at ``ctx``: AR at ``n`` requests, else DFLASH's verify of ``n`` rows (its
    block per request), whose attention reads fewer contexts than ``n`` requests would."""
    if ("AR", n, ctx) in by:
        return by[("AR", n, ctx)], f"AR, {n} request(s) x 1 row"
    dflash = [r for (mode, _, c), r in by.items() if mode == "DFLASH" and c == ctx and r["bs"] * r["width"] == n]
    if dflash:
        return dflash[0], f"DFLASH verify, {dflash[0]['bs']} request(s) x {dflash[0]['width']} rows"
    return None, None


def published_block(rows: list[dict]) -> dict:
    """The model beside the published serving figures: AR tokens/s at batch 1 (every context), the verify forward's
    time by tokens per forward at the shortest context (``_forward_row``), AR tokens/s for the batch, and batch 1
    speculative rates."""
    by = {(r["mode"], r["bs"], r["ctx"]): r for r in rows}
    ctxs = sorted({r["ctx"] for r in rows})
    ar1 = []
    for c in ctxs:
        if ("AR", 1, c) in by:
            model = by[("AR", 1, c)]["tok_s"]
            ar1.append({"ctx": c, "model": model, "vs": [
                {"what": w, "published": v, "source": s, "model_over_published": _ratio(model, v)}
                for w, v, s in PUBLISHED["ar_batch1"]]})
    forward = []
    for n, ms in PUBLISHED["forward_ms"].items():
        row, shape = _forward_row(by, n, ctxs[0]) if ctxs else (None, None)
        if row is not None:
            model = row["verify"] / 1e3
            forward.append({"tokens": n, "shape": shape, "ctx": ctxs[0], "model_ms": model, "published_ms": ms,
                            "model_over_published": _ratio(model, ms)})
    batch = [{"bs": bs, "ctx": c, "model": by[("AR", bs, c)]["tok_s_batch"],
              "published": {w: v.get(bs) for w, v, _ in PUBLISHED["batch_tok_s"]}}
             for c in ctxs for bs in (8, 32, 64) if ("AR", bs, c) in by]
    spec = [{"ctx": c, "DFLASH": by[("DFLASH", 1, c)]["tok_s"], AUTO: by[(AUTO, 1, c)]["tok_s"]}
            for c in ctxs if ("DFLASH", 1, c) in by and (AUTO, 1, c) in by]
    return {"ar_batch1": ar1, "forward": forward, "forward_source": PUBLISHED["forward_source"], "batch": batch,
            "speculative_batch1": spec, "sources": PUBLISHED}


def _n(v) -> str:
    return "n/a" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def format_estimate(info: dict) -> str:
    """The estimate's profile, collectives table, ratios, memory, the published comparison and its assumptions."""
    p, lines = info["profile"], [f"\n## {info['label']}: {info['box_label']} ({info['date']})", "", "box profile:"]
    lines += [f"- {what}: {src}" for what, src in p["sources"]]
    pts = p["net"].get("points") or []
    if pts:
        lines += ["", "all-reduce table (message bytes -> us; Kimi sends T x 14,336 B):"]
        lines += [f"- {b:,} B: {t:.1f} us ({src})" for b, t, src in pts]
    lines += ["", "box / H200 time per piece: " + "; ".join(
        f"{n} {lo}-{hi}" if lo != hi else f"{n} {lo}" for n, (lo, hi) in info["ratios"].items())]
    kv = info.get("kv")
    if kv:
        lines.append(f"\nKV room per card {kv['room_gb'][0]}-{kv['room_gb'][1]} GB; KV per card by (ctx,batch): "
                     + ", ".join(f"{k} {c['kv_gb']} GB ({c['fits']})" for k, c in kv["cells"].items()))
    pub = info.get("published")
    if pub:
        lines += ["", "beside the published figures (model / published):"]
        for a in pub["ar_batch1"]:
            lines += [f"- AR batch 1, ctx {a['ctx']}: {_n(a['model'])} tok/s vs {_n(v['published'])} ({v['what']}): "
                      f"{v['model_over_published']}x" for v in a["vs"]]
        lines += [f"- forward of {f['tokens']} tokens ({f['shape']}, ctx {f['ctx']}): {f['model_ms']:.1f} ms vs "
                  f"{f['published_ms']} ms: {f['model_over_published']}x" for f in pub["forward"]]
        lines.append(f"  (forward times: {pub['forward_source']})")
        lines += [f"- AR batch {b['bs']}, ctx {b['ctx']}: {_n(b['model'])} tok/s for the batch vs "
                  + ", ".join(f"{w} {v}" for w, v in b["published"].items() if v) for b in pub["batch"]]
        others = "; ".join(f"{w} {v}" for w, v, _ in PUBLISHED["speculative_batch1"])
        lines += [f"- batch 1, ctx {s['ctx']}: DFLASH {_n(s['DFLASH'])}, KDTREE-auto {_n(s[AUTO])} tok/s vs {others}"
                  for s in pub["speculative_batch1"]]
    lines += ["", "estimate assumptions:"] + [f"- {a}" for a in info["assumptions"]]
    return "\n".join(lines)
