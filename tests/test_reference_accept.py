"""The DDTree reference's accept walk (greedy and sampled) and commit plan (KV compaction, hidden rows)
against hand-built trees."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kdtree import reference as R


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
