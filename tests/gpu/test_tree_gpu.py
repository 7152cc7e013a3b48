"""GPU tree construction against the numpy reference: the exact best-first tree (thousands of random and
tie-heavy cases, scores bit for bit; both tree kernels), candidate-slot and list-kernel boundaries, exact-score
ties, error flags, and a builder round replayed in a CUDA graph and with dependent launches. No timing here."""

import dataclasses

import numpy as np
import pytest

from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tree_gpu_checks import (  # noqa: E402
    VERIFY_POISON,
    compare_full,
    compare_trees,
    gpu_modules,
    poison_verify_out,
    poisoned_build,
    sorted_rows,
)


def test_tree_exact_thousands_of_cases(tree_kernel):
    _, tree, _ = gpu_modules()
    rng = np.random.default_rng(0)
    cases = 0
    for it in range(60):
        depth = int(rng.integers(1, 8))
        k = int(rng.integers(1, 9))
        budget = int(rng.integers(1, 48))
        bs = 64
        lp, ids = sorted_rows(rng, bs, depth, k, tie_heavy=it % 2 == 0)
        roots = rng.integers(0, 1000, size=bs).astype(np.int64)
        got = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                               torch.from_numpy(roots).cuda(), check=True)
        want = ref.build_trees(lp, ids, budget, roots)
        compare_trees(got, want)
        sc = got.scores.cpu().numpy()
        for b in range(bs):
            t = ref.build_tree(lp[b], ids[b], budget)
            assert sc[b, 1: t.num_nodes + 1].tobytes() == t.scores.tobytes()
        cases += bs
    assert cases >= 3000


@pytest.mark.parametrize("budget,depth,k", [(1024, 31, 1024), (1024, 15, 64), (300, 2, 3), (1, 1, 1),
                                            (512, 15, 512), (0, 4, 4), (7, 7, 1)])
def test_tree_edge_sizes(budget, depth, k, tree_kernel):
    _, tree, _ = gpu_modules()
    rng = np.random.default_rng(budget + depth)
    lp, ids = sorted_rows(rng, 3, depth, k, tie_heavy=True)
    roots = np.arange(3, dtype=np.int64)
    out = tree._alloc_tree(3, max(budget, 0) + 1, "cuda")
    for t in (out.tokens, out.depths, out.parents, out.ranks, out.num_nodes):
        t.fill_(12345)  # poison
    from sglang_kdtree.gpu import limits

    name = tree._tree_kernel_name(max(budget, 0))
    if tree.tree_smem_bytes(name, depth, max(min(k, budget + 1), 1)) + tree._static_smem_here(name) > \
            limits.current().smem_per_block:  # e.g. 31 x 1,024 floats under the sm_120 profile: refused by name
        with pytest.raises(limits.LaunchDoesNotFit, match=f"{name} .* does not fit"):
            tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                             torch.from_numpy(roots).cuda(), out=out)
        return
    got = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                           torch.from_numpy(roots).cuda(), out=out, check=True)
    compare_trees(got, ref.build_trees(lp, ids, budget, roots))


