"""One GPU's share of Kimi K2.6 at TP 8 (a "rank"), as configs that SGLang serves with random weights.

    python -m testbed.kimi_rank --out DIR [--layers 34|auto] [--vocab 163840] [--max-positions 32768]
    python -m testbed.kimi_rank --out DIR --tiny-for-cpu          (4 layers, vocab 4096: the CPU test's build)
    python -m testbed.kimi_rank --estimate [--gpu-gib 78]         (memory by layer count, nothing written)

writes ``DIR/target`` (``DeepseekV3ForCausalLM``), ``DIR/drafter`` (``DFlashDraftModel``), a WordLevel tokenizer
covering every id in both, and ``DIR/RANK_MANIFEST.json`` (shapes, the memory estimate, the serving flags). No
weights: the servers start with ``--load-format dummy`` (SGLang fills every floating-point parameter with
uniform(-1e-3, 1e-3), leaves the packed INT4 codes as allocated, then runs the Marlin repack), so a build takes
seconds and 61 layers need no 75 GiB checkpoint on a 64 GiB disk.

Shapes are ``benchmarks.kimi_model``'s, so the rank's rounds compare cell for cell with ``kimi_round``'s
prediction: the target is ``KIMI`` per GPU at TP 8 (hidden 7168; MLA with 64 / 8 = 8 heads, q_lora 1536,
kv_lora 512 + rope 64, nope 128, v 128; 384 routed experts, top 8, intermediate 2048 / 8 = 256, INT4 symmetric
group 32 in compressed-tensors ``pack-quantized`` form as Kimi K2 Thinking ships it (``make_kimi_model``'s
``QUANTIZATION_CONFIG``); one shared expert of 256; the first layer dense, MLP 18432 / 8 = 2304), and the drafter
is ``DrafterShape`` per GPU (5 layers at hidden 7168, 64 / 8 = 8 query and 8 / 8 = 1 KV heads of 128, SwiGLU 2304,
block 16, context from 5 target layers by SGLang's own spacing).

Two differences from a TP 8 rank, by construction: no collectives (add them from the model), and the vocabulary is
whole (163,840): the server holds full-vocabulary logits and KDTREE's top-K reads all of them, as every rank does
after SGLang's logits all-gather, but the target's lm_head and the drafter's head are GEMMs over all 163,840 rows,
8x a rank's slice (about 2.35 GB of bf16 per call). Compare the head with ``kimi_round``'s ``lm_head`` piece at
vocab 163,840, not 20,480.

Random weights route nearly every token to the same 8 experts (the router's correction bias, uniform +-1e-3,
dwarfs the spread of its logits), so the servers run with ``SGLANG_SIMULATE_UNIFORM_EXPERTS=1`` (SGLang's
benchmark override: uniform random top-8 per token), which is what ``kimi_measure`` times.
``benchmarks/bench_rank.py`` serves the rank; ``device/device_rank.sh`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "tests" / "e2e"

GIB = 2 ** 30
TARGET_DIR, DRAFT_DIR, MANIFEST = "target", "drafter", "RANK_MANIFEST.json"
#: the H100's usable memory as the device tool states it, and the layer count chosen to fit it (``estimate``:
#: 34 layers leave 5 GiB of it free with KV for batch 32 at context 4k and verify tiers 16 / 32 / 64; 40 layers
#: with those tiers ran out of memory on the H100)
H100_GIB = 78.0
DEFAULT_LAYERS = 34
#: the environment every rank server runs with (plain, DFLASH and KDTREE alike)
SERVER_ENV = {"SGLANG_KDTREE_MOE": "marlin", "SGLANG_SIMULATE_UNIFORM_EXPERTS": "1"}
SERVER_FLAGS = ("--load-format", "dummy")
#: verify-graph memory per verify row (batch x width), measured on this rank (40 layers, batches 1 / 8 / 32 captured,
#: one H100): SGLang's own verify graphs 9.99 GB at width 64 (4.9 MB a row) and 4.85 GB at 32; the extra tiers
#: 2.2 GB at 16 and 4.4 GB at 32 (4.3 MB a row). Mostly full-vocabulary logits and the routed experts'
#: activations, so independent of the layers (a graph's pool is reused layer after layer); the largest batch's
#: graphs set the pool.
VERIFY_ROW_BYTES = 4.9e6
#: what the estimate adds beyond weights, KV, verify graphs and the round's buffers (GiB): CUDA context and cuBLAS
#: workspaces; SGLang's decode-graph pool (1.57 GB at run AB); prefill activations at an 8,192-token chunk with the
#: drafter's captured features
OVERHEAD_GIB = {"cuda_context": 1.0, "decode_graph_pool": 1.5, "prefill_activations": 2.0}


@dataclasses.dataclass(frozen=True)
class RankShape:
    """The target and drafter of one rank; ``from_kimi_model`` fills it from ``benchmarks.kimi_model``'s shapes at
    TP 8, the one place they are stated."""

    layers: int
    dense_layers: int
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    experts: int
    top_k: int
    moe_inter: int
    shared_experts: int
    dense_inter: int
    vocab: int
    max_positions: int
    draft_layers: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_inter: int
    block: int
    group: int = 32  # INT4 quantisation group (Kimi K2.6's checkpoint)

    def __post_init__(self):
        if not self.dense_layers < self.layers:
            raise ValueError(f"--layers {self.layers}: a rank needs at least one MoE layer after "
                             f"{self.dense_layers} dense one(s)")


def from_kimi_model(layers: int = DEFAULT_LAYERS, vocab: int | None = None, max_positions: int = 32_768) -> RankShape:
    """The rank of ``benchmarks.kimi_model``'s ``KIMI`` and ``DrafterShape()`` at their TP degree, with ``layers``
    layers and the whole vocabulary (or ``vocab``)."""
    from benchmarks.kimi_model import KIMI, DrafterShape

    m, d = KIMI, DrafterShape()
    if m.shared_inter_gpu % m.moe_inter_gpu:
        raise ValueError("the shared expert is not a whole number of routed-expert widths")
    return RankShape(
        layers=layers, dense_layers=m.dense_layers, hidden=m.hidden, heads=m.heads_gpu, q_lora=m.q_lora,
        kv_lora=m.kv_lora, qk_nope=m.qk_nope, qk_rope=m.qk_rope, v_head=m.v_head, experts=m.experts,
        top_k=m.top_k, moe_inter=m.moe_inter_gpu, shared_experts=m.shared_inter_gpu // m.moe_inter_gpu,
        dense_inter=m.dense_inter_gpu, vocab=vocab or m.vocab, max_positions=max_positions,
        draft_layers=d.layers, draft_heads=max(1, d.heads // m.tp), draft_kv_heads=max(1, d.kv_heads // m.tp),
        draft_head_dim=d.head_dim, draft_inter=m.dense_inter_gpu, block=d.block)


def target_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The target layers feeding the drafter: SGLang's default spacing (``dflash_utils.build_target_layer_ids``,
    restated here so a build needs no SGLang import; the extended test compares the two)."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    if end < start:
        raise ValueError(f"a DFlash drafter needs a target of at least 4 layers, not {target_layers}")
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


# ---- memory ------------------------------------------------------------------------------------------------


def weight_bytes(s: RankShape) -> dict:
    """Bytes of each part of the served weights: bf16 everywhere but the routed experts (INT4 codes + bf16
    group scales, after the Marlin repack, which keeps their size)."""
    h, bf16 = s.hidden, 2
    attention = bf16 * (h * (s.q_lora + s.kv_lora + s.qk_rope) + s.q_lora * s.heads * (s.qk_nope + s.qk_rope)
                        + s.kv_lora * s.heads * (s.qk_nope + s.v_head) + s.heads * s.v_head * h
                        + 2 * h + s.q_lora + s.kv_lora)
    routed_params = s.experts * 3 * h * s.moe_inter
    routed = routed_params // 2 + routed_params // s.group * bf16
    moe_rest = bf16 * (3 * h * s.moe_inter * s.shared_experts + s.experts * h) + 4 * s.experts
    dense_mlp = bf16 * 3 * h * s.dense_inter
    draft_layer = bf16 * (h * (s.draft_heads + 2 * s.draft_kv_heads) * s.draft_head_dim
                          + s.draft_heads * s.draft_head_dim * h + 3 * h * s.draft_inter + 2 * h
                          + 2 * s.draft_head_dim)
    draft_fc = bf16 * (len(target_layer_ids(s.layers, s.draft_layers)) * h * h + 2 * h)
    return {"embed_and_head": bf16 * 2 * s.vocab * h, "attention_per_layer": attention,
            "routed_experts_per_layer": routed, "moe_rest_per_layer": moe_rest, "dense_mlp": dense_mlp,
            "drafter": s.draft_layers * draft_layer + draft_fc}


def kv_bytes_per_token(s: RankShape) -> int:
    """Target MLA latent (kv_lora + rope, bf16) per layer, plus the drafter's K and V per layer."""
    return s.layers * (s.kv_lora + s.qk_rope) * 2 + s.draft_layers * 2 * s.draft_kv_heads * s.draft_head_dim * 2


