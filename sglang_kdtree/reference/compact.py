"""Step 5, twin of ``gpu/compact.py``: the KV moves that put the accepted path at the slots of positions
``P .. P+tau-1``, and the hidden rows the drafter reads next round."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_kdtree.reference._validate import _require_int


@dataclass(frozen=True)
class CommitPlan:
    """KV moves and hidden-row gathers that commit the accepted paths.

    Attributes:
        src_slots: ``[bs, M]`` int64 KV slot of accepted node ``accepted[b, j]`` (-1 padded).
        dst_slots: ``[bs, M]`` int64 KV slot for position ``P + j`` (-1 padded).
        hidden_rows: ``[bs, M]`` int64 row ``b*N + accepted[b, j]`` of the verify hidden states (-1 padded).
        accept_lens: ``[bs]`` int64 tau.
    """

    src_slots: np.ndarray
    dst_slots: np.ndarray
    hidden_rows: np.ndarray
    accept_lens: np.ndarray

    def moves(self) -> list[list[tuple[int, int]]]:
        """Per request, the (src, dst) pairs that actually move (identity moves dropped)."""
        out = []
        for b in range(self.src_slots.shape[0]):
            tau = int(self.accept_lens[b])
            out.append(
                [(int(s), int(d)) for s, d in zip(self.src_slots[b, :tau], self.dst_slots[b, :tau]) if s != d]
            )
        return out


def commit_plan(accepted, accept_lens, verify_slots) -> CommitPlan:
    """Plan the KV compaction for a batch.

    Args:
        accepted: ``[bs, M]`` int64 accepted node indices (``AcceptResult.accepted``), strictly increasing
            from 0, -1 padded.
        accept_lens: ``[bs]`` int64 tau.
        verify_slots: ``[bs, N]`` int64 KV slots of the verify rows: ``req_to_token[req, P + i]`` holds
            node i during verify and, after commit, position ``P + i``.
    """
    accepted = np.asarray(accepted)
    accept_lens = np.asarray(accept_lens)
    verify_slots = np.asarray(verify_slots)
    for name, a in (("accepted", accepted), ("accept_lens", accept_lens), ("verify_slots", verify_slots)):
        _require_int(name, a)
    bs, m = accepted.shape
    width = verify_slots.shape[1] if verify_slots.ndim == 2 else -1
    if verify_slots.shape[0] != bs or accept_lens.shape != (bs,):
        raise ValueError(
            f"batch mismatch: accepted {accepted.shape}, accept_lens {accept_lens.shape}, "
            f"verify_slots {verify_slots.shape}"
        )
    src = np.full((bs, m), -1, dtype=np.int64)
    dst = np.full((bs, m), -1, dtype=np.int64)
    rows = np.full((bs, m), -1, dtype=np.int64)
    for b in range(bs):
        tau = int(accept_lens[b])
        if not 1 <= tau <= min(m, width):
            raise ValueError(f"accept_lens[{b}] = {tau} is outside [1, {min(m, width)}]")
        path = accepted[b, :tau].astype(np.int64)
        if path[0] != 0 or (np.diff(path) <= 0).any() or path[-1] >= width:
            raise ValueError(
                f"accepted[{b}] = {path.tolist()} must start at 0, increase strictly and stay below {width}"
            )
        src[b, :tau] = verify_slots[b, path]
        dst[b, :tau] = verify_slots[b, :tau]
        rows[b, :tau] = b * width + path
    return CommitPlan(src_slots=src, dst_slots=dst, hidden_rows=rows, accept_lens=accept_lens.astype(np.int64))


def compact_kv(kv, plan: CommitPlan) -> None:
    """Apply a ``CommitPlan`` in place to a KV pool: read every source row first, then write.

    Args:
        kv: ``[..., slots, D]`` array (e.g. ``[layers, slots, 576]`` MLA latent rows, or one layer's k or v
            ``[slots, heads, head_dim]`` flattened to ``[slots, D]``); the slot axis is ``-2``.
        plan: from ``commit_plan``. Slots must be in ``[0, slots)``.
    """
    valid = plan.src_slots != -1
    if (valid != (plan.dst_slots != -1)).any():
        raise ValueError("commit plan pads src_slots and dst_slots differently (padding is -1 in both)")
    src = plan.src_slots[valid]
    dst = plan.dst_slots[valid]
    slots = kv.shape[-2]
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= slots):
        raise ValueError(f"commit plan addresses a slot outside [0, {slots})")
    rows = kv[..., src, :].copy()
    kv[..., dst, :] = rows


def gather_hidden(hidden, plan: CommitPlan) -> np.ndarray:
    """The accepted rows of the verify hidden states, packed per request for the drafter.

    Args:
        hidden: ``[bs*N, D]`` verify hidden states.
        plan: from ``commit_plan``.

    Returns:
        ``[bs, M, D]``: row ``j < tau`` of request b is ``hidden[b*N + accepted[b, j]]``; the rest is zero.
    """
    hidden = np.asarray(hidden)
    bs, m = plan.hidden_rows.shape
    out = np.zeros((bs, m, hidden.shape[-1]), dtype=hidden.dtype)
    valid = plan.hidden_rows >= 0
    out[valid] = hidden[plan.hidden_rows[valid]]
    return out
