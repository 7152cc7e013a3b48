"""The target's tree-verify input: ``KDTreeVerifyInput`` and the forward batch a round verifies with.

``KDTreeVerifyInput`` is DFLASH's verify input carrying the tree: SGLang's FULL_MASK as ``custom_mask`` (the
prefix, then ancestor-or-self) and ``topk=2`` (fa3 / triton plan a tree mask when ``topk > 1``), plus the
DDTree extras that tree-aware kernels read (``sglang_kdtree/patches/mla_tree_verify.py`` reads ``ancestor_bits``). The
CUDA-graph patch (``sglang_kdtree/patches/verify_graph_spec_info.py``) captures the target's verify graph with one.
"""

from __future__ import annotations

import torch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


class KDTreeVerifyInput(DFlashVerifyInput):
    """DFLASH's verify input carrying the tree: ``custom_mask`` (FULL_MASK) plus the DDTree extras that
    tree-aware kernels read (``sglang_kdtree/patches/mla_tree_verify.py`` reads ``ancestor_bits``)."""

    ancestor_bits: torch.Tensor | None = None
    retrieve_index: torch.Tensor | None = None
    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None


def tree_verify_batch(target_worker, batch, verify, verify_slots, prefix_lens, prefix_cpu, width: int):
    """The TARGET_VERIFY forward batch of a round: the N rows of ``verify`` (``contract.VerifyInputs``) per
    request, written into KV slots ``verify_slots`` ``[bs, N]`` (``req_to_token[req, P:P+N]``) after the
    committed prefixes ``prefix_lens`` (``prefix_cpu`` their host copy). Returns ``(forward_batch, kv_plan)``;
    the round's drafter write reads ``kv_plan`` too. ``batch.out_cache_loc`` is left at the verify slots;
    its host lengths are put back."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    seq_lens_cpu_verify = prefix_cpu + width
    plan = target_worker.model_runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=seq_lens_cpu_verify,
        write_virtual=verify_slots.reshape(-1), read_extent=width,
    )
    verify_input = KDTreeVerifyInput(
        draft_token=verify.input_ids, positions=verify.positions, draft_token_num=width, topk=2,
        custom_mask=verify.full_mask, capture_hidden_mode=CaptureHiddenMode.FULL, kv_loc_plan=plan,
    )
    verify_input.ancestor_bits = verify.ancestor_bits
    verify_input.retrieve_index = verify.retrieve_index
    verify_input.retrieve_next_token = verify.retrieve_next_token
    verify_input.retrieve_next_sibling = verify.retrieve_next_sibling
    batch.out_cache_loc = verify_slots.reshape(-1)
    saved_cpu, saved_sum = batch.seq_lens_cpu, batch.seq_lens_sum
    batch.seq_lens_cpu = seq_lens_cpu_verify
    batch.seq_lens_sum = int(seq_lens_cpu_verify.sum())
    forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker)
    batch.seq_lens_cpu, batch.seq_lens_sum = saved_cpu, saved_sum
    return forward_batch, plan
