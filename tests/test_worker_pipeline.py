"""The worker's backend object on CPU: ``select_backend`` picks the reference, and its torch-in/torch-out
methods are exactly the reference's semantics (a round assembled from them equals the numpy oracle)."""

from __future__ import annotations

import numpy as np
import torch

from sglang_kdtree import reference
from sglang_kdtree.round.pipeline import ReferenceBackend, select_backend
from sglang_kdtree.state import RoundShape


def _round_inputs(seed=0, bs=3, depths=4, vocab=12, budget=6):
    rng = np.random.default_rng(seed)
    draft_logits = rng.normal(size=(bs, depths, vocab)).astype(np.float32) * 3
    target_logits = rng.normal(size=(bs, budget + 1, vocab)).astype(np.float32) * 3
    roots = rng.integers(0, vocab, size=bs)
    seq_lens = np.array([5, 1, 9])[:bs]
    return draft_logits, target_logits, roots, seq_lens


def test_cpu_selects_the_reference():
    assert select_backend("cpu").name == "reference"


def test_round_matches_the_numpy_oracle():
    draft_logits, target_logits, roots, seq_lens = _round_inputs()
    budget, backend = 6, ReferenceBackend("cpu")
    lp, ids = backend.topk(torch.from_numpy(draft_logits), budget)
    trees = backend.build(lp, ids, budget, torch.from_numpy(roots))
    vi = backend.verify_inputs(trees, torch.from_numpy(seq_lens))
    acc = backend.accept_greedy(trees, torch.from_numpy(target_logits), 4)
    slots = torch.arange(3 * 7).view(3, 7) * 2
    plan = backend.commit_plan(acc.accepted, acc.accept_lens, slots)

    ref_lp, ref_ids = reference.topk_logprobs(draft_logits, budget)
    ref_trees = reference.build_trees(ref_lp, ref_ids, budget, roots)
    ref_vi = reference.verify_inputs(ref_trees, seq_lens)
    ref_acc = reference.accept_greedy(ref_trees, target_logits, 4)
    ref_plan = reference.commit_plan(ref_acc.accepted, ref_acc.accept_lens, slots.numpy())
    np.testing.assert_array_equal(trees.tokens.numpy(), ref_trees.tokens)
    np.testing.assert_array_equal(trees.parents.numpy(), ref_trees.parents)
    np.testing.assert_array_equal(vi.full_mask.numpy(), ref_vi.full_mask)
    np.testing.assert_array_equal(vi.positions.numpy(), ref_vi.positions)
    np.testing.assert_array_equal(vi.ancestor_bits.numpy().view(np.uint32), ref_vi.ancestor_bits)
    # the contract's committed is [bs, N] like the GPU kernel's (the reference's [bs, L+1], then -1)
    assert acc.committed.shape == (3, 7) and acc.accepted.shape == (3, 5) and acc.errors.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(acc.committed.numpy()[:, :5], ref_acc.committed)
    assert (acc.committed[:, 5:] == -1).all()
    np.testing.assert_array_equal(plan.src_slots.numpy(), ref_plan.src_slots)
    np.testing.assert_array_equal(plan.hidden_rows.numpy(), ref_plan.hidden_rows)


def test_sampled_accept_is_seeded_per_request_and_greedy_at_zero_temperature():
    draft_logits, target_logits, roots, seq_lens = _round_inputs(seed=1)
    backend = ReferenceBackend("cpu")
    lp, ids = backend.topk(torch.from_numpy(draft_logits), 6)
    trees = backend.build(lp, ids, 6, torch.from_numpy(roots))
    logits = torch.from_numpy(target_logits)
    temps = torch.tensor([0.0, 1.0, 1.0])
    run = lambda seeds: backend.accept_sampled(trees, logits, temps, torch.tensor(seeds), torch.from_numpy(seq_lens), 4)  # noqa: E731
    a, b = run([1, 2, 3]), run([1, 2, 3])
    np.testing.assert_array_equal(a.committed.numpy(), b.committed.numpy())
    greedy = backend.accept_greedy(trees, logits, 4)
    np.testing.assert_array_equal(a.committed.numpy()[0], greedy.committed.numpy()[0])
    # request 1's draw depends on its own seed only (not on request 2's)
    c = run([1, 2, 99])
    np.testing.assert_array_equal(a.committed.numpy()[1], c.committed.numpy()[1])
    draws = {tuple(run([1, s, 3]).committed.numpy()[1]) for s in range(20)}
    assert len(draws) > 1


def test_sample_tokens_is_reproducible_and_follows_temperature():
    backend = ReferenceBackend("cpu")
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0]] * 64)
    seeds = torch.arange(64)
    lens = torch.full((64,), 7)
    cold = backend.sample_tokens(logits, torch.full((64,), 0.05), seeds, lens)
    assert (cold == 1).all()
    hot = backend.sample_tokens(logits, torch.full((64,), 50.0), seeds, lens)
    assert torch.equal(hot, backend.sample_tokens(logits, torch.full((64,), 50.0), seeds, lens))
    assert len(set(hot.tolist())) > 1


