"""DDTree semantics, in one place: the CPU (numpy) reference every GPU kernel is checked against.

One decoding round of DDTree (see ``shared/notes/ddtree.md``, the contract):

1. ``topk_logprobs``: per draft depth, the top ``K = min(budget, V)`` tokens of the drafter's logits and
   their log-probabilities ``logit - logsumexp(row)``; equal logits: lower token id first.
2. ``build_tree`` / ``build_trees``: the exact best-first tree of ``min(budget, reachable)`` nodes,
   float64 scores with incremental sibling arithmetic, ties to the lexicographically smaller rank tuple,
   nodes numbered in pop order, node 0 = the root (the bonus token of the previous round).
3. ``verify_inputs``: what the target's tree-verify forward consumes: input ids ``[root, nodes]``,
   positions ``P + depth``, SGLang's FULL_MASK for a batch, bit-packed ancestor rows, and the
   first-child / next-sibling / retrieve-index links of SGLang's ``verify_tree_greedy``.
4. ``accept_greedy`` / ``accept_sampled``: the walk down the tree along the target's own choices.
5. ``commit_plan`` / ``compact_kv``: the KV moves that put the accepted path at slots for positions
   ``P .. P+tau-1`` and the hidden rows the drafter reads next round.

Conventions shared with the GPU path (``sglang_kdtree.ops``), which has the same signatures:

* A batch of trees is padded to a fixed verify width ``N = budget + 1`` rows per request. Rows past a
  request's ``num_nodes`` are *padding*: token 0, depth 0, parent -1, not linked into the tree, their mask
  row sees only themselves (and the prefix), so they are inert in attention and can never be accepted.
* ``-inf`` log-probs mean "impossible token" (e.g. a vocabulary entry masked to ``-inf``): such a
  candidate never becomes a node. A depth whose every log-prob is ``-inf`` ends the tree there.
  NaN and ``+inf`` are errors (``ValueError``), as are unsorted rows.
* All errors are ``ValueError`` (bad values / shapes) or ``TypeError`` (bad dtypes) naming the argument,
  the offending value and what is expected.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MAX_BUDGET",
    "Tree",
    "TreeBatch",
    "VerifyInputs",
    "AcceptResult",
    "CommitPlan",
    "topk_logprobs",
    "shard_topk_partials",
    "merge_topk_partials",
    "build_tree",
    "build_trees",
    "ancestor_matrix",
    "verify_inputs",
    "ancestor_bits_to_bool",
    "accept_greedy",
    "filter_top_k_top_p",
    "sampling_weights",
    "sample_node_tokens",
    "accept_sampled",
    "commit_plan",
    "compact_kv",
    "gather_hidden",
]

#: Largest node budget the plugin supports (verify width N = budget + 1 <= 1025).
MAX_BUDGET = 1024


# ----------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------


def _require_float(name: str, a: np.ndarray) -> None:
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")


def _require_int(name: str, a: np.ndarray) -> None:
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")


def _require_no_nan(name: str, a: np.ndarray) -> None:
    if np.isnan(a).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(a))[0])
        raise ValueError(f"{name} contains NaN (first at index {idx}); the drafter produced invalid logits")


def _check_budget(budget) -> int:
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int, got {type(budget).__name__} {budget!r}")
    return int(budget)


# ----------------------------------------------------------------------------------------------------
# 1. top-K + logsumexp
# ----------------------------------------------------------------------------------------------------


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


def _check_logits(logits) -> np.ndarray:
    logits = np.asarray(logits)
    _require_float("logits", logits)
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary axis, got shape {logits.shape}")
    _require_no_nan("logits", logits)
    if np.isposinf(logits).any():
        raise ValueError("logits contains +inf; the drafter produced invalid logits")
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
    k = _check_budget(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
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
    k = _check_budget(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    x = np.asarray(logits_shard)
    _require_float("logits_shard", x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"logits_shard must have a non-empty vocabulary axis, got shape {x.shape}")
    _require_no_nan("logits_shard", x)
    if np.isposinf(x).any():
        raise ValueError("logits_shard contains +inf; the drafter produced invalid logits")
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
    m = lses.max(axis=1, keepdims=True)
    glse = (m + np.log(np.exp(lses - m).sum(axis=1, keepdims=True)))[:, 0]
    for r in range(vals.shape[0]):
        order = np.lexsort((cand[r], -vals[r]))[:kk]
        out_id[r] = cand[r, order]
        out_lp[r] = (vals[r, order].astype(np.float64) - glse[r]).astype(np.float32)
    return out_lp.reshape(*lead, kk), out_id.reshape(*lead, kk)


# ----------------------------------------------------------------------------------------------------
# 2. the best-first tree
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """One request's draft tree. ``n = len(tokens)`` nodes besides the root, in pop order.

    Attributes:
        tokens: ``[n]`` int64, token of node i+1.
        depths: ``[n]`` int64, depth of node i+1 (1..L).
        parents: ``[n+1]`` int64, ``parents[0] == -1`` (root), ``parents[i] < i``.
        ranks: ``[n]`` int64, rank of node i+1 within its depth's top-K.
        scores: ``[n]`` float64, the node's path score (sum of log-probs, incrementally computed).
    """

    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    ranks: np.ndarray
    scores: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def _check_tree_inputs(logprobs, token_ids) -> tuple[np.ndarray, np.ndarray]:
    logprobs = np.asarray(logprobs)
    token_ids = np.asarray(token_ids)
    _require_float("logprobs", logprobs)
    _require_int("token_ids", token_ids)
    if logprobs.ndim != 2 or logprobs.shape != token_ids.shape:
        raise ValueError(
            f"logprobs and token_ids must both be [L, K] with the same shape, got {logprobs.shape} and "
            f"{token_ids.shape}"
        )
    if logprobs.shape[0] > 0 and logprobs.shape[1] == 0:
        raise ValueError(f"logprobs has L={logprobs.shape[0]} depths but K=0 candidates")
    _require_no_nan("logprobs", logprobs)
    if np.isposinf(logprobs).any():
        raise ValueError("logprobs contains +inf; log-probabilities must be finite or -inf")
    with np.errstate(invalid="ignore"):  # (-inf) - (-inf) is NaN, which correctly compares as "not > 0"
        rising = np.diff(logprobs.astype(np.float64), axis=1) > 0
    if rising.any():
        d = int(np.argwhere(rising)[0, 0])
        raise ValueError(f"logprobs row {d} is not sorted in descending order (rank 0 must be the most likely)")
    if (token_ids < 0).any():
        raise ValueError("token_ids contains a negative id")
    return logprobs.astype(np.float32), token_ids.astype(np.int64)


def build_tree(logprobs, token_ids, budget: int) -> Tree:
    """The exact DDTree best-first tree for one request.

    Args:
        logprobs: ``[L, K]`` float32 per-depth log-probs, each row sorted descending (``topk_logprobs``).
        token_ids: ``[L, K]`` int64 token ids of those log-probs.
        budget: node budget B (nodes besides the root). ``B <= 0`` or ``L == 0`` gives the root only.

    Returns:
        ``Tree`` with ``min(B, reachable)`` nodes in pop order. A candidate is (score, rank tuple); the
        highest score pops first, equal scores go to the lexicographically smaller rank tuple (a proper
        prefix is smaller). Popping node (d, r) pushes its next sibling with score
        ``(score - S[d][r]) + S[d][r+1]`` and its first child with ``score + S[d+1][0]`` (float64).
        Candidates with a ``-inf`` log-prob are never pushed.
    """
    budget = _check_budget(budget)
    logprobs, token_ids = _check_tree_inputs(logprobs, token_ids)
    depth_count, k = logprobs.shape
    s = logprobs.astype(np.float64)
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    ranks: list[int] = []
    scores: list[float] = []
    if budget <= 0 or depth_count == 0:
        return _as_tree(tokens, depths, parents, ranks, scores)
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []
    if np.isfinite(s[0, 0]):
        heap.append((-s[0, 0], (0,), 0, 1, 0))
    while heap and len(tokens) < budget:
        neg, path, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tokens) + 1
        tokens.append(int(token_ids[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        ranks.append(rank)
        scores.append(score)
        if rank + 1 < k and np.isfinite(s[depth - 1, rank + 1]):
            sib = (score - s[depth - 1, rank]) + s[depth - 1, rank + 1]
            heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < depth_count and np.isfinite(s[depth, 0]):
            heapq.heappush(heap, (-(score + s[depth, 0]), path + (0,), node, depth + 1, 0))
    return _as_tree(tokens, depths, parents, ranks, scores)


def _as_tree(tokens, depths, parents, ranks, scores) -> Tree:
    return Tree(
        tokens=np.asarray(tokens, dtype=np.int64),
        depths=np.asarray(depths, dtype=np.int64),
        parents=np.asarray(parents, dtype=np.int64),
        ranks=np.asarray(ranks, dtype=np.int64),
        scores=np.asarray(scores, dtype=np.float64),
    )


@dataclass(frozen=True)
class TreeBatch:
    """A batch of trees padded to ``N = budget + 1`` rows per request (row 0 = root).

    Attributes:
        tokens: ``[bs, N]`` int64; column 0 is the root token, padding rows hold 0.
        depths: ``[bs, N]`` int64; 0 for the root and padding.
        parents: ``[bs, N]`` int64; -1 for the root and padding.
        num_nodes: ``[bs]`` int64, nodes per request besides the root (``<= budget``).
    """

    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    num_nodes: np.ndarray

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def build_trees(logprobs, token_ids, budget: int, root_tokens) -> TreeBatch:
    """``build_tree`` for every request of a batch, padded to ``N = max(budget, 0) + 1`` rows.

    Args:
        logprobs: ``[bs, L, K]`` float32, sorted descending per row.
        token_ids: ``[bs, L, K]`` int64.
        budget: node budget B, the same for the batch.
        root_tokens: ``[bs]`` int64, each request's bonus token (node 0).
    """
    budget = _check_budget(budget)
    logprobs = np.asarray(logprobs)
    token_ids = np.asarray(token_ids)
    root_tokens = np.asarray(root_tokens)
    _require_int("root_tokens", root_tokens)
    if logprobs.ndim != 3 or root_tokens.shape != logprobs.shape[:1]:
        raise ValueError(
            f"expected logprobs [bs, L, K] and root_tokens [bs], got {logprobs.shape} and {root_tokens.shape}"
        )
    bs = logprobs.shape[0]
    width = max(budget, 0) + 1
    tokens = np.zeros((bs, width), dtype=np.int64)
    depths = np.zeros((bs, width), dtype=np.int64)
    parents = np.full((bs, width), -1, dtype=np.int64)
    num_nodes = np.zeros(bs, dtype=np.int64)
    tokens[:, 0] = root_tokens
    for b in range(bs):
        t = build_tree(logprobs[b], token_ids[b], budget)
        n = t.num_nodes
        tokens[b, 1 : n + 1] = t.tokens
        depths[b, 1 : n + 1] = t.depths
        parents[b, : n + 1] = t.parents
        num_nodes[b] = n
    return TreeBatch(tokens=tokens, depths=depths, parents=parents, num_nodes=num_nodes)


# ----------------------------------------------------------------------------------------------------
# 3. verify inputs
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyInputs:
    """What the target's tree-verify forward reads, for a batch of ``bs`` requests of width N.

    Attributes:
        input_ids: ``[bs*N]`` int64, ``[root, node_1..node_{N-1}]`` per request.
        positions: ``[bs*N]`` int64, ``seq_len + depth`` (padding rows: ``seq_len``).
        full_mask: ``[sum(seq_lens)*N + N*N*bs]`` bool, SGLang's FULL_MASK: per request an
            ``N x (seq_len + N)`` row-major allow-mask (prefix all True, then ancestor-or-self).
        ancestor_bits: ``[bs, N, ceil(N/32)]`` uint32; bit ``j % 32`` of word ``j // 32`` in row i is set
            iff node j is an ancestor of node i or i itself.
        retrieve_index: ``[bs, N]`` int64, the global row ``b*N + i`` of node i.
        retrieve_next_token: ``[bs, N]`` int64, first child of node i (lowest node index), -1 if none.
        retrieve_next_sibling: ``[bs, N]`` int64, next sibling of node i (next higher node index with the
            same parent), -1 if none.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    full_mask: np.ndarray
    ancestor_bits: np.ndarray
    retrieve_index: np.ndarray
    retrieve_next_token: np.ndarray
    retrieve_next_sibling: np.ndarray


