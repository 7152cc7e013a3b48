"""What the GPU accept-walk tests share: random and best-first DDTree trees, targets steered down a random
path, logits with a planted argmax, the trees on the GPU, poisoned output buffers, and the exact comparison
against ``reference.AcceptResult``."""

from __future__ import annotations

import numpy as np

from sglang_kdtree import reference as ref
from sglang_kdtree.gpu.errors import error_bits


POISON = 0x5A5A5A5A5A5A5A5A


def lazy_torch():
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
    torch = lazy_torch()

    class T:
        pass

    t = T()
    for name in ("tokens", "parents", "num_nodes", "depths"):
        setattr(t, name, torch.from_numpy(getattr(trees, name)).cuda())
    return t


def poisoned_out(bs, width, max_depth):
    torch = lazy_torch()
    from sglang_kdtree.contract import AcceptResult

    def p(*shape):
        return torch.full(shape, POISON, dtype=torch.int64, device="cuda")

    return AcceptResult(
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
