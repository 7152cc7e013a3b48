"""Build the testbed pair in one command: corpus -> tokenizer -> target -> greedy continuations -> drafter.

    python -m testbed.build_pair --out DIR [--device cuda] [--tiny] [--seed 0]
                                 [--target-steps N] [--drafter-steps N] [--corpus-root PATH]

writes ``DIR/target`` (LlamaForCausalLM), ``DIR/drafter`` (DFlashDraftModel for SGLang's DFLASH / KDTREE),
``DIR/heldout_prompts.jsonl`` (held-out prompts as token ids and text, with the target's greedy
continuation) and ``DIR/metadata.json`` (sizes, curves, seeds, interpreter, versions, commit, timings; rewritten
after every stage, so a run cut short still says how far it got), then prints a table.

Presets (``FULL`` is the default, for the H200; ``TINY`` runs on a 2-core CPU in well under two minutes and is
what the tests build). Expected H200 time for ``FULL``, from FLOP counts at 50-150 TFLOP/s effective (these
matrices are small: 320 wide):

* target: 600 steps x 32 k tokens, ~1.7 TFLOP a step (6 x 8.2 M parameters x tokens, plus causal attention):
  ~15-35 s, i.e. 0.5-1.3 M tokens/s;
* continuations: 16,384 prompts x 448 greedy tokens in batches of 2,048 (448 cached decode steps a batch,
  ~100 small kernels a step): ~10-20 s;
* drafter: 4,000 steps x 2,048 blocks, ~1.4 TFLOP a step (the frozen target up to layer 4 on 16 k tokens
  0.2, the drafter on 32 k block rows 0.45, masked attention over 512 + 1,024 keys 0.4, the head 0.25):
  ~1.5-4 min;
* tokenizer (CPU), held-out evaluation, start-up: ~1 min.

About 3-6 minutes in all; ``metadata.json`` records the measured tokens/s and blocks/s of each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from testbed import corpus as cp
from testbed import drafter as dr
from testbed import target as tg
from testbed import tokenizer as tk

HERE = Path(__file__).resolve().parent

FULL = {
    "name": "full",
    "corpus": {"max_files": None, "max_heldout_files": None},
    "vocab_size": 4096,
    "target": tg.TargetShape(vocab_size=4096, hidden=320, layers=6, heads=5, head_dim=64, intermediate=768),
    "target_train": tg.TrainSettings(steps=600, batch=64, seq_len=512, lr=2e-3, warmup=60, weight_decay=0.1,
                                     eval_every=50, eval_windows=256),
    # prompts from the training split, then the target's greedy continuation: 512 tokens a sequence
    "continuations": {"prompts": 16384, "prompt_len": 64, "new_tokens": 448, "batch": 2048},
    "heldout_prompts": 256,
    "drafter": {"layers": 2, "heads": 5, "head_dim": 64, "intermediate": 768, "block_size": 16,
                # spread over the depth, ending at the deepest layer SGLang's capture reaches (L - 2)
                "target_layer_ids": (0, 2, 4)},
    "drafter_train": dr.DrafterTrainSettings(steps=4000, sequences=32, anchors=64, lr=2e-3, warmup=100,
                                             weight_decay=0.01, loss_gamma=7.0, eval_every=250),
    "dtype": torch.bfloat16,
}

TINY = {
    "name": "tiny",
    "corpus": {"max_files": 40, "max_heldout_files": 4},
    "vocab_size": 512,
    "target": tg.TargetShape(vocab_size=512, hidden=64, layers=4, heads=4, head_dim=16, intermediate=160),
    "target_train": tg.TrainSettings(steps=60, batch=8, seq_len=64, lr=3e-3, warmup=10, weight_decay=0.1,
                                     eval_every=20, eval_windows=8),
    "continuations": {"prompts": 48, "prompt_len": 16, "new_tokens": 64, "batch": 48},
    "heldout_prompts": 4,
    "drafter": {"layers": 1, "heads": 4, "head_dim": 16, "intermediate": 160, "block_size": 16,
                "target_layer_ids": (0, 1, 2)},
    "drafter_train": dr.DrafterTrainSettings(steps=30, sequences=8, anchors=8, lr=3e-3, warmup=5,
                                             weight_decay=0.0, loss_gamma=7.0, eval_every=10),
    "dtype": torch.bfloat16,
}


def code_digest() -> str:
    """sha256 of this package's sources: identifies the recipe where no git checkout travels."""
    h = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None}
        dirty = git("status", "--porcelain", "--", str(HERE)).stdout.strip()
        return {"commit": head.stdout.strip(), "testbed_dirty": bool(dirty)}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None}


def versions() -> dict:
    import safetensors
    import tokenizers

    return {"python": platform.python_version(), "torch": torch.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__}


