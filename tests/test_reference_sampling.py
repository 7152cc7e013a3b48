"""The DDTree reference's sampling: top-k / top-p / min-p kept sets against independent walks and SGLang's
own sampler, and the seeded-sampling rule (a position's uniform, drawn by inverse CDF)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kdtree import reference as R


# ------------------------------------------------------------------------------------------------
# top-k / top-p
# ------------------------------------------------------------------------------------------------


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
# the seeded-sampling rule
# ------------------------------------------------------------------------------------------------


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
