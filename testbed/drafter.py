"""The DFlash block drafter: the training forward, the training loop, and the checkpoint SGLang's DFLASH loads.

What SGLang 0.5.23 computes at serving time (``srt/models/dflash.py::DFlashDraftModel`` driven by
``srt/speculative/dflash_worker_v2.py``), and so what ``DFlashDrafter.forward`` computes for every block:

* context: the target's captured layer outputs for the committed positions ``0..P-1`` (layers
  ``target_layer_ids``, concatenated), ``ctx = hidden_norm(fc(features))``; each draft layer's context keys
  and values are ``rope(k_norm(k_proj(ctx)))`` at positions ``0..P-1`` and ``v_proj(ctx)`` (no input norm:
  ``prepare_context_hidden_for_kv`` passes ``ctx`` through);
* block: the target's embedding of ``[anchor, MASK x (bs - 1)]`` at positions ``P..P+bs-1``; each layer is
  pre-norm attention with per-head q/k RMSNorm then RoPE, and a SwiGLU MLP; the block attends to the whole
  context and to itself without a causal mask (``ENCODER_ONLY``);
* output: ``norm`` of the last layer; block row ``k >= 1`` through the target's head gives the logits of the
  token at ``P + k``.

Training (the public DFlash recipe, as in SpecForge's ``OnlineDFlashModel``): many blocks per sequence in one
forward, each seeing the context strictly before its anchor (the anchor's own target hidden state does not
exist yet at serving time: the anchor is the bonus token) and only its own block; cross-entropy on rows
1..bs-1 weighted ``exp(-(k - 1) / gamma)``. The sequences are the target's own greedy continuations and
anchors lie in the generated part only, so every label is the target's greedy choice.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from testbed import target as tg
from testbed import tokenizer as tk


@dataclass(frozen=True)
class DrafterShape:
    hidden: int  # the target's: the drafter reads the target's embeddings and writes into its head
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    mask_id: int = tk.MASK_ID
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6


@dataclass(frozen=True)
class DrafterTrainSettings:
    steps: int
    sequences: int  # sequences per step
    anchors: int  # blocks per sequence per step
    lr: float
    warmup: int
    weight_decay: float
    loss_gamma: float  # 0: uniform weights over the block's rows
    eval_every: int


def check_layer_ids(ids, num_target_layers: int) -> None:
    """SGLang captures target layer i as the input of layer i + 1, so the last layer cannot be captured."""
    bad = [i for i in ids if not 0 <= i <= num_target_layers - 2]
    if bad:
        raise ValueError(f"target_layer_ids {list(ids)} include {bad}: with {num_target_layers} target layers "
                         f"SGLang can capture layers 0..{num_target_layers - 2} only")


class DraftAttention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        width = s.heads * s.head_dim
        self.heads, self.head_dim = s.heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, width, bias=False)
        self.k_proj = nn.Linear(s.hidden, width, bias=False)
        self.v_proj = nn.Linear(s.hidden, width, bias=False)
        self.o_proj = nn.Linear(width, s.hidden, bias=False)
        self.q_norm = tg.RMSNorm(s.head_dim, s.rms_eps)
        self.k_norm = tg.RMSNorm(s.head_dim, s.rms_eps)

    def heads_of(self, x):
        return x.view(*x.shape[:-1], self.heads, self.head_dim)

    def forward(self, h, ctx, rope_block, rope_ctx, mask):
        """``h [B, Q, H]`` normed block rows, ``ctx [B, T, H]``; returns ``[B, Q, H]``."""
        q = tg.apply_rope(self.q_norm(self.heads_of(self.q_proj(h))), *rope_block)
        k_blk = tg.apply_rope(self.k_norm(self.heads_of(self.k_proj(h))), *rope_block)
        k_ctx = tg.apply_rope(self.k_norm(self.heads_of(self.k_proj(ctx))), *rope_ctx)
        v = torch.cat([self.heads_of(self.v_proj(ctx)), self.heads_of(self.v_proj(h))], dim=1)
        k = torch.cat([k_ctx, k_blk], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DraftLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.input_layernorm = tg.RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = DraftAttention(s)
        self.post_attention_layernorm = tg.RMSNorm(s.hidden, s.rms_eps)
        self.mlp = tg.MLP(s.hidden, s.intermediate)

    def forward(self, x, ctx, rope_block, rope_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_block, rope_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """``[B, 1, nb*bs, T + nb*bs]`` bool, True = may attend: block j's rows see context positions
    ``< anchors[:, j]`` and every row of block j, nothing else."""
    b, nb = anchors.shape
    q_block = torch.arange(nb * block_size, device=anchors.device) // block_size
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < q_anchor[:, :, None]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=2).unsqueeze(1)


class DFlashDrafter(nn.Module):
    """Parameter names are the checkpoint's (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...):
    ``DFlashDraftModel.load_weights`` fuses q/k/v and gate/up itself."""

    def __init__(self, s: DrafterShape):
        super().__init__()
        check_layer_ids(s.target_layer_ids, s.num_target_layers)
        self.shape = s
        self.fc = nn.Linear(len(s.target_layer_ids) * s.hidden, s.hidden, bias=False)
        self.hidden_norm = tg.RMSNorm(s.hidden, s.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(s.layers))
        self.norm = tg.RMSNorm(s.hidden, s.rms_eps)
        tg.init_weights(self)

    def forward(self, features, block_embeds, anchors):
        """``features [B, T, F*H]`` (target layer outputs at positions ``0..T-1``), ``block_embeds
        [B, nb, bs, H]`` (target embeddings of ``[anchor, MASK...]``), ``anchors [B, nb]`` (the anchor's
        position; block row k sits at ``anchor + k``). Returns the normed draft hidden states
        ``[B, nb, bs, H]``; pass them through the target's head for logits."""
        s = self.shape
        b, nb, bs, _ = block_embeds.shape
        t = features.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        rope_ctx = tg.rope_tables(torch.arange(t, device=features.device), s.head_dim, s.rope_theta)
        block_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).flatten(1)
        rope_block = tg.rope_tables(block_pos, s.head_dim, s.rope_theta)
        mask = block_mask(anchors, t, bs)
        x = block_embeds.reshape(b, nb * bs, -1)
        for layer in self.layers:
            x = layer(x, ctx, rope_block, rope_ctx, mask)
        return self.norm(x).view(b, nb, bs, -1)


