"""GPU accept walk (sglang_kdtree/kernels/tree_accept.cu) against the numpy reference and SGLang's verify_tree_greedy.

Exact comparisons on fresh random trees (arbitrary parent links with duplicate sibling tokens, and real
best-first DDTree trees), targets steered down random paths, argmax ties, padding, edge widths; outputs
are poisoned before every launch. The sampled walk is checked exactly where it must be deterministic
(top_k = 1, T = 0, same seed, the same tree numbered two ways) and by chi-square against direct sampling of
the target otherwise.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sglang_kdtree import reference as ref
from sglang_kdtree.gpu.errors import error_bits

pytestmark = pytest.mark.gpu

POISON = 0x5A5A5A5A5A5A5A5A


def _torch():
    import torch

    return torch


def random_trees(rng, bs, width, vocab, num_nodes=None):
    """Arbitrary valid trees: parent[i] uniform in [0, i), tokens from a small vocabulary (duplicates)."""
    tokens = np.zeros((bs, width), dtype=np.int64)
    depths = np.zeros((bs, width), dtype=np.int64)
    parents = np.full((bs, width), -1, dtype=np.int64)
    nn = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        n = int(rng.integers(0, width)) if num_nodes is None else int(num_nodes[b])
        nn[b] = n
        tokens[b, 0] = rng.integers(0, vocab)
        for i in range(1, n + 1):
            p = int(rng.integers(0, i)) if rng.random() < 0.6 else i - 1  # mix of bushy and chain-like
            parents[b, i] = p
            depths[b, i] = depths[b, p] + 1
            tokens[b, i] = rng.integers(0, vocab)
    return ref.TreeBatch(tokens=tokens, depths=depths, parents=parents, num_nodes=nn)


def ddtree_trees(rng, bs, budget, depth, vocab):
    logits = rng.normal(size=(bs, depth, vocab)).astype(np.float32) * 3
    lp, ids = ref.topk_logprobs(logits, budget)
    return ref.build_trees(lp, ids, budget, rng.integers(0, vocab, size=bs))


def steered_targets(rng, trees, vocab):
    """[bs, N] target ids, random except along a random root-to-node path (so walks go deep)."""
    bs, width = trees.tokens.shape
    tgt = rng.integers(0, vocab, size=(bs, width)).astype(np.int64)
    for b in range(bs):
        n = int(trees.num_nodes[b])
        if n == 0:
            continue
        node = int(rng.integers(1, n + 1))
        while node > 0:
            p = int(trees.parents[b, node])
            tgt[b, p] = trees.tokens[b, node]
            node = p
    return tgt


def to_gpu(trees):
    torch = _torch()

    class T:
        pass

    t = T()
    for name in ("tokens", "parents", "num_nodes", "depths"):
        setattr(t, name, torch.from_numpy(getattr(trees, name)).cuda())
    return t


def poisoned_out(bs, width, max_depth):
    torch = _torch()
    from sglang_kdtree.gpu.accept import GPUAcceptResult

    def p(*shape):
        return torch.full(shape, POISON, dtype=torch.int64, device="cuda")

    return GPUAcceptResult(
        accepted=p(bs, max_depth + 1), accept_lens=p(bs), bonus=p(bs), committed=p(bs, width),
        new_seq_lens=p(bs), errors=p(bs),
    )


def assert_same(ours, expect: ref.AcceptResult, seq_lens=None):
    m = expect.accepted.shape[1]
    np.testing.assert_array_equal(ours.accepted.cpu().numpy(), expect.accepted)
    np.testing.assert_array_equal(ours.accept_lens.cpu().numpy(), expect.accept_lens)
    np.testing.assert_array_equal(ours.bonus.cpu().numpy(), expect.bonus)
    committed = ours.committed.cpu().numpy()
    k = min(m, committed.shape[1])  # max_depth may exceed N - 1; a path never does
    np.testing.assert_array_equal(committed[:, :k], expect.committed[:, :k])
    assert (committed[:, k:] == -1).all() and (expect.committed[:, k:] == -1).all()
    if seq_lens is not None:
        np.testing.assert_array_equal(ours.new_seq_lens.cpu().numpy(), seq_lens + expect.accept_lens)
    assert error_bits(ours.errors) == 0


def logits_for(rng, target_ids, vocab, ties=True):
    """[bs*N, V] float32 logits whose argmax (lower id on ties) is target_ids; small ints make ties."""
    rows = target_ids.reshape(-1)
    x = rng.integers(-4, 4, size=(rows.size, vocab)).astype(np.float32)
    x[np.arange(rows.size), rows] = 6.0
    if ties:
        # a tie at a higher id must lose to the planted lower id; a tie below the target would win
        higher = np.minimum(rows + 1 + rng.integers(0, 5, size=rows.size), vocab - 1)
        x[np.arange(rows.size), higher] = 6.0
    return x


@pytest.mark.parametrize("width,vocab", [(1, 5), (2, 3), (17, 4), (65, 8), (257, 6), (1025, 3)])
def test_ids_random_trees_match_reference(width, vocab):
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(width * 7 + vocab)
    bs = 33
    nn = rng.integers(0, width, size=bs)
    nn[0] = 0  # root only
    nn[1] = width - 1  # full
    trees = random_trees(rng, bs, width, vocab, num_nodes=nn)
    tgt = steered_targets(rng, trees, vocab)
    max_depth = width - 1
    expect = ref.accept_greedy(trees, tgt, max_depth=max_depth)
    seq_lens = rng.integers(0, 10000, size=bs).astype(np.int64)
    g = to_gpu(trees)
    for target in (torch.from_numpy(tgt).cuda(), torch.from_numpy(tgt).cuda().reshape(-1)):
        out = poisoned_out(bs, width, max_depth)
        res = accept_greedy(g, target, max_depth, seq_lens=torch.from_numpy(seq_lens).cuda(), out=out)
        assert_same(res, expect, seq_lens)


@pytest.mark.parametrize("budget,depth", [(16, 15), (64, 15), (256, 15), (15, 15), (1, 4)])
def test_ddtree_trees_all_target_kinds(budget, depth):
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(budget + depth)
    vocab = 50
    bs = 16
    trees = ddtree_trees(rng, bs, budget, depth, vocab)
    tgt = steered_targets(rng, trees, vocab)
    md = depth
    expect = ref.accept_greedy(trees, tgt, max_depth=md)
    g = to_gpu(trees)
    width = trees.tokens.shape[1]
    res = accept_greedy(g, torch.from_numpy(tgt).cuda(), md, out=poisoned_out(bs, width, md))
    assert_same(res, expect)
    logits = logits_for(rng, tgt, vocab)
    expect_l = ref.accept_greedy(trees, logits.reshape(bs, width, vocab), max_depth=md)
    np.testing.assert_array_equal(expect_l.accepted, expect.accepted)  # the planted argmax is the reference's too
    for dtype in (torch.float32, torch.bfloat16):
        lt = torch.from_numpy(logits).cuda().to(dtype)
        res = accept_greedy(g, lt, md, out=poisoned_out(bs, width, md))
        assert_same(res, expect)
        res3 = accept_greedy(g, lt.reshape(bs, width, vocab), md, out=poisoned_out(bs, width, md))
        assert_same(res3, expect)


@pytest.fixture(params=[256, 384, 512])
def greedy_threads(request, monkeypatch):
    """The greedy walk at each block size the launcher may pick (``_greedy_threads``: 384 up to batch 16, 256
    above) and at its launch bound, 512, whatever the batch."""
    from sglang_kdtree.gpu import accept

    monkeypatch.setattr(accept, "_greedy_threads", lambda bs: request.param)
    return request.param


@pytest.mark.parametrize("vocab", [7, 8, 4096, 4099, 151936])
def test_fused_argmax_ties_and_vocab_sizes(vocab, greedy_threads):
    """Vectorised (V % 8 == 0) and scalar tails; ties everywhere; -inf entries; a strided logits view."""
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(vocab)
    bs, width = 8, 17
    trees = random_trees(rng, bs, width, min(vocab, 5))
    tgt = steered_targets(rng, trees, min(vocab, 5))
    x = rng.integers(-2, 2, size=(bs * width, vocab)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = -np.inf
    rows = tgt.reshape(-1)
    x[np.arange(rows.size), rows] = 3.0
    x[np.arange(rows.size), np.minimum(rows + 2, vocab - 1)] = 3.0
    expect = ref.accept_greedy(trees, x.reshape(bs, width, vocab), max_depth=width - 1)
    g = to_gpu(trees)
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.zeros((bs * width, vocab + 3), dtype=dtype, device="cuda")
        big[:, :vocab] = torch.from_numpy(x).to(dtype)
        for lt in (big[:, :vocab].contiguous(), big[:, :vocab]):  # row stride V and V + 3
            res = accept_greedy(g, lt, width - 1, out=poisoned_out(bs, width, width - 1))
            assert_same(res, expect)


@pytest.mark.parametrize("vocab", [5, 4099, 163840])
def test_fused_argmax_across_the_cluster_slices(vocab, greedy_threads):
    """The greedy walk splits each visited row over a cluster of 8 blocks: equal maxima in two different
    slices go to the lower id, a NaN in a non-leader block's slice is flagged by the request (and never chosen),
    a row whose only finite maximum sits in the last slice's tail is found, and an all-NaN row commits token 0
    flagged (row_argmax's rule). Checked against the reference on the NaN-free equivalent."""
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(vocab + 1)
    bs, width = 6, 9
    trees = random_trees(rng, bs, width, min(vocab, 5))
    tgt = steered_targets(rng, trees, min(vocab, 5))
    x = rng.normal(size=(bs * width, vocab)).astype(np.float32)
    rows = tgt.reshape(-1)
    x[np.arange(rows.size), rows] = 9.0  # the steered token: lower ids than any slice boundary below
    slice_ = max(1, vocab // 8)
    if vocab > 16:
        x[0:width, min(vocab - 1, 6 * slice_ + 3)] = 9.0  # request 0: a tie in slice 6 (higher id: loses)
        x[width:2 * width, vocab - 1] = 9.0  # request 1: a tie in the last column (loses)
        x[2 * width:3 * width, vocab - 2] = float("nan")  # request 2: NaN in the last block's slice
        x[3 * width:4 * width, 5 * slice_ + 1] = float("nan")  # request 3: NaN in slice 5
    clean = np.where(np.isnan(x), -np.inf, x)
    expect = ref.accept_greedy(trees, clean.reshape(bs, width, vocab), max_depth=width - 1)
    g = to_gpu(trees)
    for dtype in (torch.float32, torch.bfloat16):
        for lt in (torch.from_numpy(x).cuda().to(dtype),
                   torch.nn.functional.pad(torch.from_numpy(x).cuda().to(dtype), (0, 3))[:, :vocab]):
            res = accept_greedy(g, lt, width - 1, out=poisoned_out(bs, width, width - 1))
            np.testing.assert_array_equal(res.accepted.cpu().numpy(), expect.accepted)
            np.testing.assert_array_equal(res.committed.cpu().numpy()[:, : expect.committed.shape[1]],
                                          expect.committed)
            np.testing.assert_array_equal(res.bonus.cpu().numpy(), expect.bonus)
            bits = res.errors.cpu().numpy()
            want = np.zeros(bs, dtype=np.int64)
            if vocab > 16:
                # a request's NaN is seen only if its walk visits a row holding one (all rows of 2 and 3 do)
                want[2] = want[3] = 8
            np.testing.assert_array_equal(bits, want)
    # an all-NaN root row: token 0, flagged
    x_nan = np.full((bs * width, vocab), np.nan, dtype=np.float32)
    res = accept_greedy(g, torch.from_numpy(x_nan).cuda(), width - 1, out=poisoned_out(bs, width, width - 1))
    assert (res.bonus.cpu().numpy() == 0).all()  # every visited row is all NaN: the choice is always token 0
    assert (res.errors.cpu().numpy() & 8 == 8).all()


def test_matches_sglang_verify_tree_greedy():
    torch = _torch()
    tree_ops = pytest.importorskip("sglang.kernels.ops.speculative.tree")
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(5)
    for bs, width, vocab in ((1, 17, 4), (32, 65, 6), (128, 257, 5)):
        trees = random_trees(rng, bs, width, vocab)
        tgt = steered_targets(rng, trees, vocab)
        vi = ref.verify_inputs(trees, np.zeros(bs, dtype=np.int64))
        md = width - 1
        spec = md + 1
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()
        predicts = torch.full((bs * width,), -7, dtype=torch.int32, device="cuda")
        accept_index = torch.full((bs, spec), -1, dtype=torch.int32, device="cuda")
        accept_num = torch.full((bs,), -7, dtype=torch.int32, device="cuda")
        tree_ops.verify_tree_greedy(
            predicts, accept_index, accept_num, dev(trees.tokens), dev(vi.retrieve_index),
            dev(vi.retrieve_next_token), dev(vi.retrieve_next_sibling), dev(tgt),
        )
        ours = accept_greedy(to_gpu(trees), dev(tgt), md, out=poisoned_out(bs, width, md))
        tau = ours.accept_lens.cpu().numpy()
        np.testing.assert_array_equal(accept_num.cpu().numpy(), tau - 1)
        acc = ours.accepted.cpu().numpy()
        rows = np.where(acc >= 0, acc + np.arange(bs)[:, None] * width, -1)
        np.testing.assert_array_equal(accept_index.cpu().numpy(), rows)
        pred = predicts.cpu().numpy()
        committed = ours.committed.cpu().numpy()
        for b in range(bs):
            np.testing.assert_array_equal(pred[rows[b, : tau[b]]], committed[b, : tau[b]])


def test_device_errors_are_flagged_not_written():
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy

    rng = np.random.default_rng(11)
    bs, width, vocab = 4, 9, 3
    trees = random_trees(rng, bs, width, vocab, num_nodes=[8, 8, 8, 8])
    # a chain 0-1-2-...-8 fully accepted but max_depth = 3: truncated + bit 4
    trees.parents[0, 1:] = np.arange(0, 8)
    tgt = np.zeros((bs, width), dtype=np.int64)
    tgt[0, :8] = trees.tokens[0, 1:]
    g = to_gpu(trees)
    res = accept_greedy(g, torch.from_numpy(tgt).cuda(), 3, out=poisoned_out(bs, width, 3))
    assert error_bits(res.errors) == 4
    with pytest.raises(ValueError, match="max_depth"):
        res.raise_on_error()
    assert res.accepted[0].tolist() == [0, 1, 2, 3]
    # num_nodes out of range, a parent >= i, NaN logits
    g.num_nodes[1] = width + 5
    g.parents[2, 5] = 7
    logits = torch.randn(bs * width, 16, device="cuda")
    logits[0, 3] = float("nan")
    res = accept_greedy(g, logits, width - 1, out=poisoned_out(bs, width, width - 1))
    assert error_bits(res.errors) == 1 | 2 | 8
    assert (res.accept_lens.cpu() >= 1).all()
    for name in ("accept_lens", "bonus", "errors"):  # every request still gets its result
        assert not (getattr(res, name) == POISON).any(), name


def test_sampled_top_k_one_and_zero_temperature_are_greedy():
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_greedy, accept_sampled

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
    torch = _torch()
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
    torch = _torch()
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
    torch = _torch()
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


def _filtered(p, top_k, top_p, min_p=0.0):
    """SGLang's top-k / top-p / min-p on one probability row (sorted by prob desc, lower id first)."""
    order = np.lexsort((np.arange(p.size), -p))
    ps = p[order]
    excl = np.cumsum(ps) - ps
    keep = (np.arange(p.size) < top_k) & (excl <= top_p) & (ps >= min_p * ps[0])
    q = np.zeros_like(p)
    q[order[keep]] = ps[keep]
    return q / q.sum()


def _chi2(observed: dict, expected: dict, n: int):
    keys = sorted(set(expected) | set(observed))
    big = [k for k in keys if expected.get(k, 0) * n >= 5]
    stat = 0.0
    for k in big:
        e = expected[k] * n
        stat += (observed.get(k, 0) - e) ** 2 / e
    e_rest = n - sum(expected[k] * n for k in big)
    o_rest = n - sum(observed.get(k, 0) for k in big)
    if e_rest >= 5:
        stat += (o_rest - e_rest) ** 2 / e_rest
        df = len(big)
    else:
        df = len(big) - 1
        if o_rest > 5 + 10 * e_rest:  # draws where the expected distribution has (almost) no mass
            return float("inf"), df
    return stat, df


@pytest.mark.parametrize(
    "vocab,dtype_name,temp,top_k,top_p,min_p",
    [
        (6, "float32", 0.8, None, None, None),
        (6, "float32", 1.3, 3, None, None),
        (6, "bfloat16", 1.0, None, 0.7, None),
        (4096, "bfloat16", 0.7, 5, 0.9, None),
        (4099, "float32", 1.0, None, None, None),
        (6, "float32", 1.0, None, None, 0.3),
        (4096, "bfloat16", 1.2, 6, 0.95, 0.3),
    ],
)
def test_sampled_committed_distribution_equals_target_sampling(vocab, dtype_name, temp, top_k, top_p, min_p):
    """Committed (first, second) tokens over many independent requests vs direct target sampling; with min-p,
    the same samples also reject the distribution that ignores min-p (the test would see min-p dropped)."""
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(vocab + int(temp * 10))
    # one tree: root -> nodes 1,2,3 (tokens 1,2,4); node 1 -> nodes 4,5 (tokens 0,3); node 4 -> node 6 (token 2)
    width = 7
    tok = np.array([5, 1, 2, 4, 0, 3, 2])
    par = np.array([-1, 0, 0, 0, 1, 1, 4])
    live = min(8, vocab)  # tokens with real mass; the rest of a big vocabulary sits far below
    base = np.full((width, vocab), -30.0, dtype=np.float32)
    base[:, :live] = rng.normal(size=(width, live)).astype(np.float32) * 1.2
    dtype = getattr(torch, dtype_name)
    base = torch.from_numpy(base).to(dtype).float().numpy()  # the kernel sees bf16-rounded values
    n = 200_000 if vocab < 100 else 100_000
    trees = ref.TreeBatch(
        tokens=np.tile(tok, (n, 1)), depths=np.zeros((n, width), dtype=np.int64),
        parents=np.tile(par, (n, 1)), num_nodes=np.full(n, width - 1),
    )
    g = to_gpu(trees)
    lt = torch.from_numpy(base).to(dtype).cuda().repeat(n, 1)
    res = accept_sampled(
        g, lt, torch.full((n,), temp, device="cuda"), torch.arange(n, device="cuda") * 7919 + 17,
        torch.full((n,), 1000, dtype=torch.int64, device="cuda"), 3,
        top_ks=None if top_k is None else torch.full((n,), top_k, dtype=torch.int64, device="cuda"),
        top_ps=None if top_p is None else torch.full((n,), top_p, device="cuda"),
        min_ps=None if min_p is None else torch.full((n,), min_p, device="cuda"),
    )
    assert error_bits(res.errors) == 0
    committed = res.committed.cpu().numpy()
    tau = res.accept_lens.cpu().numpy()

    def dist(node, t, mp=min_p):
        x = base[node].astype(np.float64) / t
        p = np.exp(x - x.max())
        p /= p.sum()
        return _filtered(p, vocab if top_k is None else top_k, 1.0 if top_p is None else top_p, mp or 0.0)

    child = {(int(par[i]), int(tok[i])): i for i in range(width - 1, 0, -1)}

    def pair_dist(t, mp=min_p):
        expected = {}
        p0 = dist(0, t, mp)
        for a in np.flatnonzero(p0 > 0):
            if (0, int(a)) in child:
                p1 = dist(child[(0, int(a))], t, mp)
                for b2 in np.flatnonzero(p1 > 0):
                    expected[(int(a), int(b2))] = p0[a] * p1[b2]
            else:
                expected[(int(a), -1)] = p0[a]
        return expected

    expected = pair_dist(temp)
    observed: dict = {}
    for first, second, t in zip(committed[:, 0], committed[:, 1], tau):
        key = (int(first), int(second) if t >= 2 else -1)
        observed[key] = observed.get(key, 0) + 1
    stat, df = _chi2(observed, expected, n)
    limit = df + 8 * np.sqrt(2 * df)
    assert stat < limit, f"chi2 {stat:.1f} with {df} dof (limit {limit:.1f})"
    # the test has power: the distribution at a slightly different temperature is rejected
    wrong = {}
    q0 = dist(0, temp * 1.15)
    for (a, b2), _ in expected.items():
        wrong[(a, b2)] = q0[a] * (dist(child[(0, a)], temp * 1.15)[b2] if b2 >= 0 else 1.0)
    wstat, wdf = _chi2(observed, {k: v / sum(wrong.values()) for k, v in wrong.items()}, n)
    assert wstat > wdf + 8 * np.sqrt(2 * wdf)
    if min_p is not None:  # and against min-p ignored: the filter removes real mass here (0.275 and 0.034)
        unfiltered = pair_dist(temp, 0.0)
        assert sum(unfiltered.values()) - sum(unfiltered[k] for k in expected if k in unfiltered) > 0.02
        ustat, udf = _chi2(observed, unfiltered, n)
        assert ustat > udf + 8 * np.sqrt(2 * udf)


# ------------------------------------------------------------------------------------------------
# min-p
# ------------------------------------------------------------------------------------------------


def test_sampled_min_p_one_is_greedy_and_zero_or_nan_is_off():
    """min_p 1 keeps only the tokens tied with the max: on rows without such ties every request walks exactly
    like the greedy accept (values > 1 count as 1), on poisoned outputs; min_p 0 and NaN are off: bit-identical
    to no min_ps at all (same seeds, same draws); bad min_ps are refused on the host."""
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    rng = np.random.default_rng(31)
    bs, width, vocab = 64, 65, 300
    trees = random_trees(rng, bs, width, 6)
    tgt = steered_targets(rng, trees, 6)
    logits = logits_for(rng, tgt, vocab, ties=False)
    logits[logits < 6.0] += rng.random(int((logits < 6.0).sum())).astype(np.float32) * 0.5  # still below 6
    expect = ref.accept_greedy(trees, tgt, max_depth=width - 1)
    g = to_gpu(trees)
    seq = torch.from_numpy(rng.integers(0, 1 << 40, size=bs)).cuda()
    seeds = torch.from_numpy(rng.integers(0, 1 << 62, size=bs)).cuda()
    temps = torch.full((bs,), 1.7, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        lt = torch.from_numpy(logits).cuda().to(dtype)
        assert ((lt.float() == lt.float().amax(-1, keepdim=True)).sum(-1) == 1).all()  # one max per row
        ones = torch.ones(bs, device="cuda")
        ones[::3] = 2.5  # > 1: counts as 1
        res = accept_sampled(g, lt, temps, seeds, seq, min_ps=ones, out=poisoned_out(bs, width, width - 1))
        assert_same(res, expect, seq.cpu().numpy())
        free = accept_sampled(g, lt, temps, seeds, seq, out=poisoned_out(bs, width, width - 1))
        assert not torch.equal(free.committed, res.committed)  # T 1.7 without min-p really samples
        off = torch.zeros(bs, device="cuda")
        off[1::2] = float("nan")
        res0 = accept_sampled(g, lt, temps, seeds, seq, min_ps=off, out=poisoned_out(bs, width, width - 1))
        for name in ("accepted", "accept_lens", "bonus", "committed", "new_seq_lens", "errors"):
            assert torch.equal(getattr(res0, name), getattr(free, name)), name
    with pytest.raises(TypeError, match="min_ps must have dtype"):
        accept_sampled(g, lt, temps, seeds, seq, min_ps=torch.ones(bs, dtype=torch.float64, device="cuda"))
    with pytest.raises(ValueError, match=r"min_ps has shape \(3,\)"):
        accept_sampled(g, lt, temps, seeds, seq, min_ps=torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="min_ps is on cpu"):
        accept_sampled(g, lt, temps, seeds, seq, min_ps=torch.ones(bs))


def _ladder(center: float, steps: int, dtype_name: str) -> list[float]:
    """The 2*steps+1 consecutive float32 (or bfloat16) values around ``center`` (rounded to the dtype first),
    ascending; the ladder must not cross zero."""
    torch = _torch()
    c = torch.tensor([center], dtype=torch.float32).to(getattr(torch, dtype_name)).float().numpy()[0]
    assert c != 0
    bits = int(np.array([c], dtype=np.float32).view(np.uint32)[0])
    unit = 1 if dtype_name == "float32" else 1 << 16
    sign = 1 if c > 0 else -1
    out = [np.array([bits + sign * k * unit], dtype=np.uint32).view(np.float32)[0] for k in range(-steps, steps + 1)]
    assert all(np.sign(v) == np.sign(c) for v in out)
    return sorted(float(v) for v in out)


#: draws per row in the kept-set test; every kept token there has probability > MIN_KEPT_PROB, so one is
#: missed with probability < (1 - 2e-3)^16384 < 1e-14
KEPT_SET_DRAWS, MIN_KEPT_PROB = 16384, 2e-3


def _kept_set_cases(rng):
    """Rows built around the min-p boundary b = m + T log(min_p): the max m, sometimes a tie with it, the seven
    representable values nearest b (the ladder), a few clearly kept and clearly cut values, an occasional
    -inf, in random token order; each with top-k / top-p off, top-k 2 (tighter than min-p), a top-k of 3..7,
    and a top-p midway between two prefix masses (the kernel's fixed-point masses cannot round across it)."""
    torch = _torch()
    cases = []
    for dtype_name in ("float32", "bfloat16"):
        for min_p in (0.02, 0.1, 0.3, 0.5, 0.9, 1.0):
            for temp, m in ((1.0, 5.0), (0.7, -7.25), (1.6, 0.5), (1.3, 31.0)):
                vocab = 32
                mp, t32 = float(np.float32(min_p)), float(np.float32(temp))
                b = m + t32 * np.log(mp)
                if min_p == 1.0:
                    ladder = [m] + _ladder(m, 3, dtype_name)[:3]  # a tie with the max, the three floats below it
                    values = [m] + ladder
                else:
                    ladder = [v for v in _ladder(b, 3, dtype_name) if v < m]  # bf16 near m: its steps are coarse
                    values = [m] + ladder + [m - 0.2 * t32 * abs(np.log(mp)), m - 0.5 * t32 * abs(np.log(mp))]
                    if rng.random() < 0.5:
                        values.append(m)  # a tie with the max
                values += [b - 2.0 * t32, b - 4.0 * t32, -30.0]
                if rng.random() < 0.5:
                    values.append(-np.inf)
                values += [b - 6.0 * t32 - rng.random() for _ in range(vocab - len(values))]
                row = np.array(values, dtype=np.float32)[rng.permutation(vocab)]
                row = torch.from_numpy(row).to(getattr(torch, dtype_name)).float().numpy()
                assert row.max() == np.float32(m) and set(np.float32(ladder).tolist()) <= set(row.tolist())
                w = ref.sampling_weights(row[None, None], t32)[0, 0]
                s = np.sort(w)[::-1] / w.sum()
                excl = np.cumsum(s) - s
                j = next(j for j in range(int(rng.integers(1, 6)), 0, -1) if excl[j + 1] - excl[j] > 2e-4)
                mid = float(np.float32((excl[j] + excl[j + 1]) / 2))
                for top_k, top_p in ((None, None), (2, None), (int(rng.integers(3, 8)), None), (None, mid)):
                    cases.append(dict(dtype=dtype_name, row=row, temp=t32, min_p=mp, top_k=top_k, top_p=top_p,
                                      ladder=np.float32(ladder)))
    return cases


def _reference_kept(case) -> set[int]:
    """The reference's kept set of a case, after checking the case is one the test can decide: every kept
    token likely enough to be seen, no token within 1e-12 (relative) of the min-p boundary, and (min-p alone,
    min_p < 1) a ladder that straddles the boundary."""
    row, t32, mp = case["row"], case["temp"], case["min_p"]
    w = ref.sampling_weights(row[None, None], t32, top_k=case["top_k"], top_p=case["top_p"], min_p=mp)[0, 0]
    assert w[w > 0].min() > MIN_KEPT_PROB
    ratio = np.exp(row.astype(np.float64) / t32 - float(row.max()) / t32)
    assert mp == 1.0 or np.abs(ratio / mp - 1).min() > 1e-12
    if case["top_k"] is None and case["top_p"] is None and mp < 1.0:
        on_ladder = np.isin(row, case["ladder"])
        assert (w[on_ladder] > 0).any() and (w[on_ladder] == 0).any()
    return set(np.flatnonzero(w > 0).tolist())


def test_sampled_min_p_kept_sets_equal_the_reference_near_the_boundary():
    """Kernel vs ``reference.sampling_weights`` at the min-p boundary, exactly: every row's kept set (top-k,
    top-p, min-p and their intersection) is the set of tokens drawn over KEPT_SET_DRAWS seeds, on poisoned
    outputs. Each row holds the seven consecutive float32 / bf16 values around m + T log(min_p) (the
    adversarial case: the kernel decides with its own threshold search and CUDA's double exp, the reference
    with numpy's exp per token), so a one-float disagreement shows as a token drawn that the reference cuts
    (never allowed) or a kept token never drawn. Agreement is expected wherever exp(x/T - m/T) is further than
    ~2^-52 relative from min_p; ``_reference_kept`` checks the rows stay > 1e-12 away."""
    torch = _torch()
    from sglang_kdtree.gpu.accept import accept_sampled

    cases = _kept_set_cases(np.random.default_rng(77))
    draws = KEPT_SET_DRAWS
    for dtype_name in ("float32", "bfloat16"):
        mine = [c for c in cases if c["dtype"] == dtype_name]
        expect = [_reference_kept(c) for c in mine]
        rows = np.stack([c["row"] for c in mine])
        vocab, n = rows.shape[1], len(mine) * draws
        lt = torch.from_numpy(rows).to(getattr(torch, dtype_name)).cuda().repeat_interleave(draws, dim=0)

        def per_request(values, dtype):
            return torch.tensor(values, dtype=dtype, device="cuda").repeat_interleave(draws)

        trees = ref.TreeBatch(tokens=np.zeros((n, 1), np.int64), depths=np.zeros((n, 1), np.int64),
                              parents=np.full((n, 1), -1, np.int64), num_nodes=np.zeros(n, np.int64))
        res = accept_sampled(
            to_gpu(trees), lt, per_request([c["temp"] for c in mine], torch.float32),
            torch.arange(n, device="cuda") * 7919 + 5, torch.full((n,), 77, dtype=torch.int64, device="cuda"), 0,
            top_ks=per_request([vocab if c["top_k"] is None else c["top_k"] for c in mine], torch.int64),
            top_ps=per_request([1.0 if c["top_p"] is None else c["top_p"] for c in mine], torch.float32),
            min_ps=per_request([c["min_p"] for c in mine], torch.float32), out=poisoned_out(n, 1, 0))
        assert error_bits(res.errors) == 0
        assert (res.accept_lens == 1).all() and (res.accepted == 0).all()
        bonus = res.bonus.cpu().numpy()
        np.testing.assert_array_equal(res.committed.cpu().numpy()[:, 0], bonus)
        np.testing.assert_array_equal(res.new_seq_lens.cpu().numpy(), np.full(n, 78))
        for case, kept, got in zip(mine, expect, bonus.reshape(len(mine), draws)):
            where = (dtype_name, float(case["row"].max()), case["temp"], case["min_p"], case["top_k"], case["top_p"])
            assert set(np.unique(got).tolist()) == kept, where