def kv_tokens(max_batch: int, context: int, new_tokens: int = 64, max_width: int = 64) -> int:
    """KV slots for ``max_batch`` requests of ``context`` prompt tokens decoding ``new_tokens`` with verify rows of
    up to ``max_width``, and fifteen widths more of headroom (SGLang reserves twice the verify width per running
    speculative request at each decode step), rounded up to 1,024."""
    need = max_batch * (context + new_tokens + 16 * max_width)
    return -(-need // 1024) * 1024


def estimate(s: RankShape, max_batch: int = 32, context: int = 4096, tiers=(16, 32, 64), new_tokens: int = 64) -> dict:
    """GiB per part of one KDTREE rank server (the largest of plain / DFLASH / KDTREE) and the total."""
    w = weight_bytes(s)
    moe_layers = s.layers - s.dense_layers
    target = (w["embed_and_head"] + s.layers * w["attention_per_layer"] + s.dense_layers * w["dense_mlp"]
              + moe_layers * (w["routed_experts_per_layer"] + w["moe_rest_per_layer"]))
    tokens = kv_tokens(max_batch, context, new_tokens, max(tiers))
    parts = {"target_weights": target / GIB, "drafter_weights": w["drafter"] / GIB,
             "kv_pool": tokens * kv_bytes_per_token(s) / GIB,
             "verify_graphs": max_batch * sum(tiers) * VERIFY_ROW_BYTES / GIB,
             # KDTREE's round buffers kept from its startup rehearsal: the largest batch x width of fp32 logits
             "round_buffers": max_batch * max(tiers) * s.vocab * 4 / GIB, **OVERHEAD_GIB}
    per_layer = (w["attention_per_layer"] + w["routed_experts_per_layer"] + w["moe_rest_per_layer"]
                 + tokens * (s.kv_lora + s.qk_rope) * 2) / GIB
    return {"gib": {k: round(v, 3) for k, v in parts.items()}, "total_gib": round(sum(parts.values()), 2),
            "per_moe_layer_gib": round(per_layer, 4), "kv_tokens": tokens, "layers": s.layers,
            "max_batch": max_batch, "context": context, "tiers": list(tiers)}


def largest_fit(gpu_gib: float, spare_gib: float = 5.0, **kw) -> int:
    """The most layers (<= 61) whose ``estimate`` leaves ``spare_gib`` of ``gpu_gib`` free."""
    best = 0
    for layers in range(4, 62):
        if estimate(from_kimi_model(layers), **kw)["total_gib"] <= gpu_gib - spare_gib:
            best = layers
    return best


def format_estimate(gpu_gib: float, layer_counts=(4, 20, 40, 61), **kw) -> str:
    rows = [estimate(from_kimi_model(n), **kw) for n in layer_counts]
    names = list(rows[0]["gib"])
    lines = [f"memory estimate, GiB (batch {rows[0]['max_batch']}, context {rows[0]['context']}, "
             f"{rows[0]['kv_tokens']:,} KV slots, verify tiers {rows[0]['tiers']}); GPU {gpu_gib:g} GiB",
             "| layers | " + " | ".join(names) + " | total | fits |", "|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        lines.append(f"| {r['layers']} | " + " | ".join(f"{r['gib'][n]:.2f}" for n in names)
                     + f" | {r['total_gib']:.1f} | {'yes' if r['total_gib'] <= gpu_gib else 'no'} |")
    lines.append(f"each MoE layer: {rows[0]['per_moe_layer_gib']:.3f} GiB (weights + its KV); largest layer count "
                 f"leaving 5 GiB free: {largest_fit(gpu_gib, **kw)}")
    return "\n".join(lines)


# ---- configs -----------------------------------------------------------------------------------------------


def _e2e():
    """``make_kimi_model`` and ``make_tiny_models`` (tests/e2e): the Kimi-shaped target's config, quantization
    scheme, drafter config and tokenizer, reused with the rank's sizes."""
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))
    import make_kimi_model
    import make_tiny_models

    return make_kimi_model, make_tiny_models


