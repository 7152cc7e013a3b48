"""Build, offline and seeded, a small Kimi-shaped target (DeepSeek-V3 architecture, Kimi K2.6's MLA geometry,
vocab 163,840, W4A16 compressed-tensors routed experts) and its DFlash drafter.

    python tests/e2e/make_kimi_model.py OUT_DIR [--device cuda] [--stage all|train|export]
    python tests/e2e/make_tiny_models.py OUT_DIR --kimi        (the same)

writes

* ``OUT_DIR/kimi``: ``DeepseekV3ForCausalLM``, bf16, 3 layers (dense, MoE, MoE), hidden 256, 8 heads,
  ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128, ``v_head_dim`` 128 (so SGLang's
  absorbed MLA has q/k width 576 and v width 512, as Kimi K2.6 at TP 8), ``q_lora_rank`` 512, 16 routed
  experts (top 4, ``moe_intermediate_size`` 256) + 1 shared, sigmoid ``noaux_tc`` routing with a non-zero
  ``e_score_correction_bias``, vocab 163,840. Routed experts are stored like Kimi K2 Thinking's checkpoint:
  compressed-tensors ``pack-quantized``, INT4 symmetric, group 32 (``weight_packed`` int32 ``[out, in/8]``,
  ``weight_scale`` bf16 ``[out, in/32]``, ``weight_shape`` int64 ``[out, in]``); everything else bf16;
* ``OUT_DIR/kimi-dflash``: a ``DFlashDraftModel`` for it (block size 8, target layers 0 and 1), bf16;
* a WordLevel tokenizer covering all 163,840 ids in both folders, and ``OUT_DIR/KIMI_MANIFEST.json``.

How (reusing ``make_tiny_models``' language, target training and drafter code):

1. ``train`` stage (CPU or GPU, fp32): the target is fitted to the synthetic language with a *training*
   vocabulary of 128 ids: the 64 words, EOS and MASK, and 62 "filler prototypes" (ids 66..127) that are never
   a target, so training pushes their logits down in every context. The routed experts are then
   quantized (fake-quant: each weight replaced by its INT4 group-32 value, ``moe.weights.quantize_symmetric``)
   and the drafter is fitted against that quantized target, with the same 128-row head. Staged to
   ``OUT_DIR/_kimi_train`` (small: fp32 at vocab 128).
2. ``export`` stage (seconds): rows 128..163,839 of the embedding and the LM head become random convex
   combinations of the 62 trained prototype rows, so every filler logit lies between the prototypes' logits
   in every context (below the language tokens, by the margin the manifest records) while top-K over the
   whole vocabulary is still a real ranking; the routed experts are packed to W4A16 (exactly the values
   the drafter was trained against); the rest is cast to bf16.

Everything is seeded; on a GPU the train stage runs with deterministic algorithms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_models as tiny  # noqa: E402

KIMI_VOCAB = 163_840
#: the language's 66 ids + 62 filler prototypes (never a target): the vocabulary the train stage fits
TRAIN_VOCAB = 128
PROTOTYPES = range(tiny.VOCAB_SIZE, TRAIN_VOCAB)
HIDDEN = 256
LAYERS = 3  # layer 0 dense, layers 1 and 2 MoE
NUM_HEADS = 8  # Kimi K2.6's 64 heads at TP 8
KV_LORA_RANK, QK_ROPE_HEAD_DIM, QK_NOPE_HEAD_DIM, V_HEAD_DIM = 512, 64, 128, 128
Q_LORA_RANK = 512  # Kimi has 1536; the kernel geometry does not depend on it
N_ROUTED_EXPERTS, TOP_K, N_SHARED_EXPERTS = 16, 4, 1
MOE_INTERMEDIATE = 256  # Marlin: hidden and intermediate multiples of 128
DENSE_INTERMEDIATE = 512
ROUTED_SCALING_FACTOR = 2.827  # Kimi K2's
GROUP_SIZE = 32
MAX_POSITIONS = 4096
TARGET_LR = 1e-3
SEED = tiny.SEED + 1

TARGET_DIR, DRAFT_DIR, STAGE_DIR, MANIFEST = "kimi", "kimi-dflash", "_kimi_train", "KIMI_MANIFEST.json"
EXPERT_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

#: ``quantization_config`` of the target: Kimi K2 Thinking's scheme (compressed-tensors, pack-quantized,
#: INT4 symmetric group 32 on Linear) with everything but the routed experts ignored.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "group_size": GROUP_SIZE, "strategy": "group",
                "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
        },
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*mlp\\.gate$",
    ],
    "kv_cache_scheme": None,
    "sparsity_config": {},
}


def kimi_config(vocab_size: int = KIMI_VOCAB):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=DENSE_INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS, n_shared_experts=N_SHARED_EXPERTS, n_routed_experts=N_ROUTED_EXPERTS,
        num_experts_per_tok=TOP_K, routed_scaling_factor=ROUTED_SCALING_FACTOR, kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=Q_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, v_head_dim=V_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=False,
        # yarn with factor 1 is the plain rotary embedding, identical in HF and SGLang (as the tiny DSV3)
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 1.0,
                         "original_max_position_embeddings": MAX_POSITIONS, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=tiny.EOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.EOS_ID, torch_dtype="float32",
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
    )


def source_hash() -> str:
    """Hash of this file and of ``make_tiny_models.py`` (whose code the build runs)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(Path(tiny.__file__).read_bytes())
    return digest.hexdigest()[:16]


