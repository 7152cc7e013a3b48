"""The target: a Llama that SGLang 0.5.23 serves natively (``LlamaForCausalLM``), in plain torch.

The module computes what Hugging Face's ``LlamaForCausalLM`` computes (RMSNorm in fp32, rotate-half RoPE,
SwiGLU MLP, tied input/output embeddings) and its ``state_dict`` keys are the checkpoint's, so ``export``
writes a checkpoint that both transformers and SGLang load (``tests/test_testbed_pair.py`` checks the logits
against transformers). Training is a plain seeded loop over random windows of the token stream; the held-out
loss is measured on fixed windows of the held-out stream, and the weights kept are those of the evaluation
with the lowest held-out loss (the corpus is small: a few epochs overfit).

Why the default shape (``build_pair.FULL``: hidden 320, 6 layers, 5 heads of 64, MLP 768, vocab 4096, tied
embeddings, 8.2 M parameters): the checkpoint is written in bf16 (15.6 MiB), under the 16 MiB a file may
have to come back from the GPU machine, and the whole pair (with the 5 MiB drafter) stays near the 25 MiB the
issue budgets for travelling with the SGLang wheels. bf16 also upcasts exactly, so a CPU server run in fp32
computes these same weights. Head size 64 is one every SGLang GPU attention backend supports.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from testbed import tokenizer as tk


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch: int  # sequences per step
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    eval_every: int
    eval_windows: int


# ------------------------------------------------------------------------------------------------------
# the model (shared pieces are used by the drafter too)
# ------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin ``[*positions.shape, head_dim]`` in fp32 (rotate-half layout, SGLang's neox style)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """``x [..., T, heads, D]`` with cos/sin broadcastable to ``[..., T, 1, D]``."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.heads, self.head_dim = s.heads, s.head_dim
        width = s.heads * s.head_dim
        self.q_proj = nn.Linear(s.hidden, width, bias=False)
        self.k_proj = nn.Linear(s.hidden, width, bias=False)
        self.v_proj = nn.Linear(s.hidden, width, bias=False)
        self.o_proj = nn.Linear(width, s.hidden, bias=False)

    def forward(self, x, cos, sin, cache=None, start: int = 0):
        """Causal self-attention over ``x [B, T, H]``. With ``cache`` (a ``(k, v)`` pair of
        ``[B, heads, max_len, D]`` buffers) the new keys are written at ``start..start+T`` and attention runs
        over ``0..start+T``; only a prefill from 0 or a one-token step is needed (and allowed)."""
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim)  # noqa: E731
        q = apply_rope(split(self.q_proj(x)), cos, sin).transpose(1, 2)
        k = apply_rope(split(self.k_proj(x)), cos, sin).transpose(1, 2)
        v = split(self.v_proj(x)).transpose(1, 2)
        if cache is not None:
            if not (start == 0 or t == 1):
                raise ValueError(f"cached attention takes a prefill from 0 or one token, got start={start}, T={t}")
            cache[0][:, :, start:start + t] = k
            cache[1][:, :, start:start + t] = v
            k, v = cache[0][:, :, :start + t], cache[1][:, :, :start + t]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s.hidden, s.intermediate)
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)

    def forward(self, x, cos, sin, cache=None, start: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.rms_eps)


