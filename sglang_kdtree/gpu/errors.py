"""Device-side error bits of every kernel: one table (``DEVICE_ERRORS``), one bit per fault.

The kernels never sync the host: a value error they can only see in the data (a slot out of range, a
NaN logit, a path longer than ``max_depth``) sets a bit and the kernel skips or clamps the offending item
(it never writes out of range). The tree-construction kernels (top-K, best-first tree, verify inputs) and the
commit kernels OR bits into an ``int32 [1]`` flag each; the accept kernels store each request's bits to an
``int64 [bs]`` tensor (no zero-filled flag to launch first). The bits are unique across all of them, so any
flag decodes with the one table. ``raise_on_device_error`` syncs, ORs the bits and raises ``ValueError``
naming each problem; call it where a sync is acceptable (tests, debugging, a periodic health check), never
on the hot path.

The ``ERR_*`` constants mirror ``sglang_kdtree/kernels/common.cuh`` bit for bit (``tests/test_kernels_compile.py``
checks that the two agree).
"""

from __future__ import annotations

__all__ = ["DEVICE_ERRORS", "TREE_ERRORS", "new_error_flag", "error_bits", "describe_device_error",
           "raise_on_device_error", "ERR_NUM_NODES", "ERR_BAD_PARENT", "ERR_MAX_DEPTH", "ERR_TARGET_NAN",
           "ERR_SAMPLING", "ERR_BAD_PATH", "ERR_BAD_SLOT", "ERR_BAD_HIDDEN_ROW", "ERR_EXPERT_ID", "ERR_LOGITS_NAN",
           "ERR_LOGITS_POSINF", "ERR_DEAD_ROW", "ERR_LOGPROB_NAN", "ERR_LOGPROB_POSINF", "ERR_UNSORTED",
           "ERR_NEGATIVE_ID", "ERR_BAD_TREE"]

# accept (sglang_kdtree/kernels/tree_accept.cu; per request)
ERR_NUM_NODES = 1 << 0
ERR_BAD_PARENT = 1 << 1
ERR_MAX_DEPTH = 1 << 2
ERR_TARGET_NAN = 1 << 3
ERR_SAMPLING = 1 << 4
# commit (sglang_kdtree/kernels/kv_compact.cu, gather_hidden.cu)
ERR_BAD_PATH = 1 << 6
ERR_BAD_SLOT = 1 << 7
ERR_BAD_HIDDEN_ROW = 1 << 8
# MoE routing (sglang_kdtree/kernels/moe/moe_align.cu; sglang_kdtree.moe.routing.ERR_EXPERT_ID)
ERR_EXPERT_ID = 1 << 9
# tree construction (sglang_kdtree/kernels/topk_*.cu, best_first_tree.cu, verify_inputs.cu)
ERR_LOGITS_NAN = 1 << 10
ERR_LOGITS_POSINF = 1 << 11
ERR_DEAD_ROW = 1 << 12
ERR_LOGPROB_NAN = 1 << 13
ERR_LOGPROB_POSINF = 1 << 14
ERR_UNSORTED = 1 << 15
ERR_NEGATIVE_ID = 1 << 16
ERR_BAD_TREE = 1 << 17

#: bits of the tree-construction flag (``gpu.topk.TOPK_ERRORS``) -> meaning
TREE_ERRORS = {
    ERR_LOGITS_NAN: "logits contains NaN; the drafter produced invalid logits",
    ERR_LOGITS_POSINF: "logits contains +inf; the drafter produced invalid logits",
    ERR_DEAD_ROW: "a logits row is entirely -inf: no token is possible at that depth",
    ERR_LOGPROB_NAN: "logprobs contains NaN",
    ERR_LOGPROB_POSINF: "logprobs contains +inf; log-probabilities must be finite or -inf",
    ERR_UNSORTED: "a logprobs row is not sorted in descending order (rank 0 must be the most likely)",
    ERR_NEGATIVE_ID: "token_ids contains a negative id",
    ERR_BAD_TREE: "malformed tree: num_nodes outside [0, N-1], a parent outside [0, i) or a chain deeper than 31",
}

#: every device error bit -> meaning (the accept, commit and MoE bits, then the tree-construction ones)
DEVICE_ERRORS = {
    ERR_NUM_NODES: "num_nodes outside [0, N-1] (clamped)",
    ERR_BAD_PARENT: "a live node's parent is outside [0, i) (node unlinked: it can never be accepted)",
    ERR_MAX_DEPTH: "the accepted path is longer than max_depth (truncated; pass a larger max_depth)",
    ERR_TARGET_NAN: "NaN in a visited target logits row (NaN entries are never chosen)",
    ERR_SAMPLING: "bad sampling input: top_k < 1 (treated as 1) or a target row entirely -inf at T > 0",
    ERR_BAD_PATH: "accept_lens/accepted is not a path from 0, strictly increasing, inside the verify window "
    "(that request's plan rows are -1)",
    ERR_BAD_SLOT: "a KV source or destination slot is outside [0, num_slots) (that request was not moved)",
    ERR_BAD_HIDDEN_ROW: "a hidden-state row index is outside [0, rows) (that output row is zeros)",
    ERR_EXPERT_ID: "a routed expert id is outside [0, num_experts) (that route is dropped; "
                   "sglang_kdtree/kernels/moe/moe_align.cu)",
    **TREE_ERRORS,
}


def new_error_flag(device):
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device)


def error_bits(errors) -> int:
    """OR of every entry of an error tensor (syncs)."""
    out = 0
    for v in errors.reshape(-1).tolist():
        out |= int(v)
    return out


def describe_device_error(bits: int) -> list[str]:
    return [msg for bit, msg in DEVICE_ERRORS.items() if bits & bit] + (
        [f"unknown error bits {bits & ~sum(DEVICE_ERRORS):#x}"] if bits & ~sum(DEVICE_ERRORS) else []
    )


def raise_on_device_error(errors, what: str = "kernel") -> None:
    """Sync and raise ``ValueError`` if any bit is set in the ``errors`` flag tensor."""
    bits = error_bits(errors)
    if bits:
        raise ValueError(f"{what} reported invalid input (error bits {bits:#x}): " + "; ".join(describe_device_error(bits)))