def language_setup():
    """The seeded generator after the successor tables and the tokenizer corpus (the same in both stages)."""
    gen = torch.Generator().manual_seed(SEED)
    succ_a, succ_b = tiny.successor_tables(gen)
    corpus_ids = tiny.language_batch(succ_a, succ_b, 64, 40, gen)
    corpus = [" ".join(tiny.word(int(t)) for t in row) for row in corpus_ids]
    return gen, succ_a, succ_b, corpus


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


# ---------------------------------------------------------------------------------------------------
# INT4 group-32 (the reference quantizer of sglang_kdtree.moe.weights, applied to [out, in] weights)
# ---------------------------------------------------------------------------------------------------


def quantize_rows(weight: torch.Tensor):
    """``[..., out, in]`` float -> (``weight_packed [..., out, in/8]`` int32, ``weight_scale [..., out, in/32]``
    bf16): compressed-tensors' layout (groups and packing along the input dim)."""
    from sglang_kdtree.moe.weights import quantize_symmetric

    packed, scale = quantize_symmetric(weight.float().transpose(-1, -2), GROUP_SIZE, torch.bfloat16)
    return packed.transpose(-1, -2).contiguous(), scale.transpose(-1, -2).contiguous()


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from sglang_kdtree.moe.weights import dequantize

    return dequantize(packed.transpose(-1, -2), scale.transpose(-1, -2), GROUP_SIZE).transpose(-1, -2)


