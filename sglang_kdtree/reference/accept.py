"""Step 4, twin of ``gpu/accept.py``: the walk down the tree along the target's own choices, greedy (argmax)
or sampled (``sampling.sample_node_tokens`` at every node)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_kdtree.reference._validate import _require_float, _require_int, _require_no_nan
from sglang_kdtree.reference.sampling import sample_node_tokens
from sglang_kdtree.reference.tree import TreeBatch, _check_tree_batch


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
