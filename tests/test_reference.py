"""The DDTree reference against independent brute force and hand-built cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kdtree import reference as R

# ------------------------------------------------------------------------------------------------
# brute force: every prefix of rank tuples, scored with the contract's incremental arithmetic
# ------------------------------------------------------------------------------------------------


def brute_force_order(logprobs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """All reachable rank tuples sorted by (score desc, tuple asc), first `budget` of them.

    Scores follow the contract's operation order exactly: a rank-0 node adds S[d][0] to its parent's score;
    a rank-r node is (score(rank r-1 sibling) - S[d][r-1]) + S[d][r]. With log-probs <= 0 a child never
    outscores its parent nor a sibling its elder, so best-first pop order is this global sort.
    """
    s = logprobs.astype(np.float64)
    depth_count, k = s.shape
    scores: dict[tuple[int, ...], float] = {}
    for d in range(1, depth_count + 1):
        for path in itertools.product(range(k), repeat=d):
            if any(np.isneginf(s[i, r]) for i, r in enumerate(path)):
                continue
            r = path[-1]
            if r == 0:
                base = scores[path[:-1]] if d > 1 else 0.0
                scores[path] = base + s[d - 1, 0] if d > 1 else s[0, 0]
            else:
                scores[path] = (scores[path[:-1] + (r - 1,)] - s[d - 1, r - 1]) + s[d - 1, r]
    order = sorted(scores, key=lambda p: (-scores[p], p))
    return order[: max(budget, 0)]


def tree_paths(tree: R.Tree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(tree.num_nodes):
        paths.append(paths[int(tree.parents[i + 1])] + (int(tree.ranks[i]),))
    return paths[1:]


def sorted_logprobs(draw_values: np.ndarray) -> np.ndarray:
    return -np.sort(np.abs(draw_values), axis=1)


@st.composite
def tree_case(draw, dyadic: bool):
    depth_count = draw(st.integers(0, 4))
    k = draw(st.integers(1, 3))
    if dyadic:  # multiples of 1/4 in [-2, 0]: float64 sums are exact and ties are everywhere
        vals = draw(st.lists(st.integers(0, 8), min_size=depth_count * k, max_size=depth_count * k))
        lp = -np.sort(np.array(vals, dtype=np.float64).reshape(depth_count, k) / 4, axis=1)
    else:
        vals = draw(
            st.lists(st.floats(0.0, 6.0, width=32), min_size=depth_count * k, max_size=depth_count * k)
        )
        lp = -np.sort(np.array(vals, dtype=np.float64).reshape(depth_count, k), axis=1)
    budget = draw(st.integers(0, 40))
    return lp.astype(np.float32).reshape(depth_count, k), budget


def check_against_brute_force(lp: np.ndarray, budget: int) -> None:
    depth_count, k = lp.shape
    ids = np.arange(depth_count * k, dtype=np.int64).reshape(depth_count, k)[:, ::-1].copy() + 7
    tree = R.build_tree(lp, ids, budget)
    expected = brute_force_order(lp, budget)
    assert tree_paths(tree) == expected
    n = tree.num_nodes
    assert tree.parents.shape == (n + 1,) and tree.parents[0] == -1
    for i in range(1, n + 1):
        p = int(tree.parents[i])
        assert p < i
        assert tree.depths[i - 1] == (tree.depths[p - 1] + 1 if p > 0 else 1)
        assert tree.tokens[i - 1] == ids[tree.depths[i - 1] - 1, tree.ranks[i - 1]]


@settings(max_examples=300, deadline=None)
@given(tree_case(dyadic=True))
def test_tree_equals_brute_force_with_ties(case):
    check_against_brute_force(*case)


@settings(max_examples=300, deadline=None)
@given(tree_case(dyadic=False))
def test_tree_equals_brute_force_random(case):
    check_against_brute_force(*case)


def test_ties_go_to_the_lexicographically_smaller_rank_tuple():
    # every log-prob equal: all prefixes tie, so pop order is the lexicographic order of rank tuples
    lp = np.full((3, 2), -1.0, dtype=np.float32)
    ids = np.array([[10, 11], [20, 21], [30, 31]])
    tree = R.build_tree(lp, ids, 5)
    # (0,) (1,) are depth 1 score -1; (0,0) etc. score -2: so (0,), (1,), (0,0), (0,1), (1,0)
    assert tree_paths(tree) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    # FIFO tie-breaking would also give this; a case where it differs: equal scores across depths
    lp = np.array([[0.0, -1.0], [-1.0, -1.0]], dtype=np.float32)
    tree = R.build_tree(lp, ids[:2], 3)
    # (0,) score 0; then (1,) score -1 and (0,0) score -1, (0,1) score -1 tie: (0,0) < (0,1) < (1,)
    assert tree_paths(tree) == [(0,), (0, 0), (0, 1)]


def test_sibling_scores_are_incremental_not_parent_plus_logprob():
    # Log-probs mixing magnitudes 2**30 apart make float64 path sums round, so the contract's incremental
    # sibling score `(score - S[d][r]) + S[d][r+1]` and a plain `parent + S[d][r+1]` can differ in the last
    # bit and reorder near-tied nodes. Search (fixed seed) for such inputs; the reference must follow the
    # contract (the brute force) in each of them.
    pool = np.array(
        [-(1 + 2**-23), -1.0, -(1 + 2**-22), -(2.0**30), -(2.0**30 + 64), -(2.0**30 + 128), -3 * 2.0**-24,
         -0.5, -(0.5 + 2**-24), -(2.0**29 + 32)],
        dtype=np.float32,
    )
    rng = np.random.default_rng(1234)
    disagreements = 0
    ids = np.arange(6).reshape(3, 2)
    for _ in range(2000):
        lp = -np.sort(-rng.choice(pool, size=(3, 2)), axis=1)
        incremental = brute_force_order(lp, 14)
        every = brute_force_order(lp, 100)
        s = lp.astype(np.float64)
        direct = {p: sum((s[d, r] for d, r in enumerate(p)), 0.0) for p in every}
        if sorted(every, key=lambda p: (-direct[p], p))[:14] != incremental:
            disagreements += 1
            assert tree_paths(R.build_tree(lp, ids, 14)) == incremental
    assert disagreements > 0, "the search found no case where the two sibling formulas order nodes differently"


@pytest.mark.parametrize("budget", [0, -3])
def test_budget_zero_or_negative_is_root_only(budget):
    lp, ids = R.topk_logprobs(np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32), 4)
    tree = R.build_tree(lp, ids, budget)
    assert tree.num_nodes == 0 and tree.parents.tolist() == [-1]


def test_budget_one_depth_zero_and_beyond_reachable():
    rng = np.random.default_rng(1)
    lp, ids = R.topk_logprobs(rng.normal(size=(3, 5)).astype(np.float32), 5)
    one = R.build_tree(lp, ids, 1)
    assert one.depths.tolist() == [1] and one.ranks.tolist() == [0] and one.tokens[0] == ids[0, 0]
    assert R.build_tree(lp[:0], ids[:0], 10).num_nodes == 0  # L = 0
    full = R.build_tree(lp, ids, 10_000)  # more than every reachable prefix: 5 + 25 + 125
    assert full.num_nodes == 155


def test_budget_equal_to_depth_is_not_necessarily_a_chain():
    lp = np.array([[-0.1, -0.2], [-5.0, -6.0], [-5.0, -6.0]], dtype=np.float32)
    ids = np.arange(6).reshape(3, 2)
    tree = R.build_tree(lp, ids, 3)
    assert tree.depths.tolist() == [1, 1, 2]  # the depth-1 sibling beats the depth-2 child


def test_budget_above_vocab_gives_k_equal_vocab():
    logits = np.random.default_rng(2).normal(size=(2, 6)).astype(np.float32)
    lp, ids = R.topk_logprobs(logits, 100)
    assert lp.shape == (2, 6) and sorted(ids[0].tolist()) == list(range(6))


def test_neg_inf_logprobs_never_become_nodes():
    lp = np.array([[-0.5, -1.0, -np.inf], [-np.inf, -np.inf, -np.inf]], dtype=np.float32)
    ids = np.arange(6).reshape(2, 3)
    tree = R.build_tree(lp, ids, 10)
    assert tree.ranks.tolist() == [0, 1] and tree.depths.tolist() == [1, 1]


@pytest.mark.parametrize(
    "lp, ids, match",
    [
        (np.array([[-1.0, np.nan]], np.float32), np.array([[1, 2]]), "NaN"),
        (np.array([[np.inf, -1.0]], np.float32), np.array([[1, 2]]), r"\+inf"),
        (np.array([[-2.0, -1.0]], np.float32), np.array([[1, 2]]), "descending"),
        (np.array([[-1.0, -2.0]], np.float32), np.array([[1, 2, 3]]), "same shape"),
        (np.array([-1.0, -2.0], np.float32), np.array([1, 2]), r"\[L, K\]"),
        (np.zeros((2, 0), np.float32), np.zeros((2, 0), np.int64), "K=0"),
        (np.array([[-1.0, -2.0]], np.float32), np.array([[1, -2]]), "negative"),
    ],
)
def test_build_tree_rejects_bad_input(lp, ids, match):
    with pytest.raises(ValueError, match=match):
        R.build_tree(lp, ids, 4)


def test_build_tree_rejects_bad_types():
    with pytest.raises(TypeError, match="budget"):
        R.build_tree(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int64), 2.5)
    with pytest.raises(TypeError, match="token_ids"):
        R.build_tree(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), 2)


# ------------------------------------------------------------------------------------------------
# top-K + logsumexp
# ------------------------------------------------------------------------------------------------


def test_topk_matches_float64_and_lower_id_wins_ties():
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(2, 5, 300)) * 4) / 4  # many exact ties
    logits = logits.astype(np.float32)
    logits[0, 0, 17] = logits[0, 0, 3] = -0.0
    lp, ids = R.topk_logprobs(logits, 40)
    for b in range(2):
        for d in range(5):
            row = logits[b, d].astype(np.float64)
            order = sorted(range(300), key=lambda j: (-row[j], j))[:40]
            assert ids[b, d].tolist() == order
            lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
            np.testing.assert_allclose(lp[b, d], row[order] - lse, rtol=0, atol=1e-6)
    assert lp.dtype == np.float32 and ids.dtype == np.int64


def test_topk_rejects_nan_posinf_all_neginf_and_empty():
    with pytest.raises(ValueError, match="NaN"):
        R.topk_logprobs(np.array([[0.0, np.nan]], np.float32), 1)
    with pytest.raises(ValueError, match=r"\+inf"):
        R.topk_logprobs(np.array([[0.0, np.inf]], np.float32), 1)
    with pytest.raises(ValueError, match="entirely -inf"):
        R.topk_logprobs(np.array([[0.0, 1.0], [-np.inf, -np.inf]], np.float32), 1)
    with pytest.raises(ValueError, match="non-empty"):
        R.topk_logprobs(np.zeros((2, 0), np.float32), 1)
    with pytest.raises(ValueError, match="k must be"):
        R.topk_logprobs(np.zeros((2, 3), np.float32), 0)
    lp, ids = R.topk_logprobs(np.array([[0.0, -np.inf, 1.0]], np.float32), 3)
    assert ids.tolist() == [[2, 0, 1]] and np.isneginf(lp[0, 2])


@pytest.mark.parametrize("bounds", [[0, 100, 257, 300], [0, 1, 2, 300], [0, 150, 300]])
def test_sharded_topk_merges_to_the_unsharded_result(bounds):
    rng = np.random.default_rng(4)
    logits = (np.round(rng.normal(size=(3, 300)) * 8) / 8).astype(np.float32)
    logits[1, 250:] = -np.inf  # a shard can be entirely -inf on a row
    lp, ids = R.topk_logprobs(logits, 64)
    parts = [R.shard_topk_partials(logits[:, a:b], 64, a) for a, b in zip(bounds[:-1], bounds[1:])]
    ks = max(p[0].shape[-1] for p in parts)
    pad = [
        (
            np.pad(p[0], ((0, 0), (0, ks - p[0].shape[-1])), constant_values=-np.inf),
            np.pad(p[1], ((0, 0), (0, ks - p[1].shape[-1])), constant_values=0),
            p[2],
        )
        for p in parts
    ]
    mlp, mids = R.merge_topk_partials(*(np.stack(x) for x in zip(*pad)), 64)
    assert mids.tolist() == ids.tolist()
    np.testing.assert_allclose(mlp, lp, rtol=0, atol=2e-6)


# ------------------------------------------------------------------------------------------------
# verify inputs
# ------------------------------------------------------------------------------------------------


def small_batch(seed=5, bs=3, budget=9, depth_count=4, vocab=20):
    rng = np.random.default_rng(seed)
    lp, ids = R.topk_logprobs(rng.normal(size=(bs, depth_count, vocab)).astype(np.float32) * 2, budget)
    return R.build_trees(lp, ids, budget, rng.integers(0, vocab, size=bs))


def test_verify_inputs_mask_positions_links_for_mixed_prefixes():
    trees = small_batch()
    seq_lens = np.array([5, 0, 12])
    vi = R.verify_inputs(trees, seq_lens)
    bs, width = trees.tokens.shape
    offset = 0
    for b in range(bs):
        p = int(seq_lens[b])
        block = vi.full_mask[offset : offset + width * (p + width)].reshape(width, p + width)
        offset += width * (p + width)
        assert block[:, :p].all()
        for i in range(width):
            # ancestor-or-self by walking parents, independently of the implementation
            expect = np.zeros(width, bool)
            j = i
            while j >= 0:
                expect[j] = True
                j = int(trees.parents[b, j]) if j > 0 and j <= trees.num_nodes[b] else -1
            assert block[i, p:].tolist() == expect.tolist()
        assert (vi.positions[b * width : (b + 1) * width] == p + trees.depths[b]).all()
    assert offset == vi.full_mask.size == seq_lens.sum() * width + width * width * bs
    unpacked = R.ancestor_bits_to_bool(vi.ancestor_bits, width)
    for b in range(bs):
        p = int(seq_lens[b])
        start = int(sum(width * (int(q) + width) for q in seq_lens[:b]))
        assert (unpacked[b] == vi.full_mask[start : start + width * (p + width)].reshape(width, -1)[:, p:]).all()
    # links: children of each node in pop order
    for b in range(bs):
        n = int(trees.num_nodes[b])
        for v in range(n + 1):
            kids = [i for i in range(1, n + 1) if trees.parents[b, i] == v]
            chain = []
            c = vi.retrieve_next_token[b, v]
            while c != -1:
                chain.append(int(c))
                c = vi.retrieve_next_sibling[b, c]
            assert chain == kids
    assert (vi.retrieve_index == np.arange(bs * width).reshape(bs, width)).all()
    assert (vi.input_ids.reshape(bs, width) == trees.tokens).all()


def test_chain_tree_mask_is_causal_and_padding_is_inert():
    lp = np.array([[-0.01, -9.0]] * 4, np.float32)  # the chain dominates every sibling
    ids = np.arange(8).reshape(4, 2)
    trees = R.build_trees(lp[None], ids[None], 4, np.array([99]))
    assert trees.depths[0].tolist() == [0, 1, 2, 3, 4]
    vi = R.verify_inputs(trees, np.array([3]))
    mask = vi.full_mask.reshape(5, 8)[:, 3:]
    assert (mask == np.tril(np.ones((5, 5), bool))).all()
    # budget beyond reachable: padding rows see only themselves, are unlinked and sit at the root position
    lp1 = np.array([[-0.1]], np.float32)
    trees = R.build_trees(lp1[None], np.array([[[4]]]), 3, np.array([7]))
    assert trees.num_nodes.tolist() == [1]
    vi = R.verify_inputs(trees, np.array([2]))
    anc = R.ancestor_bits_to_bool(vi.ancestor_bits, 4)[0]
    assert anc[2].tolist() == [False, False, True, False] and anc[3].tolist() == [False, False, False, True]
    assert vi.retrieve_next_token[0].tolist() == [1, -1, -1, -1]
    assert vi.retrieve_next_sibling[0].tolist() == [-1, -1, -1, -1]
    assert vi.positions.tolist() == [2, 3, 2, 2]


def test_ancestor_bits_cross_word_boundaries():
    lp = np.array([[-0.001, -9.0]] * 31 + [[-0.001, -9.0]] * 9, np.float32)[:31]
    ids = np.arange(62).reshape(31, 2)
    trees = R.build_trees(lp[None], ids[None], 40, np.array([1]))
    vi = R.verify_inputs(trees, np.array([0]))
    assert vi.ancestor_bits.shape == (1, 41, 2)
    unpacked = R.ancestor_bits_to_bool(vi.ancestor_bits, 41)[0]
    for i in range(41):
        expect = np.zeros(41, bool)
        j = i
        while j >= 0:
            expect[j] = True
            j = int(trees.parents[0, j]) if 0 < j <= trees.num_nodes[0] else -1
        assert unpacked[i].tolist() == expect.tolist()


# ------------------------------------------------------------------------------------------------
# accept
# ------------------------------------------------------------------------------------------------


def hand_tree():
    """root 0 -> {1: tok 10, 2: tok 11}; 1 -> {3: tok 20}; 2 -> {4: tok 21}; 3 -> {5: tok 30}."""
    tokens = np.array([[99, 10, 11, 20, 21, 30, 0]])
    parents = np.array([[-1, 0, 0, 1, 2, 3, -1]])
    depths = np.array([[0, 1, 1, 2, 2, 3, 0]])
    return R.TreeBatch(tokens=tokens, depths=depths, parents=parents, num_nodes=np.array([5]))


@pytest.mark.parametrize(
    "targets, path, bonus",
    [
        ({0: 10, 1: 20, 3: 30, 5: 77}, [0, 1, 3, 5], 77),  # full accept to the deepest depth
        ({0: 10, 1: 55}, [0, 1], 55),  # partial
        ({0: 42}, [0], 42),  # immediate reject
        ({0: 11, 2: 21, 4: 8}, [0, 2, 4], 8),  # through a non-first sibling
    ],
)
def test_accept_greedy_walks(targets, path, bonus):
    trees = hand_tree()
    tgt = np.full((1, 7), 3, dtype=np.int64)
    for node, tok in targets.items():
        tgt[0, node] = tok
    res = R.accept_greedy(trees, tgt, max_depth=3)
    assert res.accepted[0, : len(path)].tolist() == path and (res.accepted[0, len(path) :] == -1).all()
    assert res.accept_lens.tolist() == [len(path)] and res.bonus.tolist() == [bonus]
    assert res.committed[0, : len(path)].tolist() == [int(trees.tokens[0, n]) for n in path[1:]] + [bonus]
    # the same from logits (argmax ties to the lower id: 3 appears twice as the max)
    logits = np.zeros((1, 7, 100), np.float32)
    logits[0, np.arange(7), tgt[0]] = 5.0
    logits[0, :, 90] = 5.0
    assert R.accept_greedy(trees, logits, max_depth=3).accepted.tolist() == res.accepted.tolist()


def test_padding_rows_are_never_accepted():
    trees = hand_tree()
    tgt = np.zeros((1, 7), dtype=np.int64)  # node 6 is padding with token 0
    assert R.accept_greedy(trees, tgt).accept_lens.tolist() == [1]


def test_sampled_walk_is_reproducible_and_first_token_matches_softmax():
    trees = hand_tree()
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(1, 7, 12)).astype(np.float32)
    a = R.accept_sampled(trees, logits, 0.7, np.random.default_rng(42))
    b = R.accept_sampled(trees, logits, 0.7, np.random.default_rng(42))
    assert (a.accepted == b.accepted).all() and (a.committed == b.committed).all()
    # frequency of the first committed token == softmax(logits[root] / T), whichever child it matched
    tree = R.TreeBatch(
        tokens=np.array([[99, 3, 5, 0]]), depths=np.array([[0, 1, 1, 0]]), parents=np.array([[-1, 0, 0, -1]]),
        num_nodes=np.array([2]),
    )
    lg = rng.normal(size=(1, 4, 8)).astype(np.float32)
    lg[0, 0, 3] += 1.5
    t = 0.8
    gen = np.random.default_rng(7)
    draws = 6000
    firsts = np.array(
        [R.accept_sampled(tree, np.repeat(lg, 1, axis=0), t, gen).committed[0, 0] for _ in range(draws)]
    )
    p = np.exp(lg[0, 0].astype(np.float64) / t)
    p /= p.sum()
    freq = np.bincount(firsts, minlength=8) / draws
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() * (1 - p.max()) / draws) + 1e-3


def test_sample_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        R.sample_node_tokens(np.zeros((1, 2, 3), np.float32), 0.0, np.random.default_rng(0))


# ------------------------------------------------------------------------------------------------
# commit
# ------------------------------------------------------------------------------------------------


def test_commit_plan_with_overlapping_sources_and_destinations():
    accepted = np.array([[0, 2, 3, -1], [0, 1, -1, -1]])
    accept_lens = np.array([3, 2])
    verify_slots = np.array([[40, 41, 42, 43, 44], [7, 3, 9, 1, 2]])
    plan = R.commit_plan(accepted, accept_lens, verify_slots)
    assert plan.src_slots.tolist() == [[40, 42, 43, -1], [7, 3, -1, -1]]
    assert plan.dst_slots.tolist() == [[40, 41, 42, -1], [7, 3, -1, -1]]
    assert plan.hidden_rows.tolist() == [[0, 2, 3, -1], [5, 6, -1, -1]]
    assert plan.moves() == [[(42, 41), (43, 42)], []]
    kv = np.arange(2 * 50 * 3, dtype=np.float32).reshape(2, 50, 3)  # [layers, slots, D]
    before = kv.copy()
    R.compact_kv(kv, plan)
    assert (kv[:, 41] == before[:, 42]).all() and (kv[:, 42] == before[:, 43]).all()  # not before[:, 42] twice
    untouched = [s for s in range(50) if s not in (41, 42)]
    assert (kv[:, untouched] == before[:, untouched]).all()
    hidden = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    packed = R.gather_hidden(hidden, plan)
    assert packed[0, :3].tolist() == hidden[[0, 2, 3]].tolist()  # the accepted rows, not the first three
    assert packed[1, :2].tolist() == hidden[[5, 6]].tolist()


@pytest.mark.parametrize(
    "accepted, lens, match",
    [
        ([[1, 2, -1]], [2], "start at 0"),
        ([[0, 2, 2]], [3], "increase"),
        ([[0, 1, 2]], [4], "outside"),
        ([[0, 9, -1]], [2], "below"),
    ],
)
def test_commit_plan_rejects_bad_paths(accepted, lens, match):
    with pytest.raises(ValueError, match=match):
        R.commit_plan(np.array(accepted), np.array(lens), np.arange(5)[None])


def test_compact_kv_rejects_out_of_range_slots():
    plan = R.commit_plan(np.array([[0, 1]]), np.array([2]), np.array([[3, 60]]))
    with pytest.raises(ValueError, match="outside"):
        R.compact_kv(np.zeros((50, 2)), plan)


def test_compact_kv_rejects_negative_slots_and_mismatched_padding():
    plan = R.CommitPlan(
        src_slots=np.array([[0, -5]]), dst_slots=np.array([[0, 1]]), hidden_rows=np.array([[0, 1]]),
        accept_lens=np.array([2]),
    )
    with pytest.raises(ValueError, match="outside"):
        R.compact_kv(np.zeros((50, 2)), plan)
    plan = R.CommitPlan(
        src_slots=np.array([[0, -1]]), dst_slots=np.array([[0, 1]]), hidden_rows=np.array([[0, -1]]),
        accept_lens=np.array([1]),
    )
    with pytest.raises(ValueError, match="padding"):
        R.compact_kv(np.zeros((50, 2)), plan)


def test_malformed_parents_are_rejected():
    trees = hand_tree()
    bad = R.TreeBatch(tokens=trees.tokens, depths=trees.depths, parents=trees.parents.copy(), num_nodes=trees.num_nodes)
    bad.parents[0, 3] = 4  # a parent after its child
    with pytest.raises(ValueError, match=r"parents\[0, 3\] = 4 must lie in \[0, 3\)"):
        R.accept_greedy(bad, np.zeros((1, 7), np.int64))
    with pytest.raises(ValueError, match="parents"):
        R.verify_inputs(bad, np.array([4]))


def _filter_brute(p, top_k, top_p):
    """Independent twin of SGLang's top-k / top-p: walk the tokens from most to least likely (ties lower id
    first) in plain Python, stopping at k tokens or once the mass already taken exceeds top_p."""
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    total, taken, kept = sum(p), 0.0, []
    for rank, i in enumerate(order):
        if rank >= top_k or taken > top_p * total:
            break
        kept.append(i)
        taken += p[i]
    out = [0.0] * len(p)
    mass = sum(p[i] for i in kept)
    for i in kept:
        out[i] = p[i] / mass
    return out


@pytest.mark.parametrize("seed", range(6))
def test_filter_top_k_top_p_matches_an_independent_walk_including_ties(seed):
    rng = np.random.default_rng(seed)
    v = int(rng.integers(2, 40))
    p = np.round(rng.random(v), 1) + 1e-3 * (rng.random(v) < 0.2)  # many exact ties
    for top_k, top_p in [(1, 1.0), (3, 1.0), (v + 5, 0.5), (4, 0.3), (v, 1e-9), (2, 0.999)]:
        got = R.filter_top_k_top_p(p, top_k, top_p)
        np.testing.assert_allclose(got, _filter_brute(list(p), top_k, top_p), rtol=0, atol=1e-12)


def test_sample_node_tokens_with_filters():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 5, 30)).astype(np.float32)
    top1 = R.sample_node_tokens(logits, 1.0, np.random.default_rng(1), top_k=1)
    assert np.array_equal(top1, logits.argmax(-1))
    tiny_p = R.sample_node_tokens(logits, 1.0, np.random.default_rng(1), top_p=1e-6)
    assert np.array_equal(tiny_p, logits.argmax(-1))
    # no filter: exactly the old draw
    assert np.array_equal(R.sample_node_tokens(logits, 0.7, np.random.default_rng(5)),
                          R.sample_node_tokens(logits, 0.7, np.random.default_rng(5), top_k=None, top_p=1.0))
    # top_k 3: only the three likeliest tokens of each row are ever drawn, with their renormalised odds
    row = logits[0, 0].astype(np.float64)
    draws = np.array([R.sample_node_tokens(logits[:1, :1], 1.0, np.random.default_rng(s), top_k=3)[0, 0]
                      for s in range(3000)])
    top3 = np.argsort(-row)[:3]
    assert set(np.unique(draws)) <= set(top3.tolist())
    expect = np.exp(row[top3] - row.max())
    expect /= expect.sum()
    freq = np.array([(draws == t).mean() for t in top3])
    assert np.abs(freq - expect).max() < 0.04  # 3000 draws: 4 sigma of the largest binomial error


# ------------------------------------------------------------------------------------------------
# min-p (with top-k / top-p): kept sets against SGLang's own sampler and an independent torch twin
# ------------------------------------------------------------------------------------------------


def _kept(q) -> set[int]:
    return set(np.flatnonzero(np.asarray(q) > 0).tolist())


def _sglang_kept_sets(p, top_ks, top_ps, min_ps) -> list[set[int]]:
    """The kept set of each row as SGLang's own torch sampler computes it (``return_filtered_probs``: its
    masked sorted probabilities and their token ids), in float64."""
    torch = pytest.importorskip("torch")
    sampler = pytest.importorskip("sglang.srt.layers.sampler")
    probs = torch.from_numpy(np.array(p, dtype=np.float64))
    _, probs_sort, probs_idx, _ = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), torch.tensor(top_ks), torch.tensor(top_ps, dtype=torch.float64),
        torch.tensor(min_ps, dtype=torch.float64), True, None, None, return_filtered_probs=True)
    return [set(probs_idx[r][probs_sort[r] > 0].tolist()) for r in range(probs.shape[0])]


def _torch_rule_kept(p, top_k, top_p, min_p) -> set[int]:
    """SGLang's masking, written out in torch from its rules with a stable sort (ties: lower id first):
    zero rank >= top_k, zero where the mass before the rank exceeds top_p, zero below min_p * max."""
    torch = pytest.importorskip("torch")
    probs = torch.from_numpy(np.array(p, dtype=np.float64))
    s, idx = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(s, 0) - s
    keep = (torch.arange(s.numel()) < top_k) & ~(before > top_p) & ~(s < s[0] * min_p)
    return set(idx[keep].tolist())


def _clear_of_top_p(p, top_p) -> bool:
    """No exclusive prefix mass within 1e-9 of top_p (numpy's and torch's float64 cumsums may differ in the
    last bit there; the min-p boundary cases below are exact and need no such margin)."""
    s = np.sort(p)[::-1]
    return bool(np.all(np.abs(np.cumsum(s) - s - top_p) > 1e-9))


@pytest.mark.parametrize("seed", range(8))
def test_min_p_kept_sets_equal_sglang_samplers(seed):
    """Random rows without ties: the reference's kept set (top-k, top-p, min-p and their combinations) equals
    the set SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` keeps, exactly; min_p 0 (off), 1 (the
    top token only), tiny (1e-300: nothing cut), random, and exactly at / one float either side of a token's
    ratio to the max (the rule is ``>=``: a token whose probability equals min_p * max is kept)."""
    rng = np.random.default_rng(100 + seed)
    v = int(rng.integers(2, 60))
    rows, cases = [], []
    while len(rows) < 40:
        p = rng.random(v) ** rng.uniform(1, 6)
        p /= p.sum()
        if len(set(p.tolist())) < v:
            continue
        pmax = p.max()
        j = int(rng.integers(0, v))
        at = p[j] / pmax
        ratio_cases = [0.0, 1.0, 1e-300, float(rng.random()), float(rng.random() ** 3)]
        for mp in ratio_cases + [at, np.nextafter(at, 0), np.nextafter(at, 2)]:
            top_k = int(rng.choice([v, 1, int(rng.integers(1, v + 1))]))
            top_p = float(rng.choice([1.0, rng.uniform(0.05, 1.0)]))
            if not _clear_of_top_p(p, top_p):
                continue
            rows.append(p)
            cases.append((top_k, top_p, min(float(mp), 1.0)))
    want = _sglang_kept_sets(rows, [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases])
    for p, (top_k, top_p, mp), w in zip(rows, cases, want):
        got = _kept(R.filter_top_k_top_p(p, top_k, top_p, mp))
        assert got == w, (top_k, top_p, mp)
        assert got == _torch_rule_kept(p, top_k, top_p, mp)
    # exactly on the boundary: 0.4 * 0.5 == 0.2 in float64, so the two 0.2 tokens are kept (the rule is >=),
    # and one float more of min_p drops them
    p = np.array([0.1, 0.2, 0.4, 0.2, 0.1])
    assert 0.4 * 0.5 == 0.2
    up = np.nextafter(0.5, 1.0)
    assert _kept(R.filter_top_k_top_p(p, None, None, 0.5)) == {1, 2, 3} == _sglang_kept_sets([p], [5], [1.0], [0.5])[0]
    assert _kept(R.filter_top_k_top_p(p, None, None, up)) == {2} == _sglang_kept_sets([p], [5], [1.0], [up])[0]


@pytest.mark.parametrize("seed", range(6))
def test_min_p_with_ties_matches_the_torch_rule(seed):
    """Tie-heavy rows (SGLang's unstable sort may order ties either way; the contract is lower id first):
    the reference's kept sets equal the torch twin's with a stable sort, for min-p alone and combined."""
    rng = np.random.default_rng(200 + seed)
    v = int(rng.integers(2, 40))
    p = np.round(rng.random(v), 1) + 1e-3 * (rng.random(v) < 0.2)
    p[rng.integers(0, v)] = p.max()  # at least one tie with the max
    p /= p.sum()
    for top_k in (v, 1, 3):
        for top_p in (1.0, 0.5, 1e-9):
            if not _clear_of_top_p(p, top_p):
                continue
            for mp in (0.0, 1.0, 0.5, 0.2, float(np.sort(p)[-3] / p.max())):
                got = _kept(R.filter_top_k_top_p(p, top_k, top_p, mp))
                assert got == _torch_rule_kept(p, top_k, top_p, mp), (top_k, top_p, mp)
    # min_p 1 keeps exactly the tokens tied with the max, whatever their ids
    assert _kept(R.filter_top_k_top_p(p, None, None, 1.0)) == set(np.flatnonzero(p == p.max()).tolist())
    # off: None, 0 and NaN leave the row as it is; above 1 counts as 1
    base = p / p.sum()  # the filter's own renormalisation of an unfiltered row
    for off in (None, 0.0, -0.5, float("nan")):
        np.testing.assert_array_equal(R.filter_top_k_top_p(p, None, None, off), base)
    np.testing.assert_array_equal(R.filter_top_k_top_p(p, None, None, 7.0), R.filter_top_k_top_p(p, None, None, 1.0))


def test_sampling_weights_min_p_is_the_logit_rule():
    """On logits, min-p keeps x_i iff exp((x_i - x_max) / T) >= min_p, i.e. (x_i - x_max) / T >= log(min_p):
    checked on random float32 rows against that log-space form (an independent evaluation; the inputs are
    asserted to stay > 1e-9 from the boundary, where the two float64 evaluations could round apart), with
    top-k / top-p on top; min_p 1 on a row without ties is the argmax."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        v = int(rng.integers(2, 200))
        x = (rng.normal(size=v) * rng.uniform(0.1, 8)).astype(np.float32)
        temp = float(np.float32(rng.uniform(0.2, 2.5)))
        mp = float(np.float32(rng.choice([rng.random(), rng.random() ** 4, 1.0, 1e-30])))
        d = (x.astype(np.float64) - x.max()) / temp
        margin = np.abs(d - np.log(mp))
        assert margin.min() > 1e-9 or mp == 1.0, "inputs too close to the boundary for this check"
        expect = set(np.flatnonzero(d >= np.log(mp)).tolist())
        w = R.sampling_weights(x[None, None], temp, min_p=mp)[0, 0]
        assert _kept(w) == expect
        np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
        top_k = int(rng.integers(1, v + 1))
        both = R.sampling_weights(x[None, None], temp, top_k=top_k, min_p=mp)[0, 0]
        order = np.lexsort((np.arange(v), -x))
        assert _kept(both) == expect & set(order[:top_k].tolist())
    x = rng.normal(size=(3, 4, 50)).astype(np.float32)
    assert np.array_equal(R.sample_node_tokens(x, 1.3, np.random.default_rng(2), min_p=1.0), x.argmax(-1))
    # min_p 0 is off: exactly the unfiltered draw
    assert np.array_equal(R.sample_node_tokens(x, 0.8, np.random.default_rng(4), min_p=0.0),
                          R.sample_node_tokens(x, 0.8, np.random.default_rng(4)))


def test_sample_node_tokens_with_min_p_draws_the_renormalised_kept_set():
    """min_p 0.2 at T 1 on a hand-made row: kept tokens are those within log(5) of the max; draws land only
    there, with the renormalised odds (3000 draws, 4 sigma)."""
    x = np.array([[[2.0, 0.0, 1.9, 0.5, 0.3, -3.0, 0.2, 0.45]]], dtype=np.float32)
    kept = [0, 2, 3, 7]  # exp(x - 2) >= 0.2  <=>  x >= 2 - log 5 = 0.3906
    draws = np.array([R.sample_node_tokens(x, 1.0, np.random.default_rng(s), min_p=0.2)[0, 0] for s in range(3000)])
    assert set(np.unique(draws).tolist()) == set(kept)
    expect = np.exp(x[0, 0, kept].astype(np.float64) - 2.0)
    expect /= expect.sum()
    freq = np.array([(draws == t).mean() for t in kept])
    assert np.abs(freq - expect).max() < 0.04


# ------------------------------------------------------------------------------------------------
# the package and the seeded-sampling rule
# ------------------------------------------------------------------------------------------------


def test_every_public_name_is_importable_from_the_package_and_max_budget_is_the_states():
    from sglang_kdtree import state

    assert all(hasattr(R, name) for name in R.__all__)
    assert R.MAX_BUDGET is state.MAX_BUDGET


def test_position_uniform_is_a_pure_function_of_seed_and_position():
    u = [R.position_uniform(7, p) for p in range(200)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) == 200
    assert u == [R.position_uniform(7, p) for p in range(200)]
    assert R.position_uniform(8, 5) != u[5]
    # the seed counts modulo 2^48 (a negative int64 seed is its two's complement's low 48 bits)
    assert R.position_uniform(7 + (1 << 48), 5) == u[5]
    assert R.position_uniform(-1, 5) == R.position_uniform((1 << 48) - 1, 5)


def test_position_uniforms_draw_each_node_by_inverse_cdf_at_its_position():
    """``sample_node_tokens`` with a request's ``PositionUniforms`` draws node i's token with the uniform of
    position ``positions[i]``: the same token for the same (seed, position), whichever node asks."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 6, 20)).astype(np.float32)
    positions = np.array([[10, 11, 11, 12, 12, 13]])
    got = R.sample_node_tokens(x, 0.9, R.PositionUniforms(5, positions))
    for i, pos in enumerate(positions[0]):
        cdf = np.cumsum(R.sampling_weights(x[0, i], 0.9))
        assert got[0, i] == min(int(np.searchsorted(cdf, R.position_uniform(5, pos) * cdf[-1], side="right")), 19)
    same_row = np.repeat(x[:, :1], 3, axis=1)
    assert len(set(R.sample_node_tokens(same_row, 0.9, R.PositionUniforms(5, [[40, 40, 40]]))[0].tolist())) == 1
    with pytest.raises(ValueError, match=r"positions of shape \(1, 2\).*\(1, 6\)"):
        R.sample_node_tokens(x, 0.9, R.PositionUniforms(5, [[1, 2]]))
