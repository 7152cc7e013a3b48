"""GPU greedy accept walk (sglang_kdtree/kernels/tree_accept.cu) against the numpy reference and SGLang's verify_tree_greedy.

Exact comparisons on fresh random trees (arbitrary parent links with duplicate sibling tokens, and real
best-first DDTree trees), targets steered down random paths, argmax ties (also across the cluster's slices),
padding, edge widths, device-side errors; outputs are poisoned before every launch. The sampled walk:
``test_accept_sampled_gpu.py`` and ``test_accept_sampled_distribution_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from accept_gpu_cases import (
    POISON,
    assert_same,
    ddtree_trees,
    lazy_torch,
    logits_for,
    poisoned_out,
    random_trees,
    steered_targets,
    to_gpu,
)
from sglang_kdtree import reference as ref
from sglang_kdtree.gpu.errors import error_bits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("width,vocab", [(1, 5), (2, 3), (17, 4), (65, 8), (257, 6), (1025, 3)])
def test_ids_random_trees_match_reference(width, vocab):
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
