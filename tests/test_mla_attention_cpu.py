"""CPU tests of sglang_kdtree.gpu.mla_attention's host side: the ancestor-bit layout and the split heuristic."""

import numpy as np
import pytest

from sglang_kdtree import reference as R
from sglang_kdtree.gpu.mla_attention import ancestor_bits_from_parents, choose_num_splits


@pytest.mark.parametrize("width, num_nodes", [(1, [0]), (33, [32, 3, 0]), (70, [69, 40])])
def test_ancestor_bits_match_reference_verify_inputs(width, num_nodes):
    rng = np.random.default_rng(width)
    bs = len(num_nodes)
    parents = np.full((bs, width), -1, dtype=np.int64)
    for b, n in enumerate(num_nodes):
        for i in range(1, n + 1):
            parents[b, i] = rng.integers(0, i)
    trees = R.TreeBatch(tokens=np.zeros((bs, width), np.int64), depths=np.zeros((bs, width), np.int64),
                        parents=parents, num_nodes=np.array(num_nodes, dtype=np.int64))
    expect = R.verify_inputs(trees, np.arange(bs, dtype=np.int64)).ancestor_bits
    got = ancestor_bits_from_parents(parents)
    assert got.dtype == np.uint32 and np.array_equal(got, expect)


def test_split_heuristic_fills_the_gpu_only_when_needed():
    assert choose_num_splits(1, 136, 4096 + 17, 132) > 8      # one request, 3 row tiles: split the keys
    assert choose_num_splits(1, 136, 200, 132) == 1           # too few keys to be worth a merge
    big = choose_num_splits(32, 65 * 16, 16384 + 65, 132)
    assert 1 <= big <= 8