class Llama(nn.Module):
    """``state_dict`` keys are HF's (``model.layers.0.self_attn.q_proj.weight``, ...); the output head is the
    input embedding (``tie_word_embeddings``), so there is no ``lm_head.weight``."""

    def __init__(self, s: TargetShape):
        super().__init__()
        self.shape = s
        self.model = LlamaBody(s)
        init_weights(self)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def forward(self, ids, capture=(), cache=None, start: int = 0, last_only: bool = False, head: bool = True):
        """Logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``; None without ``head``, which also stops after
        the deepest captured layer) and the outputs of the layers in ``capture`` (HF ``hidden_states[i + 1]``:
        what SGLang's DFlash capture of target layer i returns)."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        cos, sin = rope_tables(positions, self.shape.head_dim, self.shape.rope_theta)
        x = self.model.embed_tokens(ids)
        captured = []
        for i, layer in enumerate(self.model.layers):
            if not head and i > max(capture):
                break
            x = layer(x, cos, sin, None if cache is None else cache[i], start)
            if i in capture:
                captured.append(x)
        if not head:
            return None, captured
        if last_only:
            x = x[:, -1:]
        return F.linear(self.model.norm(x), self.head_weight), captured


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF's ``initializer_range`` init: N(0, std) matrices and embeddings, unit norms. PyTorch's defaults
    (N(0, 1) embeddings) would start the tied head with logits of ~sqrt(hidden) spread."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------------


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the H200's fast path); fp32 on the CPU, where bf16 matmuls are slow."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def random_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length + 1, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(length)]


def heldout_windows(stream: torch.Tensor, length: int, limit: int) -> torch.Tensor:
    """Non-overlapping windows from the start of the held-out stream: fixed, so every evaluation agrees."""
    n = min(limit, stream.numel() // length)
    if n == 0:
        raise ValueError(f"held-out stream of {stream.numel()} tokens has no window of {length}")
    return stream[: n * length].view(n, length)


@torch.no_grad()
def heldout_loss(model: Llama, windows: torch.Tensor, device, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with autocast(device):
            logits, _ = model(w[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train(model: Llama, train_stream: torch.Tensor, heldout_stream: torch.Tensor, cfg: TrainSettings,
          device: torch.device, seed: int, log=print) -> dict:
    """Train in place; load the best-held-out weights at the end. Returns the curve and the timings."""
    gen = torch.Generator().manual_seed(seed)
    windows = heldout_windows(heldout_stream, cfg.seq_len + 1, cfg.eval_windows)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    curve, best, best_state = [], math.inf, None
    model.train()
    started, train_time, train_loss = time.perf_counter(), 0.0, float("nan")
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            loss_h = heldout_loss(model, windows, device, cfg.batch)
            curve.append({"step": step, "tokens": step * cfg.batch * cfg.seq_len, "train_loss": round(train_loss, 4),
                          "heldout_loss": round(loss_h, 4)})
            log(f"  target step {step:5d}: train {train_loss:.3f}  held-out {loss_h:.3f}")
            if loss_h < best:
                best = loss_h
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if step == cfg.steps:
            break
        t0 = time.perf_counter()
        batch = random_windows(train_stream, cfg.batch, cfg.seq_len + 1, gen).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
        with autocast(device):
            logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss = loss.item()  # also a sync point, so the step timing below is honest
        train_time += time.perf_counter() - t0
    model.load_state_dict(best_state)
    model.eval()
    kept = min(curve, key=lambda c: c["heldout_loss"])
    tokens = cfg.steps * cfg.batch * cfg.seq_len
    return {"curve": curve, "kept_step": kept["step"], "heldout_loss": kept["heldout_loss"],
            "heldout_perplexity": round(math.exp(kept["heldout_loss"]), 3),
            "heldout_eval_tokens": windows[:, 1:].numel(), "train_tokens": tokens,
            "train_seconds": round(train_time, 1), "train_tokens_per_s": round(tokens / max(train_time, 1e-9)),
            "seconds": round(time.perf_counter() - started, 1)}


# ------------------------------------------------------------------------------------------------------
# checkpoint
# ------------------------------------------------------------------------------------------------------


def hf_config(s: TargetShape, dtype: str) -> dict:
    """``config.json`` for ``LlamaForCausalLM``; both the transformers 4 and 5 spellings of dtype and rope."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.heads,
        "head_dim": s.head_dim, "hidden_act": "silu", "max_position_embeddings": s.max_positions,
        "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta}, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": tk.EOS_ID, "eos_token_id": tk.EOS_ID, "pad_token_id": tk.PAD_ID,
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
    }


def export(model: Llama, out_dir: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write ``config.json``, ``model.safetensors`` (in ``dtype``) and the tokenizer; then load the rounded
    weights back into ``model``, so everything downstream (continuations, drafter) sees the served weights."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf_config(model.shape, dtype_name), indent=2) + "\n")
    tk.copy_files(tokenizer_dir, out_dir)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return {"shape": asdict(model.shape), "params": param_count(model), "dtype": dtype_name,
            "bytes": (out_dir / "model.safetensors").stat().st_size}


def load(path: Path, device="cpu") -> Llama:
    """Our module from an exported checkpoint, in fp32."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    s = TargetShape(vocab_size=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                    heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"],
                    intermediate=cfg["intermediate_size"], max_positions=cfg["max_position_embeddings"],
                    rope_theta=cfg["rope_theta"], rms_eps=cfg["rms_norm_eps"])
    model = Llama(s)
    model.load_state_dict({k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()})
    return model.to(device).eval()


# ------------------------------------------------------------------------------------------------------
# greedy continuations
# ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_continue(model: Llama, prompts: torch.Tensor, new_tokens: int, batch: int, device) -> torch.Tensor:
    """``[N, p + new_tokens]``: each prompt followed by the model's greedy continuation (argmax in fp32, lower
    id on ties, as ``torch.argmax``), computed with a KV cache under the training numerics (bf16 autocast on
    CUDA, fp32 on the CPU). Generation runs through ``<|endoftext|>``: what follows it is still the target's
    own greedy output."""
    s = model.shape
    cache_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = torch.empty(prompts.shape[0], prompts.shape[1] + new_tokens, dtype=torch.long)
    for i in range(0, prompts.shape[0], batch):
        seq = prompts[i:i + batch].to(device)
        b, p = seq.shape
        cache = [tuple(torch.empty(b, s.heads, p + new_tokens, s.head_dim, device=device, dtype=cache_dtype)
                       for _ in range(2)) for _ in range(s.layers)]
        tokens = [seq]
        with autocast(device):
            logits, _ = model(seq, cache=cache, start=0, last_only=True)
            for t in range(new_tokens):
                nxt = logits[:, -1].float().argmax(-1, keepdim=True)
                tokens.append(nxt)
                if t + 1 < new_tokens:
                    logits, _ = model(nxt, cache=cache, start=p + t)
        out[i:i + b] = torch.cat(tokens, dim=1).cpu()
    return out