def heldout_prompts(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` prompts at evenly spaced offsets of the held-out stream (no randomness: the same prompts for
    every seed)."""
    if stream.numel() < length:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, fewer than one prompt of {length}")
    starts = torch.linspace(0, stream.numel() - length, n).long()
    return stream[starts[:, None] + torch.arange(length)]


def repeated_ngram_fraction(seqs: torch.Tensor, start: int, n: int = 8) -> float:
    """Share of the generated positions (from ``start``) whose preceding n-gram already occurred earlier in the
    same sequence: how much of the greedy output is a loop, which makes drafting easier than on real text."""
    repeated = total = 0
    for row in seqs.tolist():
        seen = {tuple(row[i - n:i]) for i in range(n, start + 1)}
        for i in range(start + 1, len(row) + 1):
            gram = tuple(row[i - n:i])
            repeated += gram in seen
            total += 1
            seen.add(gram)
    return repeated / max(total, 1)


class Build:
    """One build: the stages in order, ``metadata`` rewritten after each."""

    def __init__(self, out: Path, preset: dict, device: torch.device, seed: int, corpus_root, log=print):
        self.out, self.preset, self.device, self.seed, self.log = out, preset, device, seed, log
        self.corpus_root = corpus_root
        self.started = time.perf_counter()
        self.metadata = {"preset": preset["name"], "seed": seed, "device": str(device), "command": sys.argv,
                         "code_digest": code_digest(), **git_commit(), "versions": versions(), "timings_s": {}}

    def save_metadata(self) -> None:
        self.metadata["timings_s"]["total"] = round(time.perf_counter() - self.started, 1)
        (self.out / "metadata.json").write_text(json.dumps(self.metadata, indent=2, default=str) + "\n")

    def stage(self, name: str, fn):
        t0 = time.perf_counter()
        self.log(f"[{name}]")
        result = fn()
        self.metadata["timings_s"][name] = round(time.perf_counter() - t0, 1)
        self.save_metadata()
        return result

    def run(self) -> dict:
        p = self.preset
        self.out.mkdir(parents=True, exist_ok=True)
        corpus = self.stage("corpus", lambda: cp.load(self.corpus_root, **p["corpus"]))
        self.metadata["corpus"] = cp.describe(corpus)
        streams = self.stage("tokenizer", lambda: self.tokenize(corpus))
        target = self.stage("target", lambda: self.train_target(*streams))
        seqs, eval_seqs = self.stage("continuations", lambda: self.continuations(target, *streams))
        self.stage("drafter", lambda: self.train_drafter(target, seqs, eval_seqs))
        return self.metadata

    def tokenize(self, corpus: cp.Corpus):
        tok = tk.train([f.text for f in corpus.train], self.preset["vocab_size"])
        tk.save(tok, self.out / "tokenizer")
        train = torch.tensor(tk.encode_stream(tok, [f.text for f in corpus.train]), dtype=torch.long)
        heldout = torch.tensor(tk.encode_stream(tok, [f.text for f in corpus.heldout]), dtype=torch.long)
        self.metadata["corpus"]["train"]["tokens"] = train.numel()
        self.metadata["corpus"]["heldout"]["tokens"] = heldout.numel()
        self.metadata["tokenizer"] = {"kind": "byte-level BPE (tokenizers), trained on the training split",
                                      "vocab_size": tok.get_vocab_size(), "eos_id": tk.EOS_ID, "pad_id": tk.PAD_ID,
                                      "mask_id": tk.MASK_ID,
                                      "train_bytes_per_token": round(self.metadata["corpus"]["train"]["bytes"]
                                                                     / train.numel(), 3)}
        self.tok = tok
        return train, heldout

    def train_target(self, train_stream, heldout_stream) -> tg.Llama:
        torch.manual_seed(self.seed)
        model = tg.Llama(self.preset["target"]).to(self.device)
        self.log(f"  {tg.param_count(model):,} parameters")
        curve = tg.train(model, train_stream, heldout_stream, self.preset["target_train"], self.device,
                         seed=self.seed + 1, log=self.log)
        exported = tg.export(model, self.out / "target", self.out / "tokenizer", self.preset["dtype"])
        model.to(self.device)
        self.metadata["target"] = {"architecture": "LlamaForCausalLM", **exported,
                                   "train_settings": asdict(self.preset["target_train"]), **curve}
        return model

    def continuations(self, target: tg.Llama, train_stream, heldout_stream):
        c = self.preset["continuations"]
        gen = torch.Generator().manual_seed(self.seed + 2)
        prompts = tg.random_windows(train_stream, c["prompts"], c["prompt_len"], gen)
        t0 = time.perf_counter()
        seqs = tg.greedy_continue(target, prompts, c["new_tokens"], c["batch"], self.device)
        seconds = time.perf_counter() - t0
        held = heldout_prompts(heldout_stream, self.preset["heldout_prompts"], c["prompt_len"])
        eval_seqs = tg.greedy_continue(target, held, c["new_tokens"], c["batch"], self.device)
        with (self.out / "heldout_prompts.jsonl").open("w") as f:
            for i, row in enumerate(eval_seqs.tolist()):
                prompt, cont = row[: c["prompt_len"]], row[c["prompt_len"]:]
                text = self.tok.decode(prompt, skip_special_tokens=False)
                f.write(json.dumps({"index": i, "input_ids": prompt, "text": text, "target_greedy_ids": cont}) + "\n")
        self.metadata["continuations"] = {
            **c, "source": "random windows of the training stream, then the target's greedy continuation",
            "numerics": "bf16 autocast on CUDA, fp32 on the CPU; argmax in fp32, lower id on ties",
            "generated_tokens": c["prompts"] * c["new_tokens"], "seconds": round(seconds, 1),
            "tokens_per_s": round(c["prompts"] * c["new_tokens"] / max(seconds, 1e-9)),
            "distinct_continuations": len({tuple(r) for r in seqs[:, c["prompt_len"]:].tolist()}),
            "heldout_prompts": held.shape[0],
            "heldout_repeated_8gram_fraction": round(repeated_ngram_fraction(eval_seqs, c["prompt_len"]), 4)}
        return seqs, eval_seqs

    def train_drafter(self, target: tg.Llama, seqs, eval_seqs) -> None:
        p, s = self.preset, self.preset["target"]
        shape = dr.DrafterShape(hidden=s.hidden, vocab_size=s.vocab_size, num_target_layers=s.layers,
                                **p["drafter"])
        torch.manual_seed(self.seed + 3)
        drafter = dr.DFlashDrafter(shape).to(self.device)
        self.log(f"  {tg.param_count(drafter):,} parameters")
        prompt_len = p["continuations"]["prompt_len"]
        curve = dr.train(drafter, target, seqs, prompt_len, p["drafter_train"], self.device, seed=self.seed + 4,
                         eval_seqs=eval_seqs, log=self.log)
        exported = dr.export(drafter, self.out / "drafter", self.out / "tokenizer", p["dtype"])
        drafter.to(self.device)
        acceptance = dr.offline_acceptance(drafter, target, eval_seqs, prompt_len, self.device)
        self.metadata["drafter"] = {"architecture": "DFlashDraftModel", **exported,
                                    "train_settings": asdict(p["drafter_train"]), **curve,
                                    "heldout_offline_acceptance": acceptance}
        self.metadata["pair_bytes"] = self.metadata["target"]["bytes"] + exported["bytes"]


def table(m: dict) -> str:
    c, t, d = m["corpus"], m["target"], m.get("drafter", {})
    acc = d.get("heldout_offline_acceptance", {})
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    rows = [
        ("corpus", f"Python {c['python_version']} stdlib: train {c['train']['files']} files / {c['train']['bytes']:,} B"
                   f" / {c['train'].get('tokens', 0):,} tok; held-out {c['heldout']['files']} / "
                   f"{c['heldout']['bytes']:,} B / {c['heldout'].get('tokens', 0):,} tok"),
        ("tokenizer", f"byte-level BPE, vocab {m['tokenizer']['vocab_size']}, "
                      f"{m['tokenizer']['train_bytes_per_token']} B/token"),
        ("target", f"Llama {t['params']:,} params, {mib(t['bytes'])} {t['dtype']}; held-out loss {t['heldout_loss']} "
                   f"(ppl {t['heldout_perplexity']}) at step {t['kept_step']}/{t['train_settings']['steps']}; "
                   f"{t['train_tokens_per_s']:,} tok/s"),
        ("continuations", f"{m['continuations']['prompts']} x {m['continuations']['new_tokens']} greedy tokens, "
                          f"{m['continuations']['tokens_per_s']:,} tok/s; held-out: "
                          f"{m['continuations']['heldout_repeated_8gram_fraction']:.0%} of positions repeat an 8-gram"),
    ]
    if d:
        rows += [
            ("drafter", f"DFlash {d['params']:,} params, {mib(d['bytes'])} {d['dtype']}, block "
                        f"{d['shape']['block_size']}, target layers {d['shape']['target_layer_ids']}; held-out loss "
                        f"{d['curve'][-1]['heldout_loss']}; {d['train_blocks_per_s']:,} blocks/s"),
            ("offline tau", f"DFLASH greedy walk {acc['dflash_tau']} over {acc['rounds']} rounds; depth 1/2/4/8 acc "
                            + "/".join(str(acc["accuracy_by_depth"][i]) for i in (0, 1, 3, 7)
                                       if i < len(acc["accuracy_by_depth"]))),
            ("pair", f"{mib(m['pair_bytes'])}"),
        ]
    rows.append(("seconds", " ".join(f"{k} {v}" for k, v in m["timings_s"].items())))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the CPU test preset (TINY)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int)
    parser.add_argument("--drafter-steps", type=int)
    parser.add_argument("--corpus-root", type=Path, help="default: the running interpreter's stdlib")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; pass --device cpu")
    preset = dict(TINY if args.tiny else FULL)
    if args.target_steps is not None:
        preset["target_train"] = replace(preset["target_train"], steps=args.target_steps)
    if args.drafter_steps is not None:
        preset["drafter_train"] = replace(preset["drafter_train"], steps=args.drafter_steps)
    metadata = Build(args.out, preset, device, args.seed, args.corpus_root).run()
    print(table(metadata))
    return 0


if __name__ == "__main__":
    sys.exit(main())
