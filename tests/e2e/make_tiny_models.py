"""Build, offline and deterministically, the tiny checkpoints the end-to-end tests serve with SGLang on CPU.

    python tests/e2e/make_tiny_models.py OUT_DIR

writes

* ``OUT_DIR/llama``: a tiny Llama target (MHA, 3 layers, hidden 64, fp32);
* ``OUT_DIR/dsv3``: a tiny DeepSeek-V3 target (MLA with q/kv LoRA, MoE with 4 routed experts + 1 shared,
  sigmoid ``noaux_tc`` routing, 3 layers of which 2 are MoE, unquantized fp32);
* ``OUT_DIR/llama-dflash`` and ``OUT_DIR/dsv3-dflash``: DFlash draft checkpoints
  (``architectures = ["DFlashDraftModel"]``, block size 8, capturing target layers 0 and 1) that SGLang's
  ``srt/models/dflash.py::DFlashDraftModel`` loads;
* the same tokenizer (``tokenizers`` WordLevel, trained offline on the synthetic corpus) in every folder.

``--kimi`` builds the Kimi-shaped target instead (``make_kimi_model.py``: DeepSeek-V3 with Kimi K2.6's MLA
geometry, vocab 163,840, W4A16 compressed-tensors routed experts), which reuses this file's language,
training and drafter code.

Why the models are *trained* briefly instead of left random: DDTree only shows its behaviour (multi-token
acceptance, acceptance through a non-first sibling) when the drafter agrees with the target often but not
always. So

1. each target is fitted for a few hundred CPU steps to a synthetic second-order language
   (``next = succ_a[cur]`` if ``prev`` is in the first half of the vocabulary, else ``succ_b[cur]``), which
   also makes its greedy logits well separated (AR vs tree-verify exactness is then not at the mercy of
   fp32 reduction order);
2. each drafter is fitted for a few hundred steps to noise-free sequences of the same rule, with a plain
   torch re-implementation of SGLang's DFlash draft forward (context K/V from ``hidden_norm(fc(aux))``,
   non-causal attention over [context, block], the target's embedding and lm_head). It is trained with the
   context of a *different* sequence, so it learns to predict from the bonus token alone; the target's
   choice depends on the previous token, so at every depth the drafter's top-2 is a genuine fork and its
   second choice is right a good part of the time: non-first siblings get accepted, and a chain (DFLASH)
   would lose what the tree keeps.

Everything is seeded; the output is a pure function of this file (``MANIFEST.json`` records a hash of it so
a test fixture can reuse a cached build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

NUM_WORDS = 64  # content tokens; ids 0..63 (0 is an ordinary, valid token)
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
EOS_ID = NUM_WORDS
MASK_ID = NUM_WORDS + 1
VOCAB_SIZE = NUM_WORDS + 2
HIDDEN = 64
BLOCK_SIZE = 8  # DFlash block: [bonus, MASK x 7] -> 7 draft depths
TARGET_LAYERS = 3
CAPTURE_LAYER_IDS = [0, 1]  # target layers whose outputs feed the drafter (SGLang captures before id+1)
SEED = 20261129


def word(i: int) -> str:
    return f"w{i:02d}"


def successor_tables(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randperm(NUM_WORDS, generator=gen), torch.randperm(NUM_WORDS, generator=gen)


def language_batch(succ_a, succ_b, batch: int, length: int, gen: torch.Generator, noise: float = 0.08):
    """Sequences of the synthetic language; ``noise`` of the tokens are replaced by uniform ones so the
    target learns the rule from any (prev, cur) pair, including the random prompts of the tests."""
    seq = torch.empty(batch, length, dtype=torch.long)
    seq[:, :2] = torch.randint(0, NUM_WORDS, (batch, 2), generator=gen)
    for t in range(2, length):
        prev, cur = seq[:, t - 2], seq[:, t - 1]
        nxt = torch.where(prev < NUM_WORDS // 2, succ_a[cur], succ_b[cur])
        flip = torch.rand(batch, generator=gen) < noise
        seq[:, t] = torch.where(flip, torch.randint(0, NUM_WORDS, (batch,), generator=gen), nxt)
    return seq


# ---------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------


def filler_word(i: int) -> str:
    """The word of filler id ``i`` (ids past the language's, only in the Kimi-shaped target's vocabulary)."""
    return f"x{i}"


def build_tokenizer(out: Path, corpus: list[str], vocab_size: int = VOCAB_SIZE) -> None:
    """WordLevel tokenizer: word i -> id i, then EOS and MASK; with ``vocab_size > VOCAB_SIZE`` every further
    id gets a filler word (``filler_word``) so any id detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=EOS_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Train on the corpus, then pin ids: word i -> id i, specials after the words (ids are part of the test
    # contract: stop-token ids, the mask id in the draft config).
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, special_tokens=[], min_frequency=1)
    tok.train_from_iterator(corpus, trainer=trainer)
    learned = tok.get_vocab()
    missing = [w for w in (word(i) for i in range(NUM_WORDS)) if w not in learned]
    if missing:
        raise RuntimeError(f"tokenizer training did not see words {missing[:5]}; enlarge the corpus")
    vocab = {word(i): i for i in range(NUM_WORDS)}
    vocab[EOS_TOKEN] = EOS_ID
    vocab[MASK_TOKEN] = MASK_ID
    vocab.update({filler_word(i): i for i in range(VOCAB_SIZE, vocab_size)})
    pinned = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    pinned.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    pinned.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    pinned.add_special_tokens([EOS_TOKEN, MASK_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=pinned, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN, model_max_length=4096)
    fast.save_pretrained(out)


# ---------------------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------------------


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=EOS_ID,
        eos_token_id=EOS_ID, pad_token_id=EOS_ID, torch_dtype="float32",
    )


