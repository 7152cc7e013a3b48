"""The target's tree-verify input: ``KDTreeVerifyInput`` and the forward batch a round verifies with.

``KDTreeVerifyInput`` is DFLASH's verify input carrying the tree: SGLang's FULL_MASK as ``custom_mask`` (the
prefix, then ancestor-or-self) and ``topk=2`` (fa3 / triton plan a tree mask when ``topk > 1``), plus the
DDTree extras that tree-aware kernels read (``sglang_kdtree/patches/mla_tree_verify.py`` reads ``ancestor_bits``). The
CUDA-graph patch (``sglang_kdtree/patches/verify_graph_spec_info.py``) captures the target's verify graph with one.
"""

from __future__ import annotations

import torch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


#: test mode (the e2e servers set it): each round checks SGLang's host lengths against the device's, a host sync
CHECK_HOST_LENS_ENV = "KDTREE_CHECK_HOST_LENS"


class _RoundReadsHostLens:
    """Stands for the round among the worker's ``spec_v2_attn_backends``: SGLang's overlap scheduler publishes
    ``seq_lens_cpu`` only when one of those declares ``needs_cpu_seq_lens`` (``decide_needs_cpu_seq_lens``), and
    Triton and FA3 declare False, but the round itself reads them (``host_prefix_lens``)."""

    needs_cpu_seq_lens = True


ROUND_READS_HOST_LENS = _RoundReadsHostLens()


def host_prefix_lens(batch, check: bool = False) -> tuple[torch.Tensor, int]:
    """``(P on the host [bs] int64, sum(P))`` from SGLang's ``batch.seq_lens_cpu``, with no device read.

    SGLang keeps it exact when the worker is called: without overlap ``DFlashDraftInputV2.prepare_for_decode``
    writes each request's ``kv_committed_len``, which processing the previous round's result advanced by its
    ``accept_lens`` (the device ``seq_lens`` is that round's ``new_seq_lens = P + accept_lens``); with overlap
    ``FutureMap.resolve_seq_lens_cpu`` overwrites it with the published lengths (which it copies because the
    worker lists ``ROUND_READS_HOST_LENS``; without it, it is None and this raises). ``check`` compares it
    with the device lengths."""
    lens_cpu = batch.seq_lens_cpu
    if lens_cpu is None:
        raise RuntimeError("KDTREE needs the batch's host lengths (seq_lens_cpu) at the round's start; SGLang "
                           "left them unset (an attention backend that declares needs_cpu_seq_lens=False)")
    lens_cpu = lens_cpu.to(torch.int64)
    if check:
        device_lens = batch.seq_lens.to("cpu", torch.int64)
        if not torch.equal(device_lens, lens_cpu) or batch.seq_lens_sum not in (None, int(lens_cpu.sum())):
            raise AssertionError(f"KDTREE: SGLang's host lengths {lens_cpu.tolist()} (sum {batch.seq_lens_sum}) "
                                 f"differ from the device's {device_lens.tolist()}")
    return lens_cpu, int(lens_cpu.sum())


class KDTreeVerifyInput(DFlashVerifyInput):
    """DFLASH's verify input carrying the tree: ``custom_mask`` (FULL_MASK) plus the DDTree extras that
    tree-aware kernels read (``sglang_kdtree/patches/mla_tree_verify.py`` reads ``ancestor_bits``)."""

    ancestor_bits: torch.Tensor | None = None
    retrieve_index: torch.Tensor | None = None
    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None


def tree_verify_batch(target_worker, batch, verify, verify_slots, prefix_lens, prefix_cpu, prefix_sum: int,
                      width: int):
    """The TARGET_VERIFY forward batch of a round: the N rows of ``verify`` (``contract.VerifyInputs``) per
    request, written into KV slots ``verify_slots`` ``[bs, N]`` (``req_to_token[req, P:P+N]``) after the
    committed prefixes ``prefix_lens`` (``prefix_cpu`` their host copy, ``prefix_sum`` its sum). Returns
    ``(forward_batch, kv_plan)``; the round's drafter write reads ``kv_plan`` too. ``batch.out_cache_loc`` is left
    at the verify slots; its host lengths are put back."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    verify_lens_cpu = prefix_cpu + width
    plan = target_worker.model_runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=verify_lens_cpu,
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
    batch.seq_lens_cpu = verify_lens_cpu
    batch.seq_lens_sum = prefix_sum + len(prefix_cpu) * width
    forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker)
    batch.seq_lens_cpu, batch.seq_lens_sum = saved_cpu, saved_sum
    return forward_batch, plan