def target_features(target: tg.Llama, seqs: torch.Tensor, layer_ids) -> torch.Tensor:
    """``[B, T, F*H]``: the captured target layers, concatenated in ``layer_ids`` order (SGLang's order)."""
    _, captured = target(seqs, capture=tuple(layer_ids), head=False)
    return torch.cat(captured, dim=-1)


def block_inputs(seqs, anchors, embed_weight, mask_id: int, block_size: int):
    """Block embeddings ``[B, nb, bs, H]`` and labels ``[B, nb, bs-1]`` (the tokens at anchor+1..anchor+bs-1)."""
    b, nb = anchors.shape
    ids = torch.full((b, nb, block_size), mask_id, dtype=torch.long, device=seqs.device)
    ids[:, :, 0] = seqs.gather(1, anchors)
    offsets = torch.arange(1, block_size, device=seqs.device)
    labels = seqs.gather(1, (anchors[:, :, None] + offsets).flatten(1)).view(b, nb, block_size - 1)
    return F.embedding(ids, embed_weight), labels


def depth_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones_like(k)


def sample_anchors(n_seqs: int, n_anchors: int, first: int, last: int, gen: torch.Generator) -> torch.Tensor:
    """``[n_seqs, n_anchors]`` distinct anchors per row, uniform in ``first..last``, sorted."""
    span = last - first + 1
    if n_anchors > span:
        raise ValueError(f"{n_anchors} anchors per sequence but only {span} valid positions ({first}..{last})")
    return (torch.rand(n_seqs, span, generator=gen).argsort(dim=1)[:, :n_anchors] + first).sort(dim=1).values