def test_sampled_tokens_do_not_depend_on_the_tree():
    """With uniforms keyed by absolute position, what a T > 0 round commits is autoregressive sampling of
    the target: two different trees (budgets) over the same Markov target agree on their common prefix."""
    rng = np.random.default_rng(5)
    vocab, depths = 6, 5
    markov = rng.normal(size=(vocab, vocab)).astype(np.float32)  # target logits depend on the last token
    draft_logits = rng.normal(size=(1, depths, vocab)).astype(np.float32)
    backend = ReferenceBackend("cpu")
    lp, ids = backend.topk(torch.from_numpy(draft_logits), vocab)
    commits = []
    for budget in (3, 12):
        trees = backend.build(lp, ids, budget, torch.tensor([2]))
        node_logits = torch.from_numpy(markov[trees.tokens.numpy()[0]])[None]
        acc = backend.accept_sampled(trees, node_logits, torch.tensor([1.0]), torch.tensor([7]),
                                     torch.tensor([10]), depths)
        commits.append(acc.committed.numpy()[0][: int(acc.accept_lens[0])].tolist())
    common = min(len(c) for c in commits)
    assert commits[0][:common] == commits[1][:common]
    # and it is the autoregressive draw: token at position 11 from the root's row with u(7, 11), etc.
    from sglang_kdtree.reference import position_uniform

    token, expected = 2, []
    for pos in range(11, 11 + common):
        x = markov[token].astype(np.float64)
        cdf = np.cumsum(np.exp(x - x.max()))
        token = min(int(np.searchsorted(cdf, position_uniform(7, pos) * cdf[-1], side="right")), vocab - 1)
        expected.append(token)
    assert commits[0][:common] == expected


def test_reference_accept_sampled_honours_top_k_and_top_p_per_request():
    """A batch mixing SGLang's greedy encoding (T 1, top_k 1), top_p ~ 0 and plain T = 1: the first two walk
    exactly like the greedy accept, the third samples."""
    rng = np.random.default_rng(8)
    backend = ReferenceBackend("cpu")
    draft = torch.from_numpy(rng.normal(size=(3, 4, 40)).astype(np.float32))
    lp, ids = backend.topk(draft, 6)
    trees = backend.build(lp, ids, 6, torch.tensor([1, 2, 3]))
    target = torch.from_numpy(rng.normal(size=(3, 7, 40)).astype(np.float32) * 0.3)
    greedy = backend.accept_greedy(trees, target, 4)
    acc = backend.accept_sampled(trees, target, torch.ones(3), torch.tensor([5, 6, 7]), torch.tensor([9, 9, 9]), 4,
                                 top_ks=torch.tensor([1, 1 << 30, 1 << 30], dtype=torch.int32),
                                 top_ps=torch.tensor([1.0, 1e-6, 1.0]))
    for b in (0, 1):
        assert torch.equal(acc.committed[b], greedy.committed[b]) and acc.accept_lens[b] == greedy.accept_lens[b]
    free = [backend.accept_sampled(trees, target, torch.ones(3), torch.tensor([5, 6, s]), torch.tensor([9, 9, 9]),
                                   4).committed[2, 0].item() for s in range(40)]
    assert len(set(free)) > 1  # the unfiltered request really samples (flat target: many likely tokens)


def test_reference_backend_applies_min_p_per_request():
    """min_ps per request: 1 is the greedy walk (no ties in these logits), 0 is off (the very draws of a call
    without min_ps), 0.3 commits only tokens of the min-p kept set of the row each was drawn from; the prefill
    redraw (``sample_tokens``) filters the same way."""
    rng = np.random.default_rng(9)
    backend = ReferenceBackend("cpu")
    draft = torch.from_numpy(rng.normal(size=(3, 4, 40)).astype(np.float32))
    lp, ids = backend.topk(draft, 6)
    trees = backend.build(lp, ids, 6, torch.tensor([1, 2, 3]))
    target = torch.from_numpy(rng.normal(size=(3, 7, 40)).astype(np.float32))
    greedy = backend.accept_greedy(trees, target, 4)
    temps, lens = torch.full((3,), 1.5), torch.tensor([9, 9, 9])

    def kept(row, min_p):
        return set(np.flatnonzero(reference.sampling_weights(row[None, None], 1.5, min_p=min_p)[0, 0] > 0).tolist())

    seen = set()
    for s in range(30):
        seeds = torch.tensor([5, 6, s])
        acc = backend.accept_sampled(trees, target, temps, seeds, lens, 4, min_ps=torch.tensor([1.0, 0.0, 0.3]))
        plain = backend.accept_sampled(trees, target, temps, seeds, lens, 4)
        assert torch.equal(acc.committed[0], greedy.committed[0]) and acc.accept_lens[0] == greedy.accept_lens[0]
        assert torch.equal(acc.committed[1], plain.committed[1]) and acc.accept_lens[1] == plain.accept_lens[1]
        tau = int(acc.accept_lens[2])
        for j in range(tau):  # committed[j] was drawn at accepted node j
            row = target[2, int(acc.accepted[2, j])].numpy()
            assert int(acc.committed[2, j]) in kept(row, 0.3)
        seen.add(int(acc.committed[2, 0]))
    root = target[2, 0].numpy()
    assert len(kept(root, 0.3)) < 40 and len(seen) > 1  # the filter cuts, and the request still samples
    rows = target[:, 0]
    for s in range(20):
        drawn = backend.sample_tokens(rows, temps, torch.tensor([s, s, s]), lens, min_ps=torch.tensor([1.0, 0.3, 0.0]))
        assert int(drawn[0]) == int(rows[0].argmax())
        assert int(drawn[1]) in kept(rows[1].numpy(), 0.3)
        assert int(drawn[2]) == int(backend.sample_tokens(rows, temps, torch.tensor([s, s, s]), lens)[2])


