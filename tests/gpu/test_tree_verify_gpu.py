"""GPU verify inputs (FULL_MASK, positions, retrieve links, ancestor bits) against the numpy reference, on
poisoned buffers with a guard past the batch: separate launches, malformed trees, and the fused
tree + verify launch. No timing here."""

import dataclasses

import numpy as np
import pytest

from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tree_gpu_checks import (  # noqa: E402
    MASK_POISON,
    VERIFY_POISON,
    compare_full,
    gpu_modules,
    poison_verify_out,
    sorted_rows,
)


def _assert_untouched_past(out, mask_numel, rows):
    """Nothing written past the batch: the FULL_MASK bytes after ``mask_numel`` and the rows after ``rows``."""
    assert bool((out.full_mask.view(torch.uint8)[mask_numel:] == MASK_POISON).all()), "wrote past the FULL_MASK"
    for name in ("input_ids", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert bool((getattr(out, name)[rows:] == VERIFY_POISON).all()), f"wrote {name} past the batch"
    words = out.ancestor_bits.numel() // out.input_ids.numel()
    assert bool((out.ancestor_bits[rows * words:] == VERIFY_POISON).all()), "wrote ancestor_bits past the batch"


def _verify_case(rng, bs, budget, max_seq, depth=15):
    """GPU verify inputs of GPU-built trees (outputs poisoned first, a poisoned guard past the mask) against the
    reference's on the reference's trees."""
    _, tree, verify = gpu_modules()
    lp, ids = sorted_rows(rng, bs, depth, min(max(budget, 1), 64), tie_heavy=True)
    roots = rng.integers(0, 1000, size=bs).astype(np.int64)
    want_t = ref.build_trees(lp, ids, budget, roots)
    seq = rng.integers(0, max_seq, size=bs).astype(np.int64)
    seq[0] = 0
    gt = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                          torch.from_numpy(roots).cuda(), check=True)
    mask_numel = verify.full_mask_numel(int(seq.sum()), budget + 1, bs)
    out = verify.alloc_verify_inputs(bs + 1, budget + 1, mask_numel + 4096, "cuda")
    poison_verify_out(out)  # and the guard rows / bytes past what this batch may write
    got = verify.verify_inputs(gt, torch.from_numpy(seq).cuda(), seq_lens_sum=int(seq.sum()), out=out,
                               check=True)
    _assert_verify_exact(got, ref.verify_inputs(want_t, seq), out, mask_numel, bs * (budget + 1))