def moe_layers(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@torch.no_grad()
def fake_quantize_experts(model) -> float:
    """Replace every routed expert weight by its INT4 group-32 value; returns the largest relative change."""
    worst = 0.0
    for mlp in moe_layers(model):
        for param in (mlp.experts.gate_up_proj, mlp.experts.down_proj):  # [E, out, in]
            quantized = dequantize_rows(*quantize_rows(param.detach().cpu())).to(param.device, param.dtype)
            worst = max(worst, float((quantized - param).norm() / param.norm()))
            param.copy_(quantized)
    return worst


# ---------------------------------------------------------------------------------------------------
# measurements (recorded in the manifest; the tests read them)
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def target_quality(model, succ_a, succ_b, gen) -> dict:
    """Greedy next-token accuracy on noise-free text, the greedy margin (top-1 minus top-2 logit) and the
    filler margin (top-1 minus the largest prototype logit: every filler logit is at most that)."""
    seq = tiny.language_batch(succ_a, succ_b, 64, 40, gen, noise=0.0)
    logits = model(input_ids=seq.to(tiny.model_device(model))).logits[:, 1:-1].float().cpu()
    labels = seq[:, 2:]
    top2 = logits.topk(2, dim=-1)
    filler = top2.values[..., 0] - logits[..., PROTOTYPES.start:PROTOTYPES.stop].amax(-1)
    greedy = top2.values[..., 0] - top2.values[..., 1]
    return {
        "accuracy": round(float((top2.indices[..., 0] == labels).float().mean()), 4),
        "greedy_margin_p01": round(float(greedy.flatten().quantile(0.01)), 3),
        "greedy_margin_median": round(float(greedy.median()), 3),
        "filler_margin_min": round(float(filler.min()), 3),
    }


@torch.no_grad()
def drafter_filler_margin(target, weights: dict, succ_a, succ_b, gen) -> dict:
    """The drafter's top-1 logit minus its largest prototype logit over fresh blocks (min and 1% quantile)."""
    device = tiny.model_device(target)
    drafter = tiny.TinyDFlashDrafter(len(tiny.CAPTURE_LAYER_IDS), hidden=HIDDEN)
    drafter.load_state_dict({"params." + k.replace(".", "__"): v for k, v in weights.items()})
    drafter.to(device)
    pool = tiny.target_features(target, tiny.language_batch(succ_a, succ_b, 64, 24, gen, noise=0.0))
    seqs = tiny.language_batch(succ_a, succ_b, 64, 2, gen, noise=0.0).to(device)
    block = torch.full((64, tiny.BLOCK_SIZE), tiny.MASK_ID, dtype=torch.long, device=device)
    block[:, 0] = seqs[:, 1]
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    logits = (drafter(pool, embed[block], pool.shape[1])[:, 1:] @ head.T).float().cpu()
    margin = logits.amax(-1) - logits[..., PROTOTYPES.start:PROTOTYPES.stop].amax(-1)
    return {"filler_margin_min": round(float(margin.min()), 3),
            "filler_margin_p01": round(float(margin.flatten().quantile(0.01)), 3)}


# ---------------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------------


def train(stage: Path, target_steps: int = 300, drafter_steps: int = 400, device: str | None = None,
          log=print) -> dict:
    """Fit the target (vocab 128), fake-quantize its routed experts, fit the drafter; stage both (fp32)."""
    device = pick_device(device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if device.type == "cuda":  # reproducible GPU builds; the caller's setting is restored afterwards
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        return _train(stage, target_steps, drafter_steps, device, log)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _train(stage: Path, target_steps: int, drafter_steps: int, device: torch.device, log) -> dict:
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    t0 = time.time()
    gen, succ_a, succ_b, _ = language_setup()
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(kimi_config(TRAIN_VOCAB)).float()
    with torch.no_grad():
        bias_gen = torch.Generator().manual_seed(SEED)
        for mlp in moe_layers(model):  # Kimi's router has a learned correction bias; give ours a fixed one
            mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(N_ROUTED_EXPERTS, generator=bias_gen))
    model.to(device)
    log(f"kimi: training target ({sum(p.numel() for p in model.parameters())} params, {device})")
    loss = tiny.train_target(model, succ_a, succ_b, target_steps, gen, log, lr=TARGET_LR)
    model.eval()
    before = target_quality(model, succ_a, succ_b, gen)
    quant_change = fake_quantize_experts(model)
    after = target_quality(model, succ_a, succ_b, gen)
    log(f"kimi: target {before} -> W4A16 experts {after} (relative weight change {quant_change:.4f})")
    log("kimi: fitting the drafter against the quantized target")
    drafted = tiny.train_drafter(model, succ_a, succ_b, drafter_steps, gen, log)
    drafter_margin = drafter_filler_margin(model, drafted["weights"], succ_a, succ_b, gen)
    stage.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(stage / "target", safe_serialization=True)
    save_file({k: v.cpu() for k, v in drafted["weights"].items()}, str(stage / "drafter.safetensors"))
    info = {
        "source_hash": source_hash(), "device": str(device), "target_steps": target_steps,
        "drafter_steps": drafter_steps, "target_loss": round(loss, 4), "target_fp32": before,
        "target_w4a16": after, "expert_quantization_relative_change": round(quant_change, 5),
        "drafter": drafted["stats"], "drafter_margin": drafter_margin,
        "train_seconds": round(time.time() - t0, 1),
    }
    (stage / "train.json").write_text(json.dumps(info, indent=2))
    return info


def expand_rows(trained: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``[TRAIN_VOCAB, H]`` -> ``[KIMI_VOCAB, H]``: rows past TRAIN_VOCAB are random convex combinations
    (softmax weights) of the prototype rows."""
    protos = trained[PROTOTYPES.start:PROTOTYPES.stop].float()
    mix = torch.softmax(torch.randn(KIMI_VOCAB - TRAIN_VOCAB, len(PROTOTYPES), generator=gen), dim=-1)
    return torch.cat([trained.float(), mix @ protos], dim=0)


def export(stage: Path, out: Path, log=print) -> dict:
    """Stage -> ``out/kimi``, ``out/kimi-dflash`` and the manifest (vocab expansion, W4A16 packing, bf16)."""
    from safetensors.torch import load_file, save_file

    t0 = time.time()
    info = json.loads((stage / "train.json").read_text())
    staged = load_file(str(stage / "target" / "model.safetensors"))
    gen = torch.Generator().manual_seed(SEED + 2)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(staged):
        value = staged[name]
        match = EXPERT_WEIGHT.match(name)
        if match:
            packed, scale = quantize_rows(value)
            if not torch.equal(dequantize_rows(packed, scale), value.float()):
                raise RuntimeError(f"{name}: the staged expert is not on the INT4 grid (was the stage fake-quantized?)")
            base = name[: -len("weight")]
            tensors[base + "weight_packed"] = packed
            tensors[base + "weight_scale"] = scale
            tensors[base + "weight_shape"] = torch.tensor(value.shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = expand_rows(value, gen).to(torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = value.float()
        else:
            tensors[name] = value.to(torch.bfloat16)
    target_dir, draft_dir = out / TARGET_DIR, out / DRAFT_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((stage / "target" / "config.json").read_text())
    config.update(vocab_size=KIMI_VOCAB, dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    (target_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _, _, _, corpus = language_setup()
    tiny.build_tokenizer(target_dir, corpus, vocab_size=KIMI_VOCAB)
    drafter = {k: v.to(torch.bfloat16) for k, v in load_file(str(stage / "drafter.safetensors")).items()}
    draft_dir.mkdir(parents=True, exist_ok=True)
    save_file(drafter, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    draft_cfg = tiny.draft_config(kimi_config(KIMI_VOCAB), dtype="bfloat16")
    (draft_dir / "config.json").write_text(json.dumps(draft_cfg, indent=2))
    tiny.copy_tokenizer(target_dir, draft_dir)
    manifest = {
        "source_hash": source_hash(), "vocab_size": KIMI_VOCAB, "train_vocab": TRAIN_VOCAB,
        "eos_id": tiny.EOS_ID, "mask_id": tiny.MASK_ID, "block_size": tiny.BLOCK_SIZE,
        "num_words": tiny.NUM_WORDS, "target": TARGET_DIR, "drafter": DRAFT_DIR, "train": info,
        "export_seconds": round(time.time() - t0, 1),
        "sha256": {f"{d}/model.safetensors": hashlib.sha256((out / d / "model.safetensors").read_bytes()).hexdigest()
                   for d in (TARGET_DIR, DRAFT_DIR)},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def build(out: Path, target_steps: int = 300, drafter_steps: int = 400, device: str | None = None,
          log=print) -> dict:
    train(out / STAGE_DIR, target_steps, drafter_steps, device, log)
    return export(out / STAGE_DIR, out, log)


def ensure_built(out: Path, device: str | None = None, log=lambda *_: None) -> dict:
    """Reuse ``out`` if it holds a full-length Kimi build of this exact code, else (re)build it."""
    manifest = out / MANIFEST
    if manifest.exists():
        data = json.loads(manifest.read_text())
        if data.get("source_hash") == source_hash() and data["train"]["target_steps"] == 300:
            return data
    return build(out, device=device, log=log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--stage", choices=("all", "train", "export"), default="all")
    parser.add_argument("--device", default="auto", help="train-stage device: auto (cuda if present), cpu, cuda")
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--drafter-steps", type=int, default=400)
    args = parser.parse_args(argv)
    t0 = time.time()
    if args.stage in ("all", "train"):
        result = train(args.out_dir / STAGE_DIR, args.target_steps, args.drafter_steps, args.device)
    if args.stage in ("all", "export"):
        result = export(args.out_dir / STAGE_DIR, args.out_dir)
    result["total_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