def dsv3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.0,
        # kv_lora 48 + rope 8: SGLang's Triton MLA decode kernel on CUDA takes v from the transposed key and
        # needs next_pow2(kv_lora + rope) == next_pow2(kv_lora) (32 + 8 does not compile on sm_90)
        kv_lora_rank=48, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        # SGLang's CPU rope for DeepSeek supports only deepseek_yarn (as the real V3 checkpoints use);
        # factor 1 makes it the plain rotary embedding, identical in HF and SGLang.
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, torch_dtype="float32",
        # Keys of the published V3 config that SGLang's deepseek_v2 reads but transformers 5 no longer sets.
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
    )


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def train_target(model, succ_a, succ_b, steps: int, gen: torch.Generator, log, lr: float = 3e-3) -> float:
    """Fit ``model`` (on any device; batches are drawn on the CPU from ``gen``) to the language; its
    vocabulary may be larger than the language's (ids never seen as targets are pushed down)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    vocab, device = model.config.vocab_size, model_device(model)
    loss = torch.tensor(0.0)
    for step in range(steps):
        seq = language_batch(succ_a, succ_b, 32, 40, gen).to(device)
        logits = model(input_ids=seq).logits
        loss = F.cross_entropy(logits[:, 1:-1].reshape(-1, vocab), seq[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            log(f"  target step {step}: loss {loss.item():.3f}")
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def target_features(model, seq: torch.Tensor) -> torch.Tensor:
    """``[n, T, len(CAPTURE_LAYER_IDS) * HIDDEN]``: the outputs of the captured target layers, in the order
    SGLang concatenates them (it captures the residual stream before layer ``id + 1``)."""
    out = model(input_ids=seq.to(model_device(model)), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in CAPTURE_LAYER_IDS], dim=-1)


# ---------------------------------------------------------------------------------------------------
# the DFlash drafter, as SGLang's DFlashDraftModel computes it
# ---------------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * weight


def rope_neox(x, positions, theta=10000.0):
    """Neox-style rotary embedding on the last axis (SGLang ``get_rope(..., is_neox_style=True)``)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.float()[..., None] * inv_freq
    cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TinyDFlashDrafter(torch.nn.Module):
    """One DFlash draft layer (Qwen3-style attention with q/k norms, SwiGLU MLP) + fc/hidden_norm/norm.
    Parameter names are the checkpoint names ``DFlashDraftModel.load_weights`` maps."""

    heads = 4
    head_dim = 16
    intermediate = 128

    def __init__(self, num_features: int, hidden: int = HIDDEN):
        super().__init__()
        h, hd = hidden, self.heads * self.head_dim
        lin = lambda i, o: torch.nn.Parameter(torch.randn(o, i) / math.sqrt(i))  # noqa: E731
        weights = {
            "fc.weight": lin(num_features * h, h),
            "hidden_norm.weight": torch.nn.Parameter(torch.ones(h)),
            "norm.weight": torch.nn.Parameter(torch.ones(h)),
            "layers.0.input_layernorm.weight": torch.nn.Parameter(torch.ones(h)),
            "layers.0.post_attention_layernorm.weight": torch.nn.Parameter(torch.ones(h)),
            "layers.0.self_attn.q_proj.weight": lin(h, hd),
            "layers.0.self_attn.k_proj.weight": lin(h, hd),
            "layers.0.self_attn.v_proj.weight": lin(h, hd),
            "layers.0.self_attn.o_proj.weight": lin(hd, h),
            "layers.0.self_attn.q_norm.weight": torch.nn.Parameter(torch.ones(self.head_dim)),
            "layers.0.self_attn.k_norm.weight": torch.nn.Parameter(torch.ones(self.head_dim)),
            "layers.0.mlp.gate_proj.weight": lin(h, self.intermediate),
            "layers.0.mlp.up_proj.weight": lin(h, self.intermediate),
            "layers.0.mlp.down_proj.weight": lin(self.intermediate, h),
        }
        # ParameterDict keys cannot contain dots
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): v for k, v in weights.items()})

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def forward(self, aux, block_embeds, ctx_len: int):
        """aux ``[n, P, F*H]`` target features of the committed tokens, block_embeds ``[n, bs, H]``
        (target embedding of ``[bonus, MASK...]``); returns the draft hidden states ``[n, bs, H]``."""
        p = self.p
        n, bs, _ = block_embeds.shape
        ctx = rms_norm(aux @ p("fc.weight").T, p("hidden_norm.weight"))
        ctx_pos = torch.arange(ctx_len, device=aux.device)
        blk_pos = torch.arange(ctx_len, ctx_len + bs, device=aux.device)
        pre = "layers.0."
        x = block_embeds
        h = rms_norm(x, p(pre + "input_layernorm.weight"))
        split = lambda t: t.view(n, -1, self.heads, self.head_dim)  # noqa: E731
        q = rms_norm(split(h @ p(pre + "self_attn.q_proj.weight").T), p(pre + "self_attn.q_norm.weight"))
        k_blk = rms_norm(split(h @ p(pre + "self_attn.k_proj.weight").T), p(pre + "self_attn.k_norm.weight"))
        v_blk = split(h @ p(pre + "self_attn.v_proj.weight").T)
        k_ctx = rms_norm(split(ctx @ p(pre + "self_attn.k_proj.weight").T), p(pre + "self_attn.k_norm.weight"))
        v_ctx = split(ctx @ p(pre + "self_attn.v_proj.weight").T)
        q = rope_neox(q, blk_pos)
        k = torch.cat([rope_neox(k_ctx, ctx_pos), rope_neox(k_blk, blk_pos)], dim=1)
        v = torch.cat([v_ctx, v_blk], dim=1)
        # ENCODER_ONLY: every block query sees every context key and the whole block
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + att.transpose(1, 2).reshape(n, bs, -1) @ p(pre + "self_attn.o_proj.weight").T
        h = rms_norm(x, p(pre + "post_attention_layernorm.weight"))
        mlp = F.silu(h @ p(pre + "mlp.gate_proj.weight").T) * (h @ p(pre + "mlp.up_proj.weight").T)
        x = x + mlp @ p(pre + "mlp.down_proj.weight").T
        return rms_norm(x, p("norm.weight"))

    def state_dict_for_checkpoint(self):
        return {k.replace("__", "."): v.detach().clone().contiguous() for k, v in self.params.items()}


