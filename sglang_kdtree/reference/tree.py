"""Step 2, twin of ``gpu/tree.py``: the exact best-first DDTree of one request (``build_tree``) and of a batch
padded to the verify width (``build_trees``)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from sglang_kdtree.reference._validate import _check_budget, _require_float, _require_int, _require_no_nan


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
        scores: ``[bs, N]`` float64 path scores (the sum of the path's log-probs; 0 for the root and padding),
            or None where a caller built the batch without them. ``exp(scores)`` is the drafter's probability
            that the walk reaches the node (``widths.expected_accepts``).
    """

    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    num_nodes: np.ndarray
    scores: np.ndarray | None = None

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
    scores = np.zeros((bs, width), dtype=np.float64)
    tokens[:, 0] = root_tokens
    for b in range(bs):
        t = build_tree(logprobs[b], token_ids[b], budget)
        n = t.num_nodes
        tokens[b, 1 : n + 1] = t.tokens
        depths[b, 1 : n + 1] = t.depths
        parents[b, : n + 1] = t.parents
        scores[b, 1 : n + 1] = t.scores
        num_nodes[b] = n
    return TreeBatch(tokens=tokens, depths=depths, parents=parents, num_nodes=num_nodes, scores=scores)


def cut_trees(trees: TreeBatch, width: int) -> TreeBatch:
    """The first ``width`` rows of every tree (the root and the first ``width - 1`` nodes in pop order): exactly
    the trees ``build_trees`` gives at budget ``width - 1`` from the same log-probs, since best-first pops every
    parent before its children and never depends on the budget until it stops."""
    if not 1 <= width <= trees.width:
        raise ValueError(f"cut width {width} must lie in [1, {trees.width}]")
    cut = lambda a: None if a is None else np.ascontiguousarray(a[:, :width])  # noqa: E731
    return TreeBatch(tokens=cut(trees.tokens), depths=cut(trees.depths), parents=cut(trees.parents),
                     num_nodes=np.minimum(trees.num_nodes, width - 1), scores=cut(trees.scores))


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