def test_tree_step_is_head_gemm_then_topk_then_tree_then_verify_inputs():
    """``tree_step`` (the worker's one call for steps 2-4) on the reference backend against numpy: the head GEMM
    over a padded lm_head cut to the real vocabulary, top-K with K = min(budget, vocab), the tree, its verify
    inputs."""
    rng = np.random.default_rng(4)
    bs, depths, vocab, padded, hidden, budget = 3, 4, 12, 16, 8, 6
    rows = rng.normal(size=(bs * depths, hidden)).astype(np.float32)
    weight = rng.normal(size=(padded, hidden)).astype(np.float32)
    weight[vocab:] = 100.0  # padding rows would win every top-K if they were not cut away
    roots = rng.integers(0, vocab, size=bs)
    seq_lens = np.array([5, 1, 9])
    marked = []
    step = ReferenceBackend("cpu").tree_step(
        torch.from_numpy(rows), torch.from_numpy(weight), RoundShape(budget, budget + 1, depths, vocab),
        torch.from_numpy(roots), torch.from_numpy(seq_lens), int(seq_lens.sum()),
        mark=lambda: marked.append("draft_head"))
    trees, verify, logits = step.trees, step.verify, step.draft_logits
    assert marked == ["draft_head"]  # the drafter's head ends once, before the bookkeeping
    expect_logits = (rows.astype(np.float64) @ weight.T.astype(np.float64))[:, :vocab]
    np.testing.assert_allclose(logits.numpy(), expect_logits, rtol=1e-5, atol=1e-5)
    ref_lp, ref_ids = reference.topk_logprobs(logits.numpy().reshape(bs, depths, vocab), budget)
    ref_trees = reference.build_trees(ref_lp, ref_ids, budget, roots)
    np.testing.assert_array_equal(trees.tokens.numpy(), ref_trees.tokens)
    np.testing.assert_array_equal(trees.parents.numpy(), ref_trees.parents)
    assert int(trees.tokens.max()) < vocab
    ref_vi = reference.verify_inputs(ref_trees, seq_lens)
    np.testing.assert_array_equal(verify.full_mask.numpy(), ref_vi.full_mask)
    np.testing.assert_array_equal(verify.positions.numpy(), ref_vi.positions)


class _RecordingPool:
    """Stands in for an SGLang KV pool: one tensor of rows, ``move_kv_cache(dst, src)`` as SGLang defines it."""

    def __init__(self, rows):
        self.rows = rows

    def move_kv_cache(self, dst, src):
        self.rows[dst] = self.rows[src].clone()


def test_accept_commit_greedy_is_accept_then_plan_then_move_then_gather():
    """``accept_commit_greedy`` (steps 6-7 for a greedy batch) on the reference backend: the accepted path's
    rows land at the slots of positions P..P+tau-1 and the returned hidden rows are the accepted nodes' rows,
    checked against a walk over the numpy oracle's accept result."""
    draft_logits, target_logits, roots, seq_lens = _round_inputs(seed=3)
    budget, depths, width = 6, 4, 7
    backend = ReferenceBackend("cpu")
    lp, ids = backend.topk(torch.from_numpy(draft_logits), budget)
    trees = backend.build(lp, ids, budget, torch.from_numpy(roots))
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(1))[: 3 * width].view(3, width)
    kv = torch.randn(40, 5, generator=torch.Generator().manual_seed(2))
    before = kv.clone()
    hidden = torch.randn(3 * width, 4, generator=torch.Generator().manual_seed(3))
    acc, plan, rows = backend.accept_commit_greedy(trees, torch.from_numpy(target_logits), depths, slots,
                                                   _RecordingPool(kv), hidden, width)
    ref_trees = reference.build_trees(*reference.topk_logprobs(draft_logits, budget), budget, roots)
    ref_acc = reference.accept_greedy(ref_trees, target_logits, depths)
    np.testing.assert_array_equal(acc.accepted.numpy(), ref_acc.accepted)
    for b in range(3):
        tau = int(ref_acc.accept_lens[b])
        path = ref_acc.accepted[b, :tau]
        for i, node in enumerate(path):
            assert torch.equal(kv[slots[b, i]], before[slots[b, node]]), (b, i)
            assert torch.equal(rows[b, i], hidden[b * width + node]), (b, i)
