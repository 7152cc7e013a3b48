"""Check our torch forwards against SGLang's own inference forwards of the same checkpoints, on the CPU.

    python -m testbed.sglang_check --pair DIR [--requests 2] [--anchors 3]

SGLang side (SGLang 0.5.23's code, not a re-implementation), after publishing a ``ServerArgs`` for the target
(``role="test"``, torch_native attention) and a tensor/pipeline-parallel group of one:

* target: ``srt/models/llama.py::LlamaForCausalLM`` built from SGLang's ``get_config``, loaded through its
  ``load_weights``, with ``set_dflash_layers_to_capture(target_layer_ids)`` (the capture DFLASH sets up), run
  over each whole sequence as one EXTEND batch; logits = its final hidden states times its ``lm_head``;
* drafter: ``srt/models/dflash.py::DFlashDraftModel`` loaded through its ``load_weights`` (q/k/v and gate/up
  fusion), the context (SGLang's captured target features before each anchor) written into a real
  ``MHATokenToKVPool`` by ``DFlashWorkerV2._append_target_hidden_sequential`` (``project_target_hidden``,
  ``kv_proj_only``, ``apply_k_norm``, ``apply_k_rope``), then ``DFlashDraftModel.forward`` over one block per
  (sequence, anchor) with ``TorchNativeAttnBackend``; draft logits = rows 1..bs-1 times the target's head, as
  the worker computes them.

What is not SGLang's: the scheduler glue (pools filled by hand), and the block runs as an EXTEND batch
(``extend_prefix_lens`` = context length) rather than the worker's TARGET_VERIFY batch, because
``TorchNativeAttnBackend`` has no TARGET_VERIFY path (the plugin adds one in
``sglang_kdtree/patches/torch_native_verify.py``); for the drafter's ``ENCODER_ONLY`` layers both attend to the whole
context and the whole block, unmasked.

Our side: ``testbed.target`` over the sequences, and ``DFlashDrafter.forward`` with all of a sequence's anchors
in one call (the multi-block training mask), on our own features.

On a CPU without a GPU build of ``sgl_kernel``, ``prepare_cpu_sglang`` sets ``SGLANG_USE_CPU_ENGINE=1`` and puts
the repo's test stand-in (``tests/e2e/sgl_kernel_stub``) on the path before SGLang is imported, as the CPU
end-to-end tests do; run this as its own process. It prints one JSON object with, for the target logits, the
captured features and the draft logits: the largest absolute difference, the largest magnitude, whether every
argmax (and top-5) agrees, the tolerance (fp32: 1e-4 x max(1, max |value|)) and ``pass``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
STUB = REPO / "tests" / "e2e" / "sgl_kernel_stub"
RELATIVE_TOLERANCE = 1e-4


def prepare_cpu_sglang() -> None:
    """Must run before the first ``import sglang`` of the process."""
    if "sglang" in sys.modules:
        raise RuntimeError("sglang is already imported; run testbed.sglang_check in a fresh process")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, str(STUB))


def load_inputs(pair: Path, requests: int, anchors: int, block_size: int):
    """``requests`` held-out sequences (prompt + the target's greedy continuation) and, for each, ``anchors``
    positions spread over the generated part."""
    rows = [json.loads(line) for line in (pair / "heldout_prompts.jsonl").read_text().splitlines()][:requests]
    seqs = torch.tensor([r["input_ids"] + r["target_greedy_ids"] for r in rows])
    prompt_len = len(rows[0]["input_ids"])
    spread = torch.linspace(prompt_len, seqs.shape[1] - block_size, anchors).round().long()
    return seqs, spread[None].expand(seqs.shape[0], -1).contiguous()


@contextmanager
def sglang_runtime(target_dir: Path):
    """The process-wide state SGLang's model classes read: a published ServerArgs and groups of one."""
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=str(target_dir), device="cpu", attention_backend="torch_native",
                       disable_cuda_graph=True), role="test")
    # No torch.distributed here: every group is this one process.
    single = types.SimpleNamespace(world_size=1, rank_in_group=0, rank=0, is_first_rank=True, is_last_rank=True)
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=single, pp_size=1, pp_rank=0, pp_group=single,
                                 attn_tp_group=single, attn_tp_size=1, attn_tp_rank=0), torch.no_grad():
        yield


class Pools:
    """Request and KV pools for requests ``i`` with ``prefix[i]`` cached tokens followed by ``extend[i]`` new
    ones, each request on a contiguous run of slots (slot 0 is the pool's padding slot)."""

    def __init__(self, prefix: list[int], extend: list[int], kv_heads: int, head_dim: int, layers: int):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.prefix, self.extend = prefix, extend
        n = len(prefix)
        lengths = [p + e for p, e in zip(prefix, extend)]
        self.req = ReqToTokenPool(size=n, max_context_len=max(lengths), device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=sum(lengths) + 1, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                   head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False)
        self.prefix_slots, self.extend_slots, first = [], [], 1
        for i, (p, total) in enumerate(zip(prefix, lengths)):
            slots = torch.arange(first, first + total)
            first += total
            self.req.req_to_token[i + 1, :total] = slots.to(torch.int32)
            self.prefix_slots.append(slots[:p])
            self.extend_slots.append(slots[p:])
        self.backend = TorchNativeAttnBackend(
            types.SimpleNamespace(device="cpu", req_to_token_pool=self.req, token_to_kv_pool=self.kv))

    def extend_batch(self, input_ids, input_embeds=None):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        seq_lens = torch.tensor([p + e for p, e in zip(self.prefix, self.extend)])
        positions = torch.cat([torch.arange(p, p + e) for p, e in zip(self.prefix, self.extend)])
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(self.prefix), input_ids=input_ids,
            req_pool_indices=torch.arange(1, len(self.prefix) + 1), seq_lens=seq_lens,
            out_cache_loc=torch.cat(self.extend_slots), seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens,
            positions=positions, extend_prefix_lens=torch.tensor(self.prefix),
            extend_seq_lens=torch.tensor(self.extend),
            input_embeds=input_embeds)