def target_config(s: RankShape) -> dict:
    """``make_kimi_model.kimi_config`` with the rank's sizes, as config.json (bf16, compressed-tensors experts)."""
    kimi, _ = _e2e()
    cfg = kimi.kimi_config(s.vocab)
    for name, value in {
        "num_hidden_layers": s.layers, "first_k_dense_replace": s.dense_layers, "hidden_size": s.hidden,
        "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "q_lora_rank": s.q_lora,
        "kv_lora_rank": s.kv_lora, "qk_nope_head_dim": s.qk_nope, "qk_rope_head_dim": s.qk_rope,
        "v_head_dim": s.v_head, "n_routed_experts": s.experts, "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.moe_inter, "n_shared_experts": s.shared_experts,
        "intermediate_size": s.dense_inter, "max_position_embeddings": s.max_positions,
    }.items():
        setattr(cfg, name, value)
    # yarn with factor 1 is plain RoPE (as the Kimi-shaped target), stretched to the rank's context
    cfg.rope_parameters = dict(cfg.rope_parameters, original_max_position_embeddings=s.max_positions)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    data = cfg.to_dict()
    data.update(dtype="bfloat16", quantization_config=kimi.QUANTIZATION_CONFIG)
    if kimi.QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]["group_size"] != s.group:
        raise ValueError(f"the Kimi-shaped scheme has group {kimi.GROUP_SIZE}, the rank asks for {s.group}")
    return data


