"""GPU sampled accept walk (sglang_kdtree/kernels/tree_accept.cu) against the target's own sampling: committed tokens by
chi-square against direct sampling under temperature / top-k / top-p / min-p, min-p's limits (1: greedy;
0 and NaN: off), and the kept sets at the min-p boundary exactly against ``reference.sampling_weights``.
"""

from __future__ import annotations

import numpy as np
import pytest

from accept_gpu_cases import assert_same, lazy_torch, logits_for, poisoned_out, random_trees, steered_targets, to_gpu
from sglang_kdtree import reference as ref
from sglang_kdtree.gpu.errors import error_bits

pytestmark = pytest.mark.gpu


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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
    torch = lazy_torch()
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
