"""The round log's per-depth reach (``round_log._depth_reach``) against an independent walk of the same trees."""

from __future__ import annotations

import numpy as np
import torch

from sglang_kdtree.round import log as round_log
from sglang_kdtree.contract import Trees, cut_trees
from sglang_kdtree.reference import tree as ref_tree
from sglang_kdtree.round.widths import expected_accepts


def _trees(seed: int, bs: int = 3, depths: int = 5, k: int = 4, budget: int = 12) -> tuple[Trees, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(bs, depths, 32)) * 2
    logprobs_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logprobs_all, axis=-1)[:, :, :k]
    logprobs = np.take_along_axis(logprobs_all, ids, axis=-1).astype(np.float32)
    tb = ref_tree.build_trees(logprobs, ids, budget, rng.integers(0, 32, size=bs))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    trees = Trees(t(tb.tokens), t(tb.depths), t(tb.parents), t(tb.num_nodes), t(tb.scores))
    return trees, logprobs_all


def _walked_reach(trees: Trees, logprobs_all: np.ndarray) -> list[float]:
    """Per depth, summed over the batch: the product of the drafter's probabilities along each node's path,
    found by following ``parents`` (not the kernels' ``scores``)."""
    out: dict[int, float] = {}
    for b in range(trees.tokens.shape[0]):
        for i in range(1, int(trees.num_nodes[b]) + 1):
            p, node = 1.0, i
            while node > 0:
                p *= float(np.exp(logprobs_all[b, int(trees.depths[b, node]) - 1, int(trees.tokens[b, node])]))
                node = int(trees.parents[b, node])
            out[int(trees.depths[b, i])] = out.get(int(trees.depths[b, i]), 0.0) + p
    return [out.get(d, 0.0) for d in range(1, max(out) + 1)]


def test_depth_reach_is_the_walked_path_probability_per_depth():
    trees, logprobs_all = _trees(seed=3)
    got = round_log._depth_reach(trees)
    np.testing.assert_allclose(got, _walked_reach(trees, logprobs_all), rtol=1e-4, atol=1e-5)
    # summed over depths it is the drafter's expected accepted draft tokens (the width choice's predicted_raw - 1)
    whole = expected_accepts(trees.scores, trees.num_nodes, (trees.width,)).sum().item() - trees.tokens.shape[0]
    assert abs(sum(got) - whole) < 1e-3


def test_depth_reach_ignores_rows_past_num_nodes_and_cuts():
    trees, logprobs_all = _trees(seed=4)
    padded = Trees(trees.tokens, trees.depths, trees.parents, trees.num_nodes.clamp(max=5), trees.scores.clone())
    padded.scores[:, 6:] = 50.0  # rows past num_nodes are padding: whatever they hold must not count
    padded.depths[:, 6:] = 99
    np.testing.assert_allclose(round_log._depth_reach(padded), _walked_reach(padded, logprobs_all), rtol=1e-4,
                               atol=1e-5)
    cut = cut_trees(trees, 6)  # the verified cut: the first 5 nodes of each tree
    assert round_log._depth_reach(cut) == round_log._depth_reach(padded)
    assert round_log._depth_reach(Trees(trees.tokens, trees.depths, trees.parents, trees.num_nodes)) is None