def drafter_config(s: RankShape) -> dict:
    """``make_tiny_models.draft_config`` of the rank's target, resized to the rank's drafter."""
    kimi, tiny = _e2e()
    cfg = kimi.kimi_config(s.vocab)
    cfg.hidden_size, cfg.max_position_embeddings = s.hidden, s.max_positions
    data = tiny.draft_config(cfg, dtype="bfloat16")
    ids = target_layer_ids(s.layers, s.draft_layers)
    data.update(num_hidden_layers=s.draft_layers, num_attention_heads=s.draft_heads,
                num_key_value_heads=s.draft_kv_heads, head_dim=s.draft_head_dim, intermediate_size=s.draft_inter,
                block_size=s.block, num_target_layers=s.layers)
    data["dflash_config"] = dict(data["dflash_config"], block_size=s.block, target_layer_ids=ids)
    return data


def source_hash() -> str:
    """This file's and the two e2e builders' (whose configs and tokenizer it reuses)."""
    kimi, tiny = _e2e()
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for module in (kimi, tiny):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def build(out: Path, s: RankShape, log=print) -> dict:
    """Write the rank's target and drafter folders and its manifest; returns the manifest."""
    kimi, tiny = _e2e()
    t0 = time.time()
    target, drafter = out / TARGET_DIR, out / DRAFT_DIR
    for d in (target, drafter):
        d.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(target_config(s), indent=2, sort_keys=True))
    (drafter / "config.json").write_text(json.dumps(drafter_config(s), indent=2))
    _, _, _, corpus = kimi.language_setup()
    tiny.build_tokenizer(target, corpus, vocab_size=s.vocab)
    # the tokenizer's 4,096-token limit is the tiny models'; the rank serves longer contexts
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, model_max_length=s.max_positions),
                                                             indent=2))
    tiny.copy_tokenizer(target, drafter)
    manifest = {
        "source_hash": source_hash(), "shape": dataclasses.asdict(s), "target": TARGET_DIR, "drafter": DRAFT_DIR,
        "target_layer_ids": target_layer_ids(s.layers, s.draft_layers), "eos_id": tiny.EOS_ID,
        "mask_id": tiny.MASK_ID, "server_env": SERVER_ENV, "server_flags": list(SERVER_FLAGS),
        "estimate": estimate(s), "build_seconds": round(time.time() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    log(f"kimi rank: {s.layers} layers, vocab {s.vocab:,} -> {out} ({manifest['build_seconds']} s); "
        f"estimated {manifest['estimate']['total_gib']} GiB for a KDTREE server")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for target/, drafter/ and the manifest")
    ap.add_argument("--layers", default=None,
                    help=f"target layers (default {DEFAULT_LAYERS}, which fits an H100 with KV for batch 32 at 4k; "
                         "61 is Kimi K2.6's, about 108 GiB in all at batch 32: an H200), or 'auto': the most, up to "
                         "61, that leave 5 GiB of --gpu-gib free by the estimate")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default Kimi's 163,840)")
    ap.add_argument("--max-positions", type=int, default=32_768, help="context the configs allow (default 32768)")
    ap.add_argument("--tiny-for-cpu", action="store_true", help="4 layers and vocab 4,096 (every other size kept)")
    ap.add_argument("--estimate", action="store_true", help="print the memory estimate by layer count and exit")
    ap.add_argument("--gpu-gib", type=float, default=H100_GIB,
                    help=f"GPU memory for --estimate and --layers auto (default {H100_GIB})")
    ap.add_argument("--max-batch", type=int, default=32, help="largest batch for --estimate and --layers auto")
    ap.add_argument("--tiers", default="16,32,64", help="verify widths for --estimate and --layers auto")
    ap.add_argument("--spare-gib", type=float, default=5.0, help="GiB that --layers auto leaves free (default 5)")
    args = ap.parse_args(argv)
    fit = {"max_batch": args.max_batch, "tiers": tuple(int(w) for w in args.tiers.split(","))}
    if args.estimate:
        print(format_estimate(args.gpu_gib, **fit))
        return 0
    if args.out is None:
        ap.error("--out is required (or --estimate)")
    if args.layers == "auto":
        layers = largest_fit(args.gpu_gib, args.spare_gib, **fit)
        if layers < 4:
            ap.error(f"--layers auto: no layer count leaves {args.spare_gib:g} of {args.gpu_gib:g} GiB free by the "
                     "estimate")
    else:
        layers = int(args.layers) if args.layers else (4 if args.tiny_for_cpu else DEFAULT_LAYERS)
    vocab = args.vocab or (4096 if args.tiny_for_cpu else None)
    build(args.out, from_kimi_model(layers, vocab, args.max_positions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