def load_sglang(cls, path: Path):
    from safetensors import safe_open

    from sglang.srt.utils.hf_transformers_utils import get_config

    model = cls(get_config(str(path), trust_remote_code=False)).float()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        model.load_weights((name, f.get_tensor(name)) for name in f.keys())
    return model.float()


def sglang_target(target_dir: Path, seqs: torch.Tensor, layer_ids):
    """Logits ``[R, T, V]`` and captured DFlash features ``[R, T, F*H]`` from SGLang's LlamaForCausalLM."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.llama import LlamaForCausalLM

    model = load_sglang(LlamaForCausalLM, target_dir)
    model.set_dflash_layers_to_capture(list(layer_ids))
    cfg = model.config
    r, t = seqs.shape
    pools = Pools([0] * r, [t] * r, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
    batch = pools.extend_batch(seqs.flatten())
    with forward_context(ForwardContext(attn_backend=pools.backend)):
        hidden, aux = model.model(batch.input_ids, batch.positions, batch)
    logits = torch.matmul(hidden, model.lm_head.weight.T)
    return logits.view(r, t, -1), torch.cat(list(aux), dim=-1).view(r, t, -1), model


def sglang_drafter(draft_dir: Path, features, seqs, anchors, embed_weight, head_weight, mask_id: int):
    """Draft logits ``[R, nb, bs-1, V]`` from SGLang's DFlashDraftModel, one request per (sequence, anchor):
    context = the features before the anchor, block = ``[token at anchor, MASK...]`` at anchor, anchor+1, ...."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    model = load_sglang(DFlashDraftModel, draft_dir)
    attn = model.layers[0].self_attn
    r, nb = anchors.shape
    bs = model.block_size
    ctx_lens = anchors.flatten().tolist()
    pools = Pools(ctx_lens, [bs] * len(ctx_lens), attn.num_kv_heads, attn.head_dim, len(model.layers))
    worker = types.SimpleNamespace(draft_model=model,
                                   draft_model_runner=types.SimpleNamespace(token_to_kv_pool=pools.kv))
    ctx = torch.cat([features[i // nb, :p] for i, p in enumerate(ctx_lens)])
    DFlashWorkerV2._append_target_hidden_sequential(
        worker, ctx_hidden=model.project_target_hidden(ctx),
        ctx_positions=torch.cat([torch.arange(p) for p in ctx_lens]), ctx_cache_loc=torch.cat(pools.prefix_slots))
    block_ids = torch.full((len(ctx_lens), bs), mask_id, dtype=torch.long)
    block_ids[:, 0] = seqs.gather(1, anchors).flatten()
    embeds = torch.nn.functional.embedding(block_ids.flatten(), embed_weight)
    batch = pools.extend_batch(block_ids.flatten(), embeds)
    with forward_context(ForwardContext(attn_backend=pools.backend)):
        hidden = model.forward(batch.input_ids, batch.positions, batch, input_embeds=embeds).hidden_states
    logits = torch.matmul(hidden.view(len(ctx_lens), bs, -1)[:, 1:], head_weight.T)
    return logits.view(r, nb, bs - 1, -1)


def compare(ours: torch.Tensor, theirs: torch.Tensor, logits: bool = True) -> dict:
    scale = max(1.0, ours.abs().max().item())
    diff = (ours - theirs).abs().max().item()
    out = {"max_abs_diff": diff, "max_abs": ours.abs().max().item(), "tolerance": RELATIVE_TOLERANCE * scale}
    ok = diff <= out["tolerance"]
    if logits:
        out["argmax_agreement"] = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        out["top5_identical"] = bool((ours.topk(5, dim=-1).indices == theirs.topk(5, dim=-1).indices).all())
        ok = ok and out["argmax_agreement"] == 1.0
    out["pass"] = ok
    return out


def run(pair: Path, requests: int = 2, anchors: int = 3) -> dict:
    """Both sides in fp32 on the CPU (the checkpoints are bf16: upcast exactly)."""
    from testbed import drafter as dr
    from testbed import target as tg

    target = tg.load(pair / "target")
    drafter = dr.load(pair / "drafter")
    layer_ids = drafter.shape.target_layer_ids
    seqs, anchor_pos = load_inputs(pair, requests, anchors, drafter.shape.block_size)
    with torch.no_grad():
        our_logits, captured = target(seqs, capture=layer_ids)
        our_features = torch.cat(captured, dim=-1)
        our_draft, _ = dr.logits_and_labels(drafter, target, seqs, anchor_pos, our_features)
    with sglang_runtime(pair / "target"):
        sg_logits, sg_features, sg_target = sglang_target(pair / "target", seqs, layer_ids)
        sg_draft = sglang_drafter(pair / "drafter", sg_features, seqs, anchor_pos,
                                  sg_target.model.embed_tokens.weight, sg_target.lm_head.weight,
                                  drafter.shape.mask_id)
    result = {"target_logits": compare(our_logits, sg_logits), "features": compare(our_features, sg_features, False),
              "draft_logits": compare(our_draft, sg_draft), "sequences": requests, "tokens": seqs.numel(),
              "anchors": anchor_pos.tolist(), "draft_rows": int(our_draft[..., 0].numel())}
    result["pass"] = all(result[k]["pass"] for k in ("target_logits", "features", "draft_logits"))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--anchors", type=int, default=3)
    args = parser.parse_args(argv)
    prepare_cpu_sglang()
    result = run(args.pair, args.requests, args.anchors)
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
