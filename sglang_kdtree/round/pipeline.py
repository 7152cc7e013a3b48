"""The DDTree round's tensor operations behind one backend object: the CPU reference or the GPU kernels.

``select_backend(device)`` is the single place that decides which implementation a worker runs:
``reference_backend.ReferenceBackend`` (``sglang_kdtree.reference``, numpy, exact oracle) on CPU,
``gpu.backend.GpuBackend`` (``sglang_kdtree.gpu.*``, CuPy/NVRTC kernels, loaded only when one is built, so CPU
installs never load CuPy) on CUDA. Both implement ``contract.RoundBackend`` and return its dataclasses
(``Trees``, ``VerifyInputs``, ``AcceptResult``, ``CommitPlan``) with the same shapes and dtypes:

* ``topk(logits [bs, L, V], k)`` -> ``(logprobs [bs, L, K] float32, ids [bs, L, K] int64)``;
* ``shard_topk(logits_shard, k, id_offset)`` / ``merge_topk(vals [S,...], ids, lse, k)``: the
  tensor-parallel halves (``vocab_parallel_topk`` moves only ``S*K`` candidates + one lse per row);
* ``build(logprobs, ids, budget, roots [bs])`` -> ``Trees`` (``tokens/depths/parents [bs, N]``, ``num_nodes [bs]``);
* ``tree_step(rows [bs*L, D], lm_head weight, shape, roots, seq_lens, seq_lens_sum)`` -> ``TreeStep`` (trees cut
  to ``shape.width``, verify inputs, expected accepts per tier, draft logits): the head GEMM, then
  ``contract.topk_tree_verify`` (``topk``, ``build``, the cut, ``verify_inputs``), in one call;
  ``accept_commit_greedy(trees, logits, depth, verify_slots, pool, hidden, width)`` -> ``(accept, plan,
  hidden rows)``: ``accept_greedy``, ``commit_plan``, ``commit_kv``, ``gather_hidden`` in one call (the GPU
  backend replays both from CUDA graphs, ``gpu.round_graphs``);
* ``verify_inputs(trees, seq_lens [bs], seq_lens_sum)`` -> ``VerifyInputs``: ``input_ids/positions [bs*N]``,
  ``full_mask`` (SGLang FULL_MASK), ``ancestor_bits``, ``retrieve_*``;
* ``accept_greedy(trees, logits [bs, N, V], max_depth)`` / ``accept_sampled(..., temperatures, seeds,
  seq_lens, max_depth, top_ks=None, top_ps=None, min_ps=None)`` -> ``AcceptResult``: ``accepted [bs, L+1]``,
  ``accept_lens [bs]`` (tau, bonus included), ``bonus [bs]``, ``committed [bs, N]``, ``errors [bs]``;
* ``commit_plan(accepted, accept_lens, verify_slots [bs, N])`` -> ``CommitPlan``: ``src_slots/dst_slots/
  hidden_rows [bs, L+1]``;
* ``commit_kv(pool, plan)`` moves the accepted KV rows; ``gather_hidden(hidden, plan, width)`` -> the accepted
  rows' hidden states ``[bs, min(L+1, N), D]``;
* ``reserve(batch, budget, depth, vocab, mask_bytes)`` sizes the round's buffers (GPU; a no-op on CPU).

Faults: neither backend raises on bad values in one request (``contract``).

Semantics are those of ``reference`` (shared/notes/ddtree.md); the reference backend is the product on
CPU, not a stand-in, and the GPU kernels are tested bit-exact against it.
"""

from __future__ import annotations

import torch

from sglang_kdtree.contract import (AcceptResult, CommitPlan, RoundBackend, Trees, TreeStep, VerifyInputs,
                                    eager_accept_commit_greedy, eager_tree_step, move_kv_with_sglang,
                                    topk_tree_verify, tree_verify)
from sglang_kdtree.gpu.backend import GpuBackend
from sglang_kdtree.gpu.verify import full_mask_numel
from sglang_kdtree.reference.backend import ReferenceBackend
from sglang_kdtree.state import RoundShape

__all__ = ["AcceptResult", "CommitPlan", "GpuBackend", "ReferenceBackend", "RoundBackend", "RoundShape", "Trees",
           "TreeStep", "VerifyInputs", "bookkeeping_round", "eager_accept_commit_greedy", "eager_tree_step",
           "full_mask_numel", "move_kv_with_sglang", "select_backend", "topk_tree_verify", "tree_verify",
           "vocab_parallel_topk"]


def select_backend(device) -> RoundBackend:
    """The one decision point: GPU kernels on a CUDA device, the reference everywhere else."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return GpuBackend(dev)
    return ReferenceBackend(dev)


def vocab_parallel_topk(local_logits: torch.Tensor, k: int, id_offset: int, backend, group=None):
    """Top-K log-probs over a vocabulary split across tensor-parallel ranks, without gathering it.

    Args:
        local_logits: ``[rows, V_local]`` this rank's logits (its slice of the vocabulary, starting at global
            id ``id_offset``); every rank must hold the same number of columns.
        k: requested K; group: a ``torch.distributed`` process group (``None``: the default group; a world of
            one skips communication).

    Each rank computes its top-``K`` raw logits, global ids and its row logsumexp
    (``reference.shard_topk_partials``); one ``all_gather`` moves ``world * rows * (2K + 1)`` numbers, and
    every rank merges identically (``reference.merge_topk_partials``), so all ranks build the same trees.
    Returns ``(logprobs [rows, K], ids [rows, K])``.
    """
    import torch.distributed as dist

    vals, ids, lse = backend.shard_topk(local_logits, k, id_offset)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return backend.merge_topk(vals[None], ids[None], lse[None], k)
    gathered_vals = [torch.empty_like(vals) for _ in range(world)]
    gathered_ids = [torch.empty_like(ids) for _ in range(world)]
    gathered_lse = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(gathered_vals, vals.contiguous(), group=group)
    dist.all_gather(gathered_ids, ids.contiguous(), group=group)
    dist.all_gather(gathered_lse, lse.contiguous(), group=group)
    return backend.merge_topk(torch.stack(gathered_vals), torch.stack(gathered_ids), torch.stack(gathered_lse), k)


def bookkeeping_round(backend, draft_logits, shape: RoundShape, roots, seq_lens, seq_lens_sum: int, target_logits,
                      verify_slots, hidden, temperatures=None, seeds=None):
    """The backend steps of one round without the model forwards between them (the startup rehearsal and the
    bench CLI run it on synthetic inputs): reserve -> ``contract.topk_tree_verify`` (top-K, tree, cut, verify
    inputs) -> accept (greedy; sampled when ``temperatures`` / ``seeds`` are given) -> commit plan -> accepted
    hidden rows (no KV move: there is no pool). ``draft_logits`` ``[bs, L, V]``; ``target_logits``, ``verify_slots``
    and ``hidden`` at ``shape.width`` rows per request. Returns ``(tree step, accept, plan, hidden_rows)``."""
    bs = draft_logits.shape[0]
    backend.reserve(bs, shape.budget, shape.depths, shape.vocab, full_mask_numel(seq_lens_sum, shape.full_width, bs))
    step = topk_tree_verify(backend, draft_logits.flatten(0, 1), shape, roots, seq_lens, seq_lens_sum)
    if temperatures is None:
        acc = backend.accept_greedy(step.trees, target_logits, shape.depths)
    else:
        acc = backend.accept_sampled(step.trees, target_logits, temperatures, seeds, seq_lens, shape.depths)
    plan = backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
    return step, acc, plan, backend.gather_hidden(hidden, plan, shape.width)