def logits_and_labels(drafter, target, seqs, anchors, features=None):
    """Draft logits ``[B, nb, bs-1, V]`` (target head on rows 1..bs-1) and their labels; ``features``
    (``target_features`` of ``seqs``) is computed when not given."""
    s = drafter.shape
    if features is None:
        features = target_features(target, seqs, s.target_layer_ids)
    features = features.to(next(drafter.parameters()).dtype)
    embeds, labels = block_inputs(seqs, anchors, target.model.embed_tokens.weight, s.mask_id, s.block_size)
    hidden = drafter(features, embeds.to(features.dtype), anchors)
    return F.linear(hidden[:, :, 1:], target.head_weight.to(hidden.dtype)), labels


def train(drafter: DFlashDrafter, target: tg.Llama, seqs: torch.Tensor, prompt_len: int, cfg: DrafterTrainSettings,
          device, seed: int, eval_seqs: torch.Tensor, log=print) -> dict:
    """Train in place on ``seqs [N, T]`` (CPU; prompt then greedy continuation). ``target`` is frozen (its
    served weights, on ``device``). The curve has the weighted loss on fixed held-out blocks."""
    s = drafter.shape
    last_anchor = seqs.shape[1] - s.block_size
    gen = torch.Generator().manual_seed(seed)
    eval_gen = torch.Generator().manual_seed(seed + 1)
    eval_batch = eval_seqs[: cfg.sequences].to(device)
    eval_anchors = sample_anchors(eval_batch.shape[0], cfg.anchors, prompt_len, last_anchor, eval_gen).to(device)
    weights = depth_weights(s.block_size, cfg.loss_gamma, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    target.requires_grad_(False)

    def weighted_loss(batch, anchors):
        with tg.autocast(device):
            logits, labels = logits_and_labels(drafter, target, batch, anchors)
        ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
        return (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1]), logits, labels

    curve, started, train_time, train_loss = [], time.perf_counter(), 0.0, float("nan")
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with torch.no_grad():
                loss_h, logits, labels = weighted_loss(eval_batch, eval_anchors)
                acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            curve.append({"step": step, "train_loss": round(train_loss, 4), "heldout_loss": round(loss_h.item(), 4),
                          "heldout_acc_depth1": round(acc[0].item(), 4)})
            log(f"  drafter step {step:5d}: train {train_loss:.3f}  held-out {loss_h.item():.3f}  "
                f"depth-1 acc {acc[0].item():.3f}")
        if step == cfg.steps:
            break
        t0 = time.perf_counter()
        rows = torch.randint(0, seqs.shape[0], (cfg.sequences,), generator=gen)
        batch = seqs[rows].to(device)
        anchors = sample_anchors(cfg.sequences, cfg.anchors, prompt_len, last_anchor, gen).to(device)
        for group in opt.param_groups:
            group["lr"] = tg.lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
        loss, _, _ = weighted_loss(batch, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        train_loss = loss.item()
        train_time += time.perf_counter() - t0
    drafter.eval()
    blocks = cfg.steps * cfg.sequences * cfg.anchors
    return {"curve": curve, "blocks_seen": blocks, "train_seconds": round(train_time, 1),
            "train_blocks_per_s": round(blocks / max(train_time, 1e-9)),
            "seconds": round(time.perf_counter() - started, 1)}


def greedy_walk(leading: list[int]) -> list[int]:
    """Per-round tau of greedy DFLASH along one sequence: ``leading[i]`` is the run of correct draft rows of
    the block anchored at the i-th generated position; a round accepts that run plus the bonus token and the
    next round is anchored ``tau`` positions on."""
    taus, a = [], 0
    while a < len(leading):
        taus.append(1 + leading[a])
        a += taus[-1]
    return taus


@torch.no_grad()
def offline_acceptance(drafter, target, seqs: torch.Tensor, prompt_len: int, device, rows: int = 16,
                       chunk: int = 64) -> dict:
    """Greedy acceptance the drafter would get on ``seqs`` (prompt + the target's greedy continuation), from
    its argmax at every anchor of the generated part:

    * ``accuracy_by_depth[d-1]``: draft row d equals the target's token;
    * ``mean_accept_all_anchors``: 1 + the leading run of correct rows, averaged over every anchor;
    * ``dflash_tau``: the same quantity along the anchors a greedy DFLASH round would visit (start at the
      first generated token, move ``tau`` tokens a round): DFLASH's tau on these prompts if the served
      numerics equal these.
    """
    s = drafter.shape
    anchors_all = torch.arange(prompt_len, seqs.shape[1] - s.block_size + 1)
    correct_parts = []
    for r in range(0, seqs.shape[0], rows):
        batch = seqs[r:r + rows].to(device)
        with tg.autocast(device):
            features = target_features(target, batch, s.target_layer_ids)
        per_chunk = []
        for i in range(0, anchors_all.numel(), chunk):
            anchors = anchors_all[i:i + chunk][None].expand(batch.shape[0], -1).to(device)
            with tg.autocast(device):
                logits, labels = logits_and_labels(drafter, target, batch, anchors, features)
            per_chunk.append((logits.float().argmax(-1) == labels).cpu())
        correct_parts.append(torch.cat(per_chunk, dim=1))  # [rows, anchors, bs-1]
    correct = torch.cat(correct_parts)
    leading = correct.long().cumprod(dim=2).sum(dim=2)  # [N, anchors]
    taus = [tau for lead in leading.tolist() for tau in greedy_walk(lead)]
    flat = correct.flatten(0, 1).float()
    return {"sequences": seqs.shape[0], "anchors": flat.shape[0], "rounds": len(taus),
            "accuracy_by_depth": [round(x, 4) for x in flat.mean(0).tolist()],
            "mean_accept_all_anchors": round(1 + leading.float().mean().item(), 4),
            "dflash_tau": round(sum(taus) / len(taus), 4)}


def hf_config(s: DrafterShape, dtype: str) -> dict:
    """``config.json`` of the shape ``tests/e2e/make_tiny_models.py`` shows SGLang's DFLASH accepts."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads, "head_dim": s.head_dim, "intermediate_size": s.intermediate,
        "hidden_act": "silu", "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "max_position_embeddings": s.max_positions, "vocab_size": s.vocab_size, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": dtype, "dtype": dtype,
        "block_size": s.block_size, "num_target_layers": s.num_target_layers,
        "dflash_config": {"block_size": s.block_size, "target_layer_ids": list(s.target_layer_ids),
                          "mask_token": tk.MASK_TOKEN, "mask_token_id": s.mask_id},
    }


def export(drafter: DFlashDrafter, out_dir: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write the checkpoint in ``dtype`` and load the rounded weights back (so evaluation sees the served ones)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf_config(drafter.shape, dtype_name), indent=2) + "\n")
    tk.copy_files(tokenizer_dir, out_dir)
    drafter.load_state_dict({k: v.float() for k, v in weights.items()})
    return {"shape": asdict(drafter.shape), "params": tg.param_count(drafter), "dtype": dtype_name,
            "bytes": (out_dir / "model.safetensors").stat().st_size}


def load(path: Path, device="cpu") -> DFlashDrafter:
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    dc = cfg["dflash_config"]
    s = DrafterShape(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                     head_dim=cfg["head_dim"], intermediate=cfg["intermediate_size"], block_size=dc["block_size"],
                     target_layer_ids=tuple(dc["target_layer_ids"]), num_target_layers=cfg["num_target_layers"],
                     vocab_size=cfg["vocab_size"], mask_id=dc["mask_token_id"],
                     max_positions=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
                     rms_eps=cfg["rms_norm_eps"])
    drafter = DFlashDrafter(s)
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()})
    return drafter.to(device).eval()
