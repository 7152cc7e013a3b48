"""Device-side error bits of the accept and commit kernels.

The kernels never sync the host: a value error they can only see in the data (a slot out of range, a
NaN logit, a path longer than ``max_depth``) sets a bit and the kernel skips or clamps the offending item
(it never writes out of range). The commit kernels OR bits into an ``int32 [1]`` flag; the accept kernels
store each request's bits to an ``int64 [bs]`` tensor (no zero-filled flag to launch first).
``raise_on_device_error`` syncs, ORs the bits and raises ``ValueError`` naming each problem; call it
where a sync is acceptable (tests, debugging, a periodic health check), never on the hot path.
"""

from __future__ import annotations

__all__ = ["DEVICE_ERRORS", "new_error_flag", "error_bits", "describe_device_error", "raise_on_device_error"]


#: bit -> meaning; the bits are defined in kernels/tree_accept.cu, kv_compact.cu, gather_hidden.cu and moe_align.cu.
#: (The tree-construction kernels keep their own table, ``gpu.topk.TOPK_ERRORS``, in a separate flag.)
DEVICE_ERRORS = {
    1: "num_nodes outside [0, N-1] (clamped)",
    2: "a live node's parent is outside [0, i) (node unlinked: it can never be accepted)",
    4: "the accepted path is longer than max_depth (truncated; pass a larger max_depth)",
    8: "NaN in a visited target logits row (NaN entries are never chosen)",
    16: "bad sampling input: top_k < 1 (treated as 1) or a target row entirely -inf at T > 0",
    64: "accept_lens/accepted is not a path from 0, strictly increasing, inside the verify window "
    "(that request's plan rows are -1)",
    128: "a KV source or destination slot is outside [0, num_slots) (that request was not moved)",
    256: "a hidden-state row index is outside [0, rows) (that output row is zeros)",
    512: "a routed expert id is outside [0, num_experts) (that route is dropped; kernels/moe_align.cu)",
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