def train_drafter(target, succ_a, succ_b, steps: int, gen: torch.Generator, log) -> dict:
    """Fit the drafter to the rule: block ``[cur, MASK x 7]`` -> the 7 tokens that follow ``(prev, cur)``.

    ``prev`` is uniformly random and never shown to the drafter: the context K/V come from a pool of real
    target features of unrelated sequences (so the drafter sees realistic context statistics but can
    learn nothing from them). Fresh blocks every step, so nothing can be memorised by position.
    """
    device = model_device(target)
    pool = target_features(target, language_batch(succ_a, succ_b, 64, 40, gen, noise=0.0))
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    drafter = TinyDFlashDrafter(len(CAPTURE_LAYER_IDS), hidden=embed.shape[1]).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=2e-3)
    batch = 64
    stats = {}
    for step in range(steps):
        anchor = int(torch.randint(2, pool.shape[1] + 1, (1,), generator=gen))
        ctx_rows = torch.randint(0, pool.shape[0], (batch,), generator=gen).to(device)
        seqs = language_batch(succ_a, succ_b, batch, BLOCK_SIZE + 1, gen, noise=0.0).to(device)
        block_ids = torch.full((batch, BLOCK_SIZE), MASK_ID, dtype=torch.long, device=device)
        block_ids[:, 0] = seqs[:, 1]
        labels = seqs[:, 2:]
        hidden = drafter(pool[ctx_rows, :anchor], embed[block_ids], anchor)
        logits = hidden[:, 1:] @ head.T
        loss = F.cross_entropy(logits.reshape(-1, head.shape[0]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                top = logits.topk(2, dim=-1).indices
                stats = {
                    "loss": round(float(loss), 4),
                    "top1_by_depth": [round(float((top[:, d, 0] == labels[:, d]).float().mean()), 3)
                                      for d in range(BLOCK_SIZE - 1)],
                    "top2_by_depth": [round(float((top[:, d, 1] == labels[:, d]).float().mean()), 3)
                                      for d in range(BLOCK_SIZE - 1)],
                }
            log(f"  drafter step {step}: {stats}")
    return {"weights": drafter.state_dict_for_checkpoint(), "stats": stats}


def draft_config(target_cfg, dtype: str = "float32") -> dict:
    """The drafter's config.json; hidden size and vocabulary are the target's."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(target_cfg.hidden_size),
        "num_hidden_layers": 1,
        "num_attention_heads": TinyDFlashDrafter.heads,
        "num_key_value_heads": TinyDFlashDrafter.heads,
        "head_dim": TinyDFlashDrafter.head_dim,
        "intermediate_size": TinyDFlashDrafter.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": int(target_cfg.max_position_embeddings),
        "vocab_size": int(target_cfg.vocab_size),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        "block_size": BLOCK_SIZE,
        "num_target_layers": TARGET_LAYERS,
        "dflash_config": {
            "block_size": BLOCK_SIZE,
            "target_layer_ids": CAPTURE_LAYER_IDS,
            "mask_token": MASK_TOKEN,
            "mask_token_id": MASK_ID,
        },
    }


def save_drafter(path: Path, weights: dict, target_cfg, tokenizer_dir: Path) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(draft_config(target_cfg), indent=2))
    copy_tokenizer(tokenizer_dir, path)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())


def source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def build(out: Path, target_steps: int = 300, drafter_steps: int = 400, log=print) -> dict:
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    succ_a, succ_b = successor_tables(gen)
    corpus_ids = language_batch(succ_a, succ_b, 64, 40, gen)
    tok_dir = out / "_tokenizer"
    build_tokenizer(tok_dir, [" ".join(word(int(t)) for t in row) for row in corpus_ids])

    manifest = {"source_hash": source_hash(), "vocab_size": VOCAB_SIZE, "eos_id": EOS_ID,
                "mask_id": MASK_ID, "block_size": BLOCK_SIZE, "num_words": NUM_WORDS, "models": {}}
    for name, make_cfg, cls in (("llama", llama_config, LlamaForCausalLM),
                                ("dsv3", dsv3_config, DeepseekV3ForCausalLM)):
        t0 = time.time()
        cfg = make_cfg()
        torch.manual_seed(SEED)
        model = cls(cfg).float()
        log(f"{name}: training target ({sum(p.numel() for p in model.parameters())} params)")
        target_loss = train_target(model, succ_a, succ_b, target_steps, gen, log)
        model.save_pretrained(out / name, safe_serialization=True)
        copy_tokenizer(tok_dir, out / name)
        log(f"{name}: fitting the drafter")
        drafted = train_drafter(model, succ_a, succ_b, drafter_steps, gen, log)
        save_drafter(out / f"{name}-dflash", drafted["weights"], cfg, tok_dir)
        manifest["models"][name] = {"target_loss": round(target_loss, 4), "drafter": drafted["stats"],
                                    "seconds": round(time.time() - t0, 1)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def ensure_built(out: Path, log=lambda *_: None) -> dict:
    """Reuse ``out`` if it holds a build of this exact file, else (re)build it."""
    manifest = out / "MANIFEST.json"
    if manifest.exists():
        data = json.loads(manifest.read_text())
        if data.get("source_hash") == source_hash():
            return data
    return build(out, log=log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--drafter-steps", type=int, default=400)
    parser.add_argument("--kimi", action="store_true",
                        help="build only the Kimi-shaped W4A16 target and its drafter (make_kimi_model.py)")
    args = parser.parse_args(argv)
    if args.kimi:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import make_kimi_model

        return make_kimi_model.main([str(args.out_dir), "--target-steps", str(args.target_steps),
                                     "--drafter-steps", str(args.drafter_steps)])
    manifest = build(args.out_dir, args.target_steps, args.drafter_steps)
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
