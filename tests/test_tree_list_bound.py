"""The sorted-list tree kernels (``sglang_kdtree/kernels/best_first_tree.cu``, ``build_trees_list1/2/4``) keep only the
first ``C = 32 * J`` candidates (one per lane and register) and drop what shifts past the end; their header argues that
this is exact for ``budget <= 2 * C`` (the launcher's 64 / 128 / 256). This checks that argument on the CPU with
a small model of the same list (positions compared by (score, rank tuple), the popped head's two children
inserted where the old list's better entries end, the list cut to C) against ``reference.build_tree``, at small C
so that the bound is reached; and that the cut does change trees beyond the bound, so the bound is what makes it
exact. The kernels themselves are tested against the reference on the GPU (``tests/gpu/test_tree_gpu.py``), and
the launcher's choice of kernel here."""

import numpy as np
import pytest

from sglang_kdtree import reference as ref


def _tuple(nodes, parent, rank):
    path = [rank]
    while parent != 0:
        parent, r = nodes[parent]
        path.append(r)
    return tuple(reversed(path))


def list_model_parents(lp, budget, capacity):
    """Parents, depths and scores of the tree built with a sorted candidate list cut to ``capacity``."""
    depth_count, k = lp.shape
    s = lp.astype(np.float64)
    ks = min(k, budget + 1)
    nodes = {0: (-1, 0)}
    out = []

    def better(x, y):  # (score, parent, rank, depth)
        if x[0] != y[0]:
            return x[0] > y[0]
        return _tuple(nodes, x[1], x[2]) < _tuple(nodes, y[1], y[2])

    cands = [(s[0, 0], 0, 0, 1)] if budget > 0 and depth_count > 0 and np.isfinite(s[0, 0]) else []
    while cands and len(out) < budget:
        score, parent, rank, depth = cands[0]
        n = len(out) + 1
        nodes[n] = (parent, rank)
        out.append((parent, depth, score))
        new = []
        if rank + 1 < ks and np.isfinite(s[depth - 1, rank + 1]):
            new.append(((score - s[depth - 1, rank]) + s[depth - 1, rank + 1], parent, rank + 1, depth))
        if depth < depth_count and np.isfinite(s[depth, 0]):
            new.append((score + s[depth, 0], n, 0, depth + 1))
        rest = cands[1:]
        for x in new:
            rest.insert(sum(better(o, x) for o in rest), x)
        cands = rest[:capacity]
    return out


def _rows(rng, depth, k, tie_heavy):
    lp = -(rng.integers(0, 4, size=(depth, k)) / 8.0) if tie_heavy else -np.abs(rng.normal(0, 2, size=(depth, k)))
    return -np.sort(-lp, axis=-1).astype(np.float32)


def _same(lp, budget, capacity):
    want = ref.build_tree(lp, np.zeros(lp.shape, dtype=np.int64), budget)
    got = list_model_parents(lp, budget, capacity)
    return (len(got) == want.num_nodes and [g[0] for g in got] == list(want.parents[1:])
            and [g[1] for g in got] == list(want.depths)
            and np.array([g[2] for g in got], dtype=np.float64).tobytes() == want.scores.tobytes())


@pytest.mark.parametrize("capacity", [2, 4, 8])
def test_cut_list_is_exact_up_to_twice_its_capacity(capacity):
    rng = np.random.default_rng(capacity)
    for it in range(300):
        lp = _rows(rng, int(rng.integers(1, 9)), int(rng.integers(1, 12)), tie_heavy=it % 2 == 0)
        for budget in (2 * capacity, int(rng.integers(1, 2 * capacity + 1))):
            assert _same(lp, budget, capacity), (capacity, budget, lp)


def test_cut_list_differs_beyond_the_bound():
    rng = np.random.default_rng(7)
    differs = sum(not _same(_rows(rng, int(rng.integers(2, 8)), int(rng.integers(2, 10)), tie_heavy=False),
                            int(rng.integers(9, 16)), 4) for _ in range(100))
    assert differs > 10


def test_launcher_picks_the_list_kernel_within_its_bound(monkeypatch):
    pytest.importorskip("torch")
    from sglang_kdtree.gpu import tree

    picks = {b: tree._tree_kernel_name(b) for b in (0, 1, 64, 65, 128, 129, 256, 257, 1024)}
    assert picks == {0: "build_trees_list1", 1: "build_trees_list1", 64: "build_trees_list1",
                     65: "build_trees_list2", 128: "build_trees_list2", 129: "build_trees_list4",
                     256: "build_trees_list4", 257: "build_trees_kernel", 1024: "build_trees_kernel"}
    monkeypatch.setattr(tree, "LIST_MAX_BUDGET", 0)
    assert {tree._tree_kernel_name(b) for b in (0, 1, 64, 256, 1024)} == {"build_trees_kernel"}