@pytest.mark.parametrize("budget", [1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 128, 129, 255, 256, 257])
def test_tree_candidate_slot_row_boundaries(budget, tree_kernel):
    """The slot kernel stores candidate slot g in lane g % 32, row g // 32 (budget + 1 slots); the list kernels
    keep 32 * J sorted positions (J = 1 / 2 / 4 up to budget 64 / 128 / 256) and drop what shifts past the end:
    budgets around whole rows and around each list kernel's limit, heavy exact-score ties (+0.0 / -0.0 mixed, so
    the rank-tuple walk runs within and across lanes and the list must keep a -0.0 score's sign), -inf tails,
    K below and above the budget, L = 1 and L = 31."""
    _, tree, _ = gpu_modules()
    rng = np.random.default_rng(1000 + budget)
    for depth, k in ((1, 64), (31, 3), (15, max(1, budget // 3)), (4, budget + 2), (31, 33)):
        for tie_heavy in (True, False):
            lp, ids = sorted_rows(rng, 6, depth, k, tie_heavy=tie_heavy)
            zero = lp == 0
            lp[zero] = rng.choice(np.array([0.0, -0.0], dtype=np.float32), size=int(zero.sum()))
            if k > 2:
                lp[1, :, k // 2:] = -np.inf  # every row cut: K effectively below the budget
            lp[2, depth // 2, :] = -np.inf  # a whole depth impossible: the tree stops there
            roots = rng.integers(0, 1000, size=6).astype(np.int64)
            compare_full(poisoned_build(tree, lp, ids, budget, roots), lp, ids, budget, roots)


def test_tree_all_scores_equal_forces_tuple_order(tree_kernel):
    """Every log-prob 0 (or -0.0): all candidates tie exactly, so the whole pop order is the rank-tuple order
    (shorter prefix first), decided by the rank-tuple walk (the slot kernel's argmax, the list kernels' inserts)."""
    _, tree, _ = gpu_modules()
    rng = np.random.default_rng(77)
    for budget, depth, k in ((64, 15, 64), (65, 31, 64), (100, 31, 4), (128, 31, 8), (129, 31, 3), (33, 2, 40),
                             (255, 31, 16), (256, 31, 8), (1024, 31, 2)):
        lp = rng.choice(np.array([0.0, -0.0], dtype=np.float32), size=(2, depth, k))
        ids = rng.integers(0, 50000, size=(2, depth, k)).astype(np.int64)
        roots = np.arange(2, dtype=np.int64)
        compare_full(poisoned_build(tree, lp, ids, budget, roots), lp, ids, budget, roots)


def test_errors_flagged_like_reference(groups, tree_kernel):
    topk, tree, _ = gpu_modules()
    x = torch.randn(2, 3, 5000, device="cuda")
    x[1, 2, 17] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk.topk_logprobs(x, 8, check=True)
    x[1, 2, 17] = float("inf")
    with pytest.raises(ValueError, match=r"\+inf"):
        topk.topk_logprobs(x, 8, check=True)
    x[1, 2] = float("-inf")
    x[1, 2, 17] = 0
    x[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="entirely -inf"):
        topk.topk_logprobs(x, 8, check=True)
    lp = -torch.rand(2, 3, 4, device="cuda").sort(dim=-1).values  # ascending magnitudes: descending logprobs
    ids = torch.zeros(2, 3, 4, dtype=torch.int64, device="cuda")
    roots = torch.zeros(2, dtype=torch.int64, device="cuda")
    bad = lp.clone()
    bad[0, 1, 2] = 0.5
    with pytest.raises(ValueError, match="not sorted"):
        tree.build_trees(bad, ids, 5, roots, check=True)
    bad = lp.clone()
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        tree.build_trees(bad, ids, 5, roots, check=True)
    bad = lp.clone()
    bad[0, 2, 0] = float("inf")  # rank 0 of its depth: still sorted, only the +inf is wrong
    with pytest.raises(ValueError, match=r"logprobs contains \+inf"):
        tree.build_trees(bad, ids, 5, roots, check=True)
    bad_ids = ids.clone()
    bad_ids[1, 1, 2] = -4
    with pytest.raises(ValueError, match="negative id"):
        tree.build_trees(lp, bad_ids, 5, roots, check=True)
    tree.build_trees(lp, ids, 5, roots, check=True)  # clean input: no error


def test_cuda_graph_replay_matches_eager():
    _, tree, _ = gpu_modules()
    bs, depth, vocab, budget = 8, 15, 163840, 64
    seq = torch.randint(10, 200, (bs,), device="cuda", dtype=torch.int64)
    seq_sum = int(seq.sum())
    builder = tree.TreeBuilder(bs, budget, depth, vocab, "cuda", max_mask_bytes=seq_sum * 65 + 65 * 65 * bs)
    static_logits = torch.empty(bs, depth, vocab, device="cuda", dtype=torch.bfloat16)
    roots = torch.arange(bs, device="cuda", dtype=torch.int64)

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static_logits.copy_((torch.randn(bs, depth, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16))

    def snapshot(t, v):
        return [x.clone() for x in (t.tokens, t.depths, t.parents, t.num_nodes, v.full_mask.view(torch.uint8),
                                    v.input_ids, v.positions, v.ancestor_bits, v.retrieve_index,
                                    v.retrieve_next_token, v.retrieve_next_sibling)]

    def poison():  # the builder's tree and verify buffers, which the replay and the eager round both write
        poison_verify_out(builder.verify)
        for f in dataclasses.fields(builder.trees):
            t = getattr(builder.trees, f.name)
            t.fill_(float("nan") if t.is_floating_point() else VERIFY_POISON)

    fill(1)
    builder.round(static_logits, budget, roots, seq, seq_sum)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    from sglang_kdtree.cli.bench_timing import capture_graph

    graph, (g_trees, g_ver) = capture_graph(lambda: builder.round(static_logits, budget, roots, seq, seq_sum))
    for seed in (2, 3):
        fill(seed)
        poison()
        graph.replay()
        torch.cuda.synchronize()
        replay = snapshot(g_trees, g_ver)
        poison()
        e_trees, e_ver = builder.round(static_logits, budget, roots, seq, seq_sum)
        torch.cuda.synchronize()
        for a, b in zip(replay, snapshot(e_trees, e_ver)):
            assert torch.equal(a, b)
        # and the eager result is the reference's
        lp, ids = ref.topk_logprobs(static_logits.float().cpu().numpy(), budget)
        want = ref.build_trees(lp, ids, budget, roots.cpu().numpy())
        np.testing.assert_array_equal(e_trees.tokens.cpu().numpy(), want.tokens)
    builder.check()


def test_dependent_launches_match_plain_launches(monkeypatch):
    """The top-K select and the fused list tree kernel as programmatic dependent launches (``runtime.launch(...,
    pdl=True)``: the worker's path on sm_90+) and as plain launches, each eagerly and replayed in a CUDA graph: the
    same bytes in every output, the reference's tree, and the dependent launches went through cuLaunchKernelEx
    (two per round: the select after the pass, the tree kernel after the select)."""
    _, tree, _ = gpu_modules()
    from sglang_kdtree.cli.bench_timing import capture_graph
    from sglang_kdtree.gpu import runtime

    if not runtime._pdl_runs_here():
        pytest.skip("programmatic dependent launches need sm_90+, the driver's cuLaunchKernelEx and PDL on")
    real, calls = runtime._cu_launch_kernel_ex(), []

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(runtime, "_cu_launch_kernel_ex", lambda: counting)
    bs, depth, vocab, budget = 6, 15, 163840, 64
    seq = torch.tensor([5, 700, 33, 1, 2048, 129], device="cuda", dtype=torch.int64)
    seq_sum = int(seq.sum())
    builder = tree.TreeBuilder(bs, budget, depth, vocab, "cuda", max_mask_bytes=seq_sum * 65 + 65 * 65 * bs)
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = (torch.randn(bs, depth, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    roots = torch.arange(bs, device="cuda", dtype=torch.int64) + 7

    def snapshot():
        poison_verify_out(builder.verify)
        for f in dataclasses.fields(builder.trees):
            t = getattr(builder.trees, f.name)
            t.fill_(-7.25 if t.is_floating_point() else VERIFY_POISON)  # finite: torch.equal compares it
        return lambda t, v: [x.clone() for x in (t.tokens, t.depths, t.parents, t.ranks, t.scores, t.num_nodes,
                                                 v.full_mask.view(torch.uint8), v.input_ids, v.positions,
                                                 v.ancestor_bits, v.retrieve_index, v.retrieve_next_token,
                                                 v.retrieve_next_sibling)]

    results = {}
    for pdl in (True, False):
        monkeypatch.setattr(runtime, "PDL", pdl)
        calls.clear()
        take = snapshot()
        results[pdl, "eager"] = take(*builder.round(logits, budget, roots, seq, seq_sum))
        torch.cuda.synchronize()
        assert len(calls) == (2 if pdl else 0)
        graph, (g_trees, g_ver) = capture_graph(lambda: builder.round(logits, budget, roots, seq, seq_sum))
        take = snapshot()
        graph.replay()
        torch.cuda.synchronize()
        results[pdl, "graph"] = take(g_trees, g_ver)
    first = results[True, "eager"]
    for key, got in results.items():
        for a, b in zip(first, got):
            assert torch.equal(a, b), key
    builder.check()
    lp, ids = ref.topk_logprobs(logits.float().cpu().numpy(), budget)
    want = ref.build_trees(lp, ids, budget, roots.cpu().numpy())
    np.testing.assert_array_equal(first[0].cpu().numpy(), want.tokens)
