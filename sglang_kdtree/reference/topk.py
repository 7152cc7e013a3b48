"""Step 1 of a round, twin of ``gpu/topk.py``: per draft depth the top-K tokens and their log-probabilities, and
the tensor-parallel split of it (one vocabulary shard's partials, then their merge)."""

from __future__ import annotations

import numpy as np

from sglang_kdtree.reference._validate import _check_budget, _require_float, _require_no_nan


def _topk_rows(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of a 2-D float array, descending, equal values by ascending column index.

    Exact: the k-th largest value ``thr`` is found by partition; every value ``> thr`` is taken, and the
    remaining places go to the lowest-index columns equal to ``thr``. Returns (values, columns int64).
    """
    rows, v = x.shape
    vals = np.empty((rows, k), dtype=x.dtype)
    cols = np.empty((rows, k), dtype=np.int64)
    for r in range(rows):
        row = x[r]
        if k == v:
            order = np.argsort(-row, kind="stable")
        else:
            thr = np.partition(row, v - k)[v - k]
            above = np.flatnonzero(row > thr)
            equal = np.flatnonzero(row == thr)[: k - above.size]
            cand = np.concatenate([above, equal])
            # primary key: value descending; secondary: token id ascending (ties among `above` too)
            order = cand[np.lexsort((cand, -row[cand]))]
        cols[r] = order[:k]
        vals[r] = row[cols[r]]
    return vals, cols


def _check_k(k) -> int:
    k = _check_budget(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return k


def _check_logit_rows(name: str, x) -> np.ndarray:
    """``x`` as an array of float logit rows ``[..., V]``: ``V >= 1``, no NaN, no ``+inf``."""
    x = np.asarray(x)
    _require_float(name, x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty vocabulary axis, got shape {x.shape}")
    _require_no_nan(name, x)
    if np.isposinf(x).any():
        raise ValueError(f"{name} contains +inf; the drafter produced invalid logits")
    return x


def _check_logits(logits) -> np.ndarray:
    """``_check_logit_rows``, and no row entirely ``-inf`` (the unsharded vocabulary must offer a token)."""
    logits = _check_logit_rows("logits", logits)
    flat = logits.reshape(-1, logits.shape[-1])
    dead = np.isneginf(flat).all(axis=1)
    if dead.any():
        raise ValueError(
            f"logits row {int(np.flatnonzero(dead)[0])} is entirely -inf: no token is possible at that depth"
        )
    return logits


def _lse64(x: np.ndarray) -> np.ndarray:
    """float64 logsumexp over the last axis of a 2-D array (rows with a finite max)."""
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(x64 - m).sum(axis=1, keepdims=True)))[:, 0]


def topk_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row top-``K`` log-probabilities and token ids, ``K = min(k, V)``.

    Args:
        logits: ``[..., V]`` float array (bf16 inputs are upcast to float32 first), typically ``[L, V]`` for
            one request or ``[bs, L, V]`` for a batch. ``-inf`` entries are impossible tokens.
        k: requested K (the node budget); ``k >= 1``.

    Returns:
        ``(logprobs [..., K] float32, ids [..., K] int64)``, descending by logit; equal logits put the lower
        token id first. ``logprob = float32(float64(logit) - lse)`` with ``lse`` the float64 logsumexp of
        the fp32 row.

    Raises:
        ValueError: NaN or +inf logits, a row that is entirely -inf, an empty vocabulary, ``k < 1``.
    """
    k = _check_k(k)
    logits = _check_logits(logits)
    lead, v = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, v).astype(np.float32)
    kk = min(k, v)
    vals, ids = _topk_rows(flat, kk)
    lse = _lse64(flat) if flat.shape[0] else np.zeros(0)
    logprobs = (vals.astype(np.float64) - lse[:, None]).astype(np.float32)
    return logprobs.reshape(*lead, kk), ids.reshape(*lead, kk)


def shard_topk_partials(logits_shard, k: int, id_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tensor-parallel first half: one vocabulary shard's top-``K`` raw logits and its logsumexp.

    Args:
        logits_shard: ``[..., V_shard]`` float logits of this rank's vocabulary slice.
        k: requested K; this shard returns ``min(k, V_shard)`` candidates.
        id_offset: global token id of the shard's column 0.

    Returns:
        ``(top_logits [..., Ks] float32, global ids [..., Ks] int64, lse [...] float64)``. ``lse`` is
        ``-inf`` for a row that is entirely ``-inf`` in this shard (legal: another shard may hold it).
    """
    k = _check_k(k)
    x = _check_logit_rows("logits_shard", logits_shard)
    lead, v = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, v).astype(np.float32)
    kk = min(k, v)
    vals, cols = _topk_rows(flat, kk)
    lse = np.full(flat.shape[0], -np.inf)
    live = ~np.isneginf(flat).all(axis=1)
    if live.any():
        lse[live] = _lse64(flat[live])
    return vals.reshape(*lead, kk), (cols + int(id_offset)).reshape(*lead, kk), lse.reshape(lead)


def merge_topk_partials(top_logits, ids, lse, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensor-parallel second half: merge the shards' partials into the unsharded ``topk_logprobs``.

    Args:
        top_logits: ``[S, ..., Ks]`` float32, shard s's candidates (``shard_topk_partials``), any order.
        ids: ``[S, ..., Ks]`` int64 global token ids.
        lse: ``[S, ...]`` float64 shard logsumexps.
        k: requested K; the result has ``min(k, S*Ks)`` columns (= ``min(k, V)`` when every shard gave
           ``min(k, V_shard)``).

    Returns:
        ``(logprobs [..., K] float32, ids [..., K] int64)``: the same ids as ``topk_logprobs`` on the full
        vocabulary, and log-probs within float32 rounding of it (the global logsumexp is combined from the
        shards' in float64). Only ``S*Ks`` candidates per row travel between ranks, never the vocabulary.
    """
    top_logits = np.asarray(top_logits, dtype=np.float32)
    ids = np.asarray(ids)
    lse = np.asarray(lse, dtype=np.float64)
    if top_logits.shape != ids.shape or top_logits.shape[:-1] != lse.shape:
        raise ValueError(
            f"shape mismatch: top_logits {top_logits.shape}, ids {ids.shape}, lse {lse.shape}; expected "
            "[S, ..., Ks], [S, ..., Ks], [S, ...]"
        )
    s = top_logits.shape[0]
    lead = top_logits.shape[1:-1]
    vals = np.moveaxis(top_logits, 0, -2).reshape(-1, s * top_logits.shape[-1])
    cand = np.moveaxis(ids, 0, -2).reshape(-1, s * ids.shape[-1])
    lses = np.moveaxis(lse, 0, -1).reshape(-1, s)
    if np.isneginf(lses).all(axis=1).any():
        raise ValueError("a row is entirely -inf in every shard: no token is possible at that depth")
    kk = min(_check_budget(k), vals.shape[1])
    out_lp = np.empty((vals.shape[0], kk), dtype=np.float32)
    out_id = np.empty((vals.shape[0], kk), dtype=np.int64)
    glse = _lse64(lses)
    for r in range(vals.shape[0]):
        order = np.lexsort((cand[r], -vals[r]))[:kk]
        out_id[r] = cand[r, order]
        out_lp[r] = (vals[r, order].astype(np.float64) - glse[r]).astype(np.float32)
    return out_lp.reshape(*lead, kk), out_id.reshape(*lead, kk)