def _check_tree_batch(trees: TreeBatch) -> None:
    bs, width = trees.tokens.shape
    for name in ("depths", "parents"):
        if getattr(trees, name).shape != (bs, width):
            raise ValueError(f"trees.{name} has shape {getattr(trees, name).shape}, expected {(bs, width)}")
    if trees.num_nodes.shape != (bs,):
        raise ValueError(f"trees.num_nodes has shape {trees.num_nodes.shape}, expected {(bs,)}")
    if ((trees.num_nodes < 0) | (trees.num_nodes >= width)).any():
        raise ValueError(f"trees.num_nodes must lie in [0, {width - 1}], got {trees.num_nodes.tolist()}")
    node = np.arange(width)[None, :]
    live = (node >= 1) & (node <= trees.num_nodes[:, None])
    bad = live & ((trees.parents < 0) | (trees.parents >= node))
    if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"trees.parents[{b}, {i}] = {int(trees.parents[b, i])} must lie in [0, {i})")


def ancestor_matrix(trees: TreeBatch) -> np.ndarray:
    """The tree-visibility matrix: ``[bs, N, N]`` bool, ``[b, i, j]`` iff node j is an ancestor of node i or i
    itself. Padding rows see only themselves."""
    _check_tree_batch(trees)
    bs, width = trees.tokens.shape
    anc = np.zeros((bs, width, width), dtype=bool)
    idx = np.arange(width)
    anc[:, idx, idx] = True
    for b in range(bs):
        for i in range(1, int(trees.num_nodes[b]) + 1):  # parents[i] < i: the parent's row is complete
            anc[b, i] |= anc[b, int(trees.parents[b, i])]
    return anc