def _assert_verify_exact(got, want, out, mask_numel, rows, want_mask=None):
    """GPU verify inputs ``got`` (written into the poisoned ``out``) equal the reference's ``want`` field for field;
    the mask compared as bytes, so an unwritten byte (still the poison, neither 0 nor 1) fails (``want_mask``: other
    expected bytes); nothing written past the batch's ``rows`` rows and ``mask_numel`` mask bytes."""
    for f in ("input_ids", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        np.testing.assert_array_equal(getattr(got, f).cpu().numpy().reshape(getattr(want, f).shape),
                                      getattr(want, f), err_msg=f)
    np.testing.assert_array_equal(got.ancestor_bits.cpu().numpy().view(np.uint32), want.ancestor_bits)
    want_mask = want.full_mask.astype(np.uint8) if want_mask is None else want_mask
    np.testing.assert_array_equal(got.full_mask.view(torch.uint8).cpu().numpy().reshape(want_mask.shape), want_mask,
                                  err_msg="full_mask")
    _assert_untouched_past(out, mask_numel, rows)


def test_verify_inputs_exact_mixed_prefixes():
    rng = np.random.default_rng(5)
    for budget in (1, 16, 64, 100, 511):
        _verify_case(rng, 6, budget, 300)


@pytest.mark.parametrize("bs,budget,max_seq", [(40, 64, 2000), (130, 16, 500), (3, 1024, 700), (1, 0, 5)])
def test_verify_inputs_exact_block_geometries(bs, budget, max_seq):
    """Batches where one block owns several rows of a request (bs * N > 1024), the widest tree (N 1025, 33
    ancestor words), and the root-only tree."""
    _verify_case(np.random.default_rng(bs * 1000 + budget), bs, budget, max_seq)


@pytest.mark.parametrize("flaw", ["parent_not_before", "negative_parent", "num_nodes_high", "num_nodes_negative",
                                  "chain_too_deep"])
def test_verify_inputs_flags_malformed_trees(flaw):
    """A malformed tree sets ERR_BAD_TREE (raised by check=True) and nothing is written past the batch."""
    _, _, verify = gpu_modules()
    bs, width = 3, 40
    parents = np.zeros((bs, width), dtype=np.int64)  # well formed: a star under the root
    parents[:, 0] = -1
    num_nodes = np.full(bs, width - 1, dtype=np.int64)
    if flaw == "parent_not_before":
        parents[1, 5] = 7
    elif flaw == "negative_parent":
        parents[2, 9] = -3
    elif flaw == "num_nodes_high":
        num_nodes[0] = width
    elif flaw == "num_nodes_negative":
        num_nodes[1] = -1
    else:
        parents[1, 1:] = np.arange(width - 1)  # a chain: node i's parent is i - 1, depth 39 > 31
    gt = type("Trees", (), {})()  # what verify_inputs reads of a tree batch
    for name, arr in (("tokens", np.arange(bs * width, dtype=np.int64).reshape(bs, width)),
                      ("depths", np.zeros((bs, width), dtype=np.int64)), ("parents", parents),
                      ("num_nodes", num_nodes)):
        setattr(gt, name, torch.from_numpy(arr).cuda())
    seq = torch.tensor([3, 0, 17], dtype=torch.int64, device="cuda")
    mask_numel = verify.full_mask_numel(20, width, bs)
    out = verify.alloc_verify_inputs(bs + 1, width, mask_numel + 4096, "cuda")
    poison_verify_out(out)
    with pytest.raises(ValueError, match="malformed tree"):
        verify.verify_inputs(gt, seq, seq_lens_sum=20, out=out, check=True)
    _assert_untouched_past(out, mask_numel, bs * width)
    # the well-formed star alone raises nothing
    parents[:, 1:] = 0
    parents[:, 0] = -1
    gt.parents = torch.from_numpy(parents).cuda()
    gt.num_nodes = torch.full((bs,), width - 1, dtype=torch.int64, device="cuda")
    verify.verify_inputs(gt, seq, seq_lens_sum=20, out=out, check=True)


def _fused_case(rng, bs, budget, depth, k, seq, tie_heavy, fill_prefix=True):
    """``build_trees_verify`` (one launch up to budget 256) into poisoned tree and verify buffers (a poisoned guard
    past what the batch may write) against reference.verify_inputs of reference.build_trees, every output exact
    (the mask as bytes: an unwritten byte keeps the poison), and against ``build_trees`` + ``verify_inputs``."""
    _, tree, verify = gpu_modules()
    lp, ids = sorted_rows(rng, bs, depth, k, tie_heavy=tie_heavy)
    if k > 2 and bs > 1:
        lp[1, :, k // 2:] = -np.inf  # every row cut short
    roots = rng.integers(0, 1000, size=bs).astype(np.int64)
    width = max(budget, 0) + 1
    mask_numel = verify.full_mask_numel(int(seq.sum()), width, bs)
    out_v = verify.alloc_verify_inputs(bs + 1, width, mask_numel + 4096, "cuda")
    poison_verify_out(out_v)
    out_t = tree._alloc_tree(bs, width, "cuda")
    for t in (out_t.tokens, out_t.depths, out_t.parents, out_t.ranks, out_t.num_nodes):
        t.fill_(12345)
    out_t.scores.fill_(-7.25)
    g = [torch.from_numpy(a).cuda() for a in (lp, ids, roots, seq)]
    got_t, got_v = tree.build_trees_verify(g[0], g[1], budget, g[2], g[3], seq_lens_sum=int(seq.sum()), out=out_t,
                                           out_verify=out_v, fill_prefix=fill_prefix, check=True)
    compare_full(got_t, lp, ids, budget, roots)
    want = ref.verify_inputs(ref.build_trees(lp, ids, budget, roots), seq)
    want_mask = want.full_mask.astype(np.uint8)
    if not fill_prefix:  # the prefix columns untouched (the poison), the tree columns written
        at = 0
        for b in range(bs):
            rows = np.arange(width * (int(seq[b]) + width)).reshape(width, -1) + at
            want_mask[rows[:, :int(seq[b])]] = MASK_POISON
            at += rows.size
    _assert_verify_exact(got_v, want, out_v, mask_numel, bs * width, want_mask)
    # the two launches it replaces, on the same input: the same bytes everywhere
    two_t = tree.build_trees(g[0], g[1], budget, g[2], check=True)
    two_v = verify.verify_inputs(two_t, g[3], seq_lens_sum=int(seq.sum()), fill_prefix=fill_prefix, check=True)
    for f in dataclasses.fields(two_t):
        assert torch.equal(getattr(two_t, f.name), getattr(got_t, f.name)), f.name
    for f in ("input_ids", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling",
              "ancestor_bits"):
        assert torch.equal(getattr(two_v, f), getattr(got_v, f)), f
    if fill_prefix:
        assert torch.equal(two_v.full_mask, got_v.full_mask)


@pytest.mark.parametrize("budget", [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257])
def test_tree_verify_fused_exact(budget, tree_kernel):
    """The fused launch at budgets around each list kernel's limit and its ancestor-word boundaries (257, and every
    budget with the slot kernel forced: the two launches), mixed prefix lengths (0, odd: unaligned FULL_MASK rows),
    tie-heavy and spread inputs, L 1 / 15 / 31, K below and above the budget."""
    rng = np.random.default_rng(4000 + budget)
    for bs, depth, k in ((1, 15, 64), (5, 31, 33), (4, 1, 8), (3, 15, max(1, budget + 2))):
        for tie_heavy in (True, False):
            seq = rng.integers(0, 300, size=bs).astype(np.int64)
            seq[0] = 0
            if bs > 2:
                seq[2] = 37
            _fused_case(rng, bs, budget, depth, min(k, 1024), seq, tie_heavy)


@pytest.mark.parametrize("budget", [16, 64, 200])
def test_tree_verify_fused_long_prefixes_and_no_fill(budget):
    """Prefixes of thousands of columns (every fill block busy, rows far from 4-byte alignment), a batch of 40
    (FULL_MASK offsets summed over many requests), and fill_prefix off (the prefix columns left as they were)."""
    rng = np.random.default_rng(budget)
    _fused_case(rng, 3, budget, 15, 64, np.array([5001, 0, 12347], dtype=np.int64), tie_heavy=False)
    _fused_case(rng, 40, budget, 15, 64, rng.integers(0, 900, size=40).astype(np.int64), tie_heavy=True)
    _fused_case(rng, 3, budget, 15, 64, np.array([77, 1000, 3], dtype=np.int64), tie_heavy=True, fill_prefix=False)


def test_tree_verify_fused_flags_bad_input():
    """The fused launch validates the log-probs as build_trees does (the same error bits, raised by check=True) and
    still writes a tree and its verify inputs."""
    _, tree, _ = gpu_modules()
    lp = -torch.rand(2, 3, 4, device="cuda").sort(dim=-1).values
    ids = torch.zeros(2, 3, 4, dtype=torch.int64, device="cuda")
    roots = torch.zeros(2, dtype=torch.int64, device="cuda")
    seq = torch.tensor([3, 9], dtype=torch.int64, device="cuda")
    bad = lp.clone()
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        tree.build_trees_verify(bad, ids, 5, roots, seq, seq_lens_sum=12, check=True)
    bad_ids = ids.clone()
    bad_ids[0, 2, 1] = -1
    with pytest.raises(ValueError, match="negative id"):
        tree.build_trees_verify(lp, bad_ids, 5, roots, seq, seq_lens_sum=12, check=True)
    tree.build_trees_verify(lp, ids, 5, roots, seq, seq_lens_sum=12, check=True)  # clean input: no error
