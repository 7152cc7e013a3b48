"""GPU sampled accept walk (sglang_kdtree/kernels/tree_accept.cu) where it must be deterministic: top_k = 1, T = 0 and a tiny
top_p walk like the greedy one; the same seed gives the same walk; the draws are Philox4x32-10 at the
documented counter; the same tree numbered two ways commits the same tokens. Outputs poisoned first.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from accept_gpu_cases import assert_same, lazy_torch, logits_for, poisoned_out, random_trees, steered_targets, to_gpu
from sglang_kdtree import reference as ref
from sglang_kdtree.gpu.errors import error_bits

pytestmark = pytest.mark.gpu


def test_sampled_top_k_one_and_zero_temperature_are_greedy():
    torch = lazy_torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(3)
    bs, width, vocab = 64, 65, 300
    trees = random_trees(rng, bs, width, 6)
    tgt = steered_targets(rng, trees, 6)
    logits = logits_for(rng, tgt, vocab)
    expect = ref.accept_greedy(trees, tgt, max_depth=width - 1)
    g = to_gpu(trees)
    seq = torch.from_numpy(rng.integers(0, 1 << 40, size=bs)).cuda()
    seeds = torch.from_numpy(rng.integers(0, 1 << 62, size=bs)).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        lt = torch.from_numpy(logits).cuda().to(dtype)
        temps = torch.full((bs,), 0.9, device="cuda")
        res = accept_sampled(g, lt, temps, seeds, seq, top_ks=torch.ones(bs, dtype=torch.int64, device="cuda"),
                             out=poisoned_out(bs, width, width - 1))
        assert_same(res, expect, seq.cpu().numpy())
        res = accept_sampled(g, lt, torch.zeros((bs, 1), device="cuda"), seeds, seq,
                             out=poisoned_out(bs, width, width - 1))
        assert_same(res, expect, seq.cpu().numpy())
        # top_p tiny keeps only the top token too
        res = accept_sampled(g, lt, temps, seeds, seq, top_ps=torch.full((bs,), 1e-6, device="cuda"),
                             out=poisoned_out(bs, width, width - 1))
        assert_same(res, expect, seq.cpu().numpy())


def test_sampled_is_reproducible_and_seeded():
    torch = lazy_torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(4)
    bs, width, vocab = 256, 17, 4
    trees = random_trees(rng, bs, width, vocab)
    g = to_gpu(trees)
    lt = torch.randn(bs * width, vocab, device="cuda")
    temps = torch.ones(bs, device="cuda")
    seq = torch.arange(bs, device="cuda") * 3
    seeds = torch.arange(bs, device="cuda") + 12345
    a = accept_sampled(g, lt, temps, seeds, seq)
    b = accept_sampled(g, lt, temps, seeds, seq)
    c = accept_sampled(g, lt, temps, seeds + 1, seq)
    for name in ("accepted", "accept_lens", "bonus", "committed", "new_seq_lens"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.committed, c.committed)
    assert error_bits(a.errors) == 0


def _binary_tree(order, depth, root_token=5):
    """A complete binary tree of the given depth (child tokens 0 and 1) numbered in "bfs" or "dfs" (preorder)
    order: (TreeBatch row arrays, the path of each node as a tuple of bits)."""
    paths = [()]
    if order == "bfs":
        for d in range(1, depth + 1):
            paths += list(itertools.product((0, 1), repeat=d))
    else:
        def visit(p):
            if len(p) < depth:
                for bit in (0, 1):
                    paths.append(p + (bit,))
                    visit(p + (bit,))
        visit(())
    index = {p: i for i, p in enumerate(paths)}
    tokens = np.array([root_token] + [p[-1] for p in paths[1:]], dtype=np.int64)
    parents = np.array([-1] + [index[p[:-1]] for p in paths[1:]], dtype=np.int64)
    depths = np.array([len(p) for p in paths], dtype=np.int64)
    return tokens, parents, depths, paths


@pytest.mark.parametrize("vocab", [256, 1000])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sampled_draws_are_philox_at_the_documented_counter(vocab, dtype_name):
    """The draws themselves, against an independent Philox4x32-10 (``tests/philox.py``, checked against
    Random123's vectors): over ``vocab`` equal logits at T 1 every kept weight is 2^44 (the kernel's fixed
    point), so the token drawn at a root-only tree is floor(u / 2^44) with u = floor(r * vocab * 2^44 / 2^64),
    r the 64-bit uniform at key (seed lo, seed hi), counter (0, pos lo, pos hi, "kdtr"), pos = P + 1 (the
    position of the token drawn after the root). Seeds negative and past 2^32, P across the 2^32 boundary."""
    torch = lazy_torch()
    from philox import kdtree_uniform64
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(31)
    n = 384
    seeds = rng.integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64)
    seeds[:4] = [0, 1, -1, (1 << 32) + 5]
    seq = rng.integers(0, 1 << 34, size=n, dtype=np.int64)
    seq[:4] = [0, (1 << 32) - 1, (1 << 32) - 2, 12345]  # pos = 1, 2^32 (low word 0, high 1), 2^32 - 1, ...
    trees = ref.TreeBatch(tokens=np.zeros((n, 1), np.int64), depths=np.zeros((n, 1), np.int64),
                          parents=np.full((n, 1), -1, np.int64), num_nodes=np.zeros(n, np.int64))
    logits = torch.zeros(n, vocab, dtype=getattr(torch, dtype_name), device="cuda")
    res = accept_sampled(to_gpu(trees), logits, torch.ones(n, device="cuda"), torch.from_numpy(seeds).cuda(),
                         torch.from_numpy(seq).cuda(), 0, out=poisoned_out(n, 1, 0))
    assert error_bits(res.errors) == 0
    weight = 1 << 44
    want = [((kdtree_uniform64(s, p + 1) * vocab * weight) >> 64) // weight for s, p in zip(seeds, seq)]
    np.testing.assert_array_equal(res.bonus.cpu().numpy(), np.array(want, dtype=np.int64))
    np.testing.assert_array_equal(res.committed.cpu().numpy()[:, 0], np.array(want, dtype=np.int64))
    np.testing.assert_array_equal(res.new_seq_lens.cpu().numpy(), seq + 1)


def test_sampled_draws_are_keyed_by_position_not_node():
    """The token drawn at a visited node depends on (seed, absolute position P + depth + 1) and the node's
    logits only, not on the node's index: the same tree numbered breadth-first and depth-first (every
    node's logits row the same) commits the same tokens for every request and seed. Only tokens 0 and 1
    can be drawn, so every walk reaches a leaf."""
    torch = lazy_torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(8)
    bs, depth, vocab = 128, 4, 8
    row_of_path = {}
    results = []
    for order in ("bfs", "dfs"):
        tokens, parents, depths, paths = _binary_tree(order, depth)
        width = len(paths) + 1
        trees = ref.TreeBatch(
            tokens=np.tile(np.append(tokens, 0), (bs, 1)), depths=np.tile(np.append(depths, 0), (bs, 1)),
            parents=np.tile(np.append(parents, -1), (bs, 1)), num_nodes=np.full(bs, len(paths) - 1, dtype=np.int64))
        logits = np.full((bs, width, vocab), -100.0, dtype=np.float32)  # never drawn (below 2^-44 of the top)
        for i, p in enumerate(paths):
            if p not in row_of_path:
                row_of_path[p] = rng.normal(size=(bs, 2)).astype(np.float32)
            logits[:, i, :2] = row_of_path[p]
        lt = torch.from_numpy(logits.reshape(bs * width, vocab)).cuda()
        seeds = torch.arange(bs, device="cuda") * 7919 + 3
        seq = torch.arange(bs, device="cuda") + 100
        temps = torch.full((bs,), 1.3, device="cuda")
        res = accept_sampled(to_gpu(trees), lt, temps, seeds, seq)
        assert error_bits(res.errors) == 0
        assert torch.all(res.accept_lens == depth + 1)  # root + depth accepted nodes: every walk reaches a leaf
        results.append((res, accept_sampled(to_gpu(trees), lt, temps, seeds + 1, seq)))
    (bfs, bfs_other_seed), (dfs, _) = results
    assert torch.equal(bfs.committed, dfs.committed)
    assert torch.equal(bfs.bonus, dfs.bonus)
    assert not torch.equal(bfs.committed, bfs_other_seed.committed)  # the draws do depend on the seed