def verify_inputs(trees: TreeBatch, seq_lens) -> VerifyInputs:
    """Verify inputs for a batch of trees.

    Args:
        trees: ``TreeBatch`` of width N.
        seq_lens: ``[bs]`` int64 committed lengths P (the root sits at position P).
    """
    _check_tree_batch(trees)
    seq_lens = np.asarray(seq_lens)
    _require_int("seq_lens", seq_lens)
    bs, width = trees.tokens.shape
    if seq_lens.shape != (bs,):
        raise ValueError(f"seq_lens has shape {seq_lens.shape}, expected {(bs,)}")
    if (seq_lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")
    words = (width + 31) // 32
    anc = ancestor_matrix(trees)
    next_token = np.full((bs, width), -1, dtype=np.int64)
    next_sibling = np.full((bs, width), -1, dtype=np.int64)
    for b in range(bs):
        n = int(trees.num_nodes[b])
        last_child = np.full(width, -1, dtype=np.int64)
        for i in range(1, n + 1):
            p = int(trees.parents[b, i])
            if last_child[p] < 0:
                next_token[b, p] = i
            else:
                next_sibling[b, last_child[p]] = i
            last_child[p] = i
    blocks = [np.concatenate([np.ones((width, int(seq_lens[b])), bool), anc[b]], axis=1).ravel() for b in range(bs)]
    full_mask = np.concatenate(blocks) if blocks else np.zeros(0, dtype=bool)
    bits = np.zeros((bs, width, words), dtype=np.uint32)
    for j in range(width):
        bits[:, :, j // 32] |= anc[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    return VerifyInputs(
        input_ids=trees.tokens.reshape(-1).copy(),
        positions=(seq_lens[:, None].astype(np.int64) + trees.depths).reshape(-1),
        full_mask=full_mask,
        ancestor_bits=bits,
        retrieve_index=(np.arange(bs, dtype=np.int64)[:, None] * width + np.arange(width)[None, :]),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
    )


def ancestor_bits_to_bool(bits, width: int) -> np.ndarray:
    """Unpack ``[..., N, ceil(N/32)]`` uint32 ancestor rows into a ``[..., N, N]`` bool mask."""
    bits = np.asarray(bits, dtype=np.uint32)
    cols = np.arange(width)
    return ((bits[..., cols // 32] >> (cols % 32).astype(np.uint32)) & 1).astype(bool)


# ----------------------------------------------------------------------------------------------------
# 4. accept
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptResult:
    """The outcome of one verify round for a batch.

    Attributes:
        accepted: ``[bs, max_depth+1]`` int64 node indices of the accepted path (root first, strictly
            increasing), -1 padded.
        accept_lens: ``[bs]`` int64 tau = path length including the root (1..max_depth+1); also the number
            of tokens committed this round (tau-1 accepted drafts + the bonus).
        bonus: ``[bs]`` int64, the target's token after the last accepted node.
        committed: ``[bs, max_depth+1]`` int64 tokens emitted this round, ``[tokens of path[1:]], bonus``,
            -1 padded (first ``accept_lens[b]`` valid).
    """

    accepted: np.ndarray
    accept_lens: np.ndarray
    bonus: np.ndarray
    committed: np.ndarray


def _max_depth(trees: TreeBatch) -> int:
    return int(trees.depths.max()) if trees.depths.size else 0


def _walk(trees: TreeBatch, target_tokens: np.ndarray, max_depth: int | None) -> AcceptResult:
    bs, width = trees.tokens.shape
    if max_depth is None:
        max_depth = _max_depth(trees)
    accepted = np.full((bs, max_depth + 1), -1, dtype=np.int64)
    committed = np.full((bs, max_depth + 1), -1, dtype=np.int64)
    accept_lens = np.zeros(bs, dtype=np.int64)
    bonus = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        n = int(trees.num_nodes[b])
        children: dict[int, list[int]] = {}
        for i in range(1, n + 1):
            children.setdefault(int(trees.parents[b, i]), []).append(i)
        cur, path = 0, [0]
        while True:
            want = int(target_tokens[b, cur])
            nxt = next((c for c in children.get(cur, []) if int(trees.tokens[b, c]) == want), None)
            if nxt is None:
                break
            cur = nxt
            path.append(cur)
        if len(path) > max_depth + 1:
            raise ValueError(f"max_depth={max_depth} is smaller than the accepted depth {len(path) - 1}")
        tau = len(path)
        accepted[b, :tau] = path
        committed[b, : tau - 1] = trees.tokens[b, path[1:]]
        committed[b, tau - 1] = target_tokens[b, cur]
        accept_lens[b] = tau
        bonus[b] = target_tokens[b, cur]
    return AcceptResult(accepted=accepted, accept_lens=accept_lens, bonus=bonus, committed=committed)


def accept_greedy(trees: TreeBatch, target_logits, max_depth: int | None = None) -> AcceptResult:
    """Greedy (T = 0) accept walk.

    Args:
        trees: ``TreeBatch`` of width N.
        target_logits: ``[bs, N, V]`` float target logits at every node, or ``[bs, N]`` int64 argmax ids.
            Argmax ties go to the lower token id.
        max_depth: columns of ``accepted`` minus one (default: the deepest node of the batch); pass L to
            get the fixed ``[bs, L+1]`` layout.

    Walk: ``cur = 0``; while ``argmax(target[cur])`` is the token of a child of ``cur``, move there.
    """
    _check_tree_batch(trees)
    t = np.asarray(target_logits)
    bs, width = trees.tokens.shape
    if t.ndim == 3:
        _require_float("target_logits", t)
        if t.shape[:2] != (bs, width):
            raise ValueError(f"target_logits has shape {t.shape}, expected [{bs}, {width}, V]")
        _require_no_nan("target_logits", t)
        target_tokens = t.argmax(axis=-1).astype(np.int64)
    elif t.ndim == 2:
        _require_int("target_logits", t)
        if t.shape != (bs, width):
            raise ValueError(f"target ids have shape {t.shape}, expected {(bs, width)}")
        target_tokens = t.astype(np.int64)
    else:
        raise ValueError(f"target_logits must be [bs, N, V] logits or [bs, N] ids, got shape {t.shape}")
    return _walk(trees, target_tokens, max_depth)


def filter_top_k_top_p(p, top_k: int | None = None, top_p: float | None = None,
                       min_p: float | None = None) -> np.ndarray:
    """SGLang's top-k / top-p / min-p filter of float64 probability rows ``[..., V]`` (one definition of the
    rules, used by ``sample_node_tokens``): order each row by probability (descending, equal probabilities
    lower token id first) and keep rank ``r`` iff

    * top-k: ``r < top_k``;
    * top-p: the mass of the ranks before it is ``<= top_p * (row mass)`` (torch's ``probs_sum - probs_sort >
      top_p`` zeroing, on a row that need not sum to 1);
    * min-p: its probability is ``>= min_p * (the row's largest probability)`` (SGLang's ``probs <
      probs_sort[:, 0] * min_ps`` zeroing; the top token passes top-k and top-p, so after them the largest
      probability is still the row max);

    zero the rest and renormalise. The kept set is the intersection of three prefixes of the sorted order,
    so the order in which SGLang applies the filters does not matter. ``None`` (or ``top_k >= V``,
    ``top_p >= 1``, ``min_p <= 0`` or NaN) leaves that filter off; ``min_p > 1`` counts as 1 (SGLang refuses
    it at admission; 1 keeps the tokens tied with the max). The top token is always kept."""
    p = np.asarray(p, dtype=np.float64)
    v = p.shape[-1]
    k = v if top_k is None else max(1, min(int(top_k), v))
    mp = None if min_p is None or not float(min_p) > 0.0 else min(float(min_p), 1.0)
    if k >= v and (top_p is None or top_p >= 1.0) and mp is None:
        return p / p.sum(axis=-1, keepdims=True)
    flat = p.reshape(-1, v)
    out = np.zeros_like(flat)
    ids = np.arange(v)
    for row in range(flat.shape[0]):
        order = np.lexsort((ids, -flat[row]))
        ps = flat[row, order]
        keep = ids < k
        if top_p is not None and top_p < 1.0:
            keep &= (np.cumsum(ps) - ps) <= top_p * ps.sum()
        if mp is not None:
            keep &= ps >= mp * ps[0]
        out[row, order[keep]] = ps[keep]
    return (out / out.sum(axis=1, keepdims=True)).reshape(p.shape)


def _filters_on(v: int, top_k, top_p, min_p) -> bool:
    return ((top_k is not None and top_k < v) or (top_p is not None and top_p < 1.0)
            or (min_p is not None and float(min_p) > 0.0))


def sampling_weights(target_logits, temperature: float, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None) -> np.ndarray:
    """The float64 weights ``sample_node_tokens`` draws from, ``[..., V]``: ``exp(x / T - max(x / T))`` (the top
    token's weight is exactly 1), then ``filter_top_k_top_p`` when a filter is on (renormalised then; the
    unfiltered weights are not). Zero weight = never drawn.

    Min-p on these weights is therefore ``exp(x_i / T - x_max / T) >= min_p`` in float64, with ``x`` the
    float64 value of each float32 logit, ``x_i / T`` and ``x_max / T`` each rounded once and ``exp`` numpy's:
    the GPU kernel (``kernels/tree_accept.cu``, ``min_p_threshold``) evaluates this same expression with
    CUDA's double ``exp``, so the two agree on every token except one whose ``exp`` lies within the two
    libraries' ``exp`` error (about 2^-52 relative) of ``min_p``."""
    t = np.asarray(target_logits)
    x = t.astype(np.float64) / float(temperature)
    x -= x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    if _filters_on(t.shape[-1], top_k, top_p, min_p):
        p = filter_top_k_top_p(p, top_k, top_p, min_p)
    return p


def sample_node_tokens(target_logits, temperature: float, rng: np.random.Generator, top_k: int | None = None,
                       top_p: float | None = None, min_p: float | None = None) -> np.ndarray:
    """Sample one token per node independently from ``softmax(logits / T)``, filtered by ``top_k`` / ``top_p``
    / ``min_p`` as SGLang's sampler does (``sampling_weights``, ``filter_top_k_top_p``; off by default).

    Args:
        target_logits: ``[bs, N, V]`` float logits.
        temperature: T > 0.
        rng: an explicit ``numpy.random.Generator``; draws ``bs*N`` uniforms in row-major node order.
        top_k, top_p, min_p: the request's filters (``top_k = 1``: the argmax, lower id on ties).

    Returns:
        ``[bs, N]`` int64 sampled tokens (inverse-CDF on float64 probabilities, in token-id order).
    """
    t = np.asarray(target_logits)
    _require_float("target_logits", t)
    _require_no_nan("target_logits", t)
    if t.ndim != 3:
        raise ValueError(f"target_logits must be [bs, N, V], got shape {t.shape}")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0 for sampling, got {temperature!r}")
    p = sampling_weights(t, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(t.shape[:2]) * cdf[..., -1]
    out = np.empty(t.shape[:2], dtype=np.int64)
    for idx in np.ndindex(*t.shape[:2]):
        out[idx] = min(int(np.searchsorted(cdf[idx], u[idx], side="right")), t.shape[-1] - 1)
    return out


def accept_sampled(
    trees: TreeBatch,
    target_logits,
    temperature: float,
    rng: np.random.Generator,
    max_depth: int | None = None,
) -> AcceptResult:
    """T > 0 accept walk: sample every node's token from the target (``sample_node_tokens``), then walk.

    Lossless without a draft-probability rejection step: the token committed after node ``cur`` is always
    a sample of the target distribution at ``cur``, whichever child it happens to match.
    """
    _check_tree_batch(trees)
    t = np.asarray(target_logits)
    if t.ndim != 3 or t.shape[:2] != trees.tokens.shape:
        raise ValueError(f"target_logits has shape {t.shape}, expected [{trees.tokens.shape}, V]")
    return _walk(trees, sample_node_tokens(t, temperature, rng), max_depth)


# ----------------------------------------------------------------------------------------------------
# 5. commit
# ----------------------------------------------------------------------------------------------------


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
