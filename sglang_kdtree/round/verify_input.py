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


def host_prefix_lens(batch, kv_reserve: int, check: bool = False) -> tuple[torch.Tensor, int]:
    """``(P on the host [bs] int64, its sum)``: each request's committed length P, or an upper bound of it, with no
    device read and no wait.

    * **Exact** when SGLang has set ``batch.seq_lens_cpu``: without overlap ``DFlashDraftInputV2.prepare_for_decode``
      writes each request's ``kv_committed_len``, which processing the previous round's result advanced by its
      ``accept_lens``; with overlap ``FutureMap.resolve_seq_lens_cpu`` copies the published lengths when an attention
      backend asks for them (``needs_cpu_seq_lens``: torch_native, flashinfer), waiting for the previous round's
      accept to do so.
    * **An upper bound** when it has not (overlap on Triton or FA3, which ask for none, so SGLang issues this round
      without waiting for the last one): the KV length ``prepare_for_decode`` reserved for this round
      (``draft_input.nxt_kv_lens_cpu``) less the round's KV window ``kv_reserve``. That reservation is at least the
      committed length plus ``2 * kv_reserve`` (``patches/decode_reserve.py``), and P exceeds the committed length
      by at most one round's accept (``<= kv_reserve``), so ``P + kv_reserve <= nxt``. DFLASH's own V2 round plans
      with the same reservation when it has no host lengths.

    The round uses the host lengths only to size: the FULL_MASK's buffer (``gpu/verify.full_mask_numel``), the KV
    plans and the attention metadata, which take an upper bound (DFLASH passes them one); every row is placed from
    the device lengths. ``check`` (a sync; the e2e tests) compares with the device lengths: equal, or not above the
    bound."""
    lens_cpu = batch.seq_lens_cpu
    exact = lens_cpu is not None
    if not exact:
        reserved = getattr(batch.spec_info, "nxt_kv_lens_cpu", None)
        if reserved is None or reserved.numel() != batch.seq_lens.shape[0]:
            raise RuntimeError("KDTREE needs the batch's host lengths at the round's start: SGLang set neither "
                               "seq_lens_cpu nor, for this batch, the reserved lengths (nxt_kv_lens_cpu)")
        lens_cpu = reserved.to(torch.int64) - int(kv_reserve)
    lens_cpu = lens_cpu.to(torch.int64)
    if check:
        device_lens = batch.seq_lens.to("cpu", torch.int64)
        if exact:
            bad = not torch.equal(device_lens, lens_cpu) or batch.seq_lens_sum not in (None, int(lens_cpu.sum()))
        else:
            bad = bool((device_lens > lens_cpu).any())
        if bad:
            raise AssertionError(f"KDTREE: the host lengths {lens_cpu.tolist()} ({'exact' if exact else 'a bound'}, "
                                 f"sum {batch.seq_lens_sum}) do not match the device's {device_lens.tolist()}")
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
    committed prefixes ``prefix_lens`` (``prefix_cpu`` their host copy or its upper bound, ``host_prefix_lens``;
    ``prefix_sum`` its sum). Returns
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
