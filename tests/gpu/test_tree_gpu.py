"""GPU tree construction against the numpy reference: top-K + lse (fp32/bf16, ties, -inf, TP shards),
the exact best-first tree (thousands of random and tie-heavy cases, scores bit for bit), verify inputs,
error flags and CUDA-graph replay. No timing here."""

import dataclasses

import numpy as np
import pytest

from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _gpu():
    from sglang_kdtree.gpu import topk, tree, verify

    return topk, tree, verify


@pytest.fixture(params=["one group", "two groups"])
def groups(request, monkeypatch):
    """Runs a histogram top-K test twice: with the one-group kernels (8192-column chunks) and with the two-group
    ``*_g2`` kernels (16384-column chunks) forced for every aligned bf16 call (``topk.HIST_G2_MIN_BLOCKS``)."""
    topk, _, _ = _gpu()
    monkeypatch.setattr(topk, "HIST_G2_MIN_BLOCKS", 0 if request.param == "two groups" else 1 << 62)
    return request.param


@pytest.fixture(params=["histogram", "cut"])
def topk_impl(request, monkeypatch):
    """Runs a top-K test with each pipeline (``SGLANG_KDTREE_TOPK_IMPL``: the default histogram select and the
    cut pipeline) for the workspaces the launcher builds itself."""
    topk, _, _ = _gpu()
    monkeypatch.setattr(topk, "IMPL", request.param)
    return request.param


@pytest.fixture(params=["list", "slots"])
def tree_kernel(request, monkeypatch):
    """Runs a tree test twice: with the launcher's choice (the sorted-list kernels ``build_trees_list1/2/4``
    up to budget 256, the slot kernel above) and with the shared-memory slot kernel ``build_trees_kernel``
    forced at every budget (``tree.LIST_MAX_BUDGET = 0``)."""
    _, tree, _ = _gpu()
    monkeypatch.setattr(tree, "LIST_MAX_BUDGET", 256 if request.param == "list" else 0)
    return request.param


def _lse64(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def _check_topk(logits_np, k, gpu_lp, gpu_ids):
    lp, ids = ref.topk_logprobs(logits_np, k)
    np.testing.assert_array_equal(gpu_ids.cpu().numpy(), ids)
    lse = _lse64(logits_np.reshape(-1, logits_np.shape[-1]).astype(np.float32)).reshape(logits_np.shape[:-1])
    tol = 2e-6 * np.maximum(1.0, np.abs(lse))[..., None]
    got = gpu_lp.cpu().numpy()
    fin = np.isfinite(lp)
    assert np.array_equal(np.isfinite(got), fin)
    assert np.all(np.abs(got[fin].astype(np.float64) - lp[fin]) <= np.broadcast_to(tol, lp.shape)[fin])


@pytest.mark.parametrize("v", [1, 7, 100, 8191, 8192, 8193, 20000, 163840])
@pytest.mark.parametrize("k", [1, 5, 64, 1024])
def test_topk_fp32_random_and_ties(v, k, topk_impl):
    topk, _, _ = _gpu()
    rng = np.random.default_rng(v * 7 + k)
    for kind in ("normal", "ties"):
        rows = 3 if v == 163840 else 5
        if kind == "normal":
            x = rng.normal(0, 3, size=(rows, v)).astype(np.float32)
        else:
            x = (rng.integers(-6, 3, size=(rows, v)) / 8).astype(np.float32)
            x[x == 0] = rng.choice([0.0, -0.0], size=int((x == 0).sum()))
        if v > 3:
            x[0, rng.integers(0, v, size=v // 3)] = -np.inf
        t = torch.from_numpy(x).cuda()
        lp, ids = topk.topk_logprobs(t, k, check=True)
        _check_topk(x, k, lp, ids)


@pytest.mark.parametrize("k", [16, 512])
def test_topk_bf16_batch(k, groups):
    topk, _, _ = _gpu()
    g = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(2, 15, 163840, device="cuda", generator=g) * 4).to(torch.bfloat16)
    lp, ids = topk.topk_logprobs(x, k, check=True)
    _check_topk(x.float().cpu().numpy(), k, lp, ids)


def test_topk_two_group_kernels_run_and_are_exact(groups):
    """The launcher's kernel choice, seen in the workspace: aligned bf16 rows write one logsumexp partial per
    16384-column chunk with the two-group kernels (10 per 163,840-column row; the other 10 slots keep their
    poison) and one per 8192 columns without; fp32 rows always take 8192-column chunks. Ids and logprobs exact
    both ways, into poisoned outputs, and the TP partials too."""
    topk, _, _ = _gpu()
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, v = 45, 163840
    x = (torch.randn(3, 15, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[1, 4, ::3] = -1.0  # a tie-heavy row
    x[2, 7, :] = 2.5  # every column tied
    xn = x.float().cpu().numpy()
    ws = topk.TopKWorkspace(rows, v, 1024, "cuda")
    for k in (1, 64, 512):
        ws.chunk_max.fill_(float("nan"))
        out = (torch.full((rows * k,), 7.0, device="cuda"), torch.full((rows * k,), -5, dtype=torch.int64, device="cuda"))
        lp, ids = topk.topk_logprobs(x, k, workspace=ws, out=out, check=True)
        _check_topk(xn, k, lp, ids)
        written = int((~torch.isnan(ws.chunk_max)).sum())
        assert written == rows * (10 if groups == "two groups" else 20)
        vals, sid, lse = topk.shard_topk_partials(x[:, :, 4096:], k, 4096, workspace=ws, check=True)
        rv, ri, rl = ref.shard_topk_partials(xn[:, :, 4096:], k, 4096)
        np.testing.assert_array_equal(sid.cpu().numpy(), ri)
        np.testing.assert_array_equal(vals.cpu().numpy(), rv)
        np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
    ws.chunk_max.fill_(float("nan"))
    topk.topk_logprobs(x.float(), 64, workspace=ws, check=True)
    assert int((~torch.isnan(ws.chunk_max)).sum()) == rows * 20
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


@pytest.mark.parametrize("v", [8192, 8193, 8200, 16384, 16392])
@pytest.mark.parametrize("k", [1, 64, 1024])
def test_topk_bf16_chunk_boundaries(v, k, groups, topk_impl):
    """bf16 rows at and just past the 8192- and 16384-column chunk widths (8193: rows not 16-byte aligned)."""
    topk, _, _ = _gpu()
    g = torch.Generator(device="cuda").manual_seed(v + k)
    x = (torch.randn(7, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[2, -1] = 30.0  # the winner in the last column
    x[3] = -2.0  # a fully tied row
    lp, ids = topk.topk_logprobs(x, k, check=True)
    _check_topk(x.float().cpu().numpy(), k, lp, ids)


def test_topk_unaligned_rows(topk_impl):
    topk, _, _ = _gpu()
    rng = np.random.default_rng(3)
    x = (rng.integers(-4, 4, size=(4, 10007)) / 4).astype(np.float32)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        lp, ids = topk.topk_logprobs(t, 300, check=True)
        _check_topk(t.float().cpu().numpy(), 300, lp, ids)


@pytest.mark.parametrize(("shards", "k"), [(1, 256), (2, 256), (4, 256), (8, 256), (3, 256), (5, 100), (8, 1024)])
def test_tp_shards_merge_to_unsharded(shards, k, groups):
    """S x Ks candidates per row: powers of two, 768 and 500 (the merge's sort pads them) and 8192 (its limit);
    with two or more shards one row is entirely -inf in shard 0 (that shard's lse is -inf, which is legal)."""
    topk, _, _ = _gpu()
    rng = np.random.default_rng(shards * 10007 + k)
    v = 32000
    x = (rng.integers(-40, 8, size=(3, 5, v)) / 8).astype(np.float32)
    bounds = np.linspace(0, v, shards + 1).astype(int)
    if shards > 1:
        x[1, 2, bounds[0]: bounds[1]] = -np.inf
    parts = []
    for s in range(shards):
        sl = x[..., bounds[s]: bounds[s + 1]]
        vals, ids, lse = topk.shard_topk_partials(torch.from_numpy(np.ascontiguousarray(sl)).cuda(), k,
                                                  int(bounds[s]), check=True)
        rv, ri, rl = ref.shard_topk_partials(sl, k, int(bounds[s]))
        np.testing.assert_array_equal(ids.cpu().numpy(), ri)
        np.testing.assert_array_equal(vals.cpu().numpy(), rv)
        np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
        parts.append((vals, ids, lse))
    perm = torch.randperm(parts[0][0].shape[-1], device="cuda")  # "any order" inside a shard
    tv = torch.stack([p[0][..., perm] for p in parts])
    ti = torch.stack([p[1][..., perm] for p in parts])
    tl = torch.stack([p[2] for p in parts])
    lp, ids = topk.merge_topk_partials(tv, ti, tl, k, check=True)
    _check_topk(x, k, lp, ids)


@pytest.mark.parametrize("impl", ["histogram", "cut"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_topk_peaked_many_rows_published_thresholds(dtype, impl, groups):
    """Many rows of Zipf-like logits: later chunks of a row cut at thresholds published by earlier chunks,
    and the cut must never drop a winner (ids exact for every K)."""
    from sglang_kdtree.bench_gpu import peaked_logits

    topk, _, _ = _gpu()
    x = peaked_logits(4, 15, 163840, seed=11)
    if dtype == "fp32":
        x = x.float() + 1e-3 * torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    ws = topk.TopKWorkspace(60, 163840, 1024, "cuda", impl=impl)
    xn = x.float().cpu().numpy()
    for k in (1, 16, 64, 256, 513, 1024):
        lp, ids = topk.topk_logprobs(x, k, workspace=ws, check=True)
        _check_topk(xn, k, lp, ids)


@pytest.mark.parametrize("impl", ["histogram", "cut"])
def test_topk_adversarial_chunk_layouts(impl, groups):
    """Rows whose winners sit in the last chunk (rising), in the first chunk (falling: later chunks keep
    nothing), all equal (every chunk falls back to the exact select), and equal values straddling chunk
    borders; one workspace reused across K (the per-row counters and thresholds must reset)."""
    topk, _, _ = _gpu()
    v = 163840
    rows = []
    ramp = np.arange(v, dtype=np.float32) / 64.0
    rows.append(ramp)                       # rising: every chunk beats the previous one's bound
    rows.append(ramp[::-1].copy())          # falling
    rows.append(np.zeros(v, dtype=np.float32))
    tie = np.full(v, -3.0, dtype=np.float32)
    for b in range(1, 20):                  # ties right at the chunk borders
        tie[b * 8192 - 3: b * 8192 + 3] = 1.0
    tie[::997] = -0.0
    rows.append(tie)
    blocks = np.repeat((np.arange(v // 512) % 5).astype(np.float32), 512)  # long runs of 5 levels
    rows.append(blocks)
    x = np.stack(rows)
    x[4, 5::7] = -np.inf
    ws = topk.TopKWorkspace(len(rows), v, 1024, "cuda", impl=impl)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in (1024, 1, 300, 64, 1024):
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, check=True)
            _check_topk(xn, k, lp, ids)
    # the counters are back at zero after every call
    assert int(ws.row_count.abs().sum()) == 0 and int(ws.row_thresh.abs().sum()) == 0
    if impl == "histogram":
        # hist_select leaves the histograms and bin ranges clean for the next call
        assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


@pytest.mark.parametrize("v", [100, 5000, 8193, 163840])
def test_topk_histogram_gather_routes(v, groups):
    """hist_select's candidate routes at their edges: the keys at or above the boundary bin number exactly
    S_CACHE (gathered into shared memory), S_CACHE + 1 (the row's global buffer), or a handful; rows whose
    last chunk is partial (groups straddling V); every K; exact ids and logprobs; histograms clean after."""
    topk, _, _ = _gpu()
    rng = np.random.default_rng(v)
    s_cache = 2048  # S_CACHE in sglang_kdtree/kernels/topk_histogram.cu
    rows = []
    for tied in (s_cache, s_cache + 1, 3):
        x = np.clip(rng.normal(0, 1, size=v), -3.5, 3.5).astype(np.float32)  # bins below 6.0's
        x[rng.permutation(v)[: min(tied, v)]] = 6.0                           # one bin, tied values
        rows.append(x)
    rows.append(rng.normal(0, 3, size=v).astype(np.float32))
    x = np.stack(rows)
    ws = topk.TopKWorkspace(len(rows), v, 1024, "cuda", impl="histogram")
    ws.cands.fill_(-1)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in (1, 64, 1024):
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, check=True)
            _check_topk(xn, k, lp, ids)
            vals, sid, lse = topk.shard_topk_partials(t, k, 7, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn, k, 7)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def test_topk_histogram_boundary_bin_capacity(groups):
    """The histogram pipeline's two routes on one workspace: rows whose candidates (bin >= boundary bin) fit
    HIST_CAP and rows that overflow it (a value repeated around the K-th place) and take the whole-row
    select; both exact, also as TP shard partials, and equal to the cut pipeline."""
    topk, _, _ = _gpu()
    rng = np.random.default_rng(21)
    v = 163840
    x = rng.normal(0, 2, size=(6, v)).astype(np.float32)
    x[1, rng.permutation(v)[: topk.HIST_CAP - 40]] = 6.0          # near the cap
    x[2, rng.permutation(v)[: topk.HIST_CAP + 1]] = 6.0           # one over: whole-row select
    x[3, :] = np.float32(-np.inf)
    x[3, rng.permutation(v)[:10]] = rng.normal(0, 1, size=10)     # fewer finite entries than K
    x[4, rng.permutation(v)[: 3 * v // 4]] = -0.0                  # -0.0 == 0.0 ties, boundary at 0
    x[4, rng.permutation(v)[:50]] = 0.0
    x[5] = np.round(x[5] * 4) / 4                                   # coarse fp32 grid: big boundary bins
    ws = topk.TopKWorkspace(6, v, 1024, "cuda", impl="histogram")
    ws_cut = topk.TopKWorkspace(6, v, 1024, "cuda", impl="cut")
    ws.cands.fill_(-1)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in (64, 1, 1024, 200):
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, check=True)
            _check_topk(xn, k, lp, ids)
            lp2, ids2 = topk.topk_logprobs(t, k, workspace=ws_cut, check=True)
            assert torch.equal(ids, ids2)
            vals, sid, lse = topk.shard_topk_partials(t[:, 8192:], k, 8192, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn[:, 8192:], k, 8192)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
            np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
    assert int(ws.row_count.abs().sum()) == 0
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def test_topk_poisoned_outputs_and_reused_builder_buffers():
    topk, _, _ = _gpu()
    rng = np.random.default_rng(9)
    x = (rng.integers(-30, 5, size=(3, 7, 50000)) / 4).astype(np.float32)
    ws = topk.TopKWorkspace(21, 50000, 512, "cuda")
    ws.cands.fill_(-1)  # poison the candidate buffer
    out = (torch.full((21 * 512,), 7.0, device="cuda"), torch.full((21 * 512,), -5, dtype=torch.int64, device="cuda"))
    t = torch.from_numpy(x).cuda()
    for k in (512, 33, 512):
        lp, ids = topk.topk_logprobs(t, k, workspace=ws, out=out, check=True)
        _check_topk(x, k, lp, ids)



def _chunk_bound_rows(rng, v):
    """Rows aimed at hist_pass's per-chunk bound c (the K-th largest of a chunk's 256 per-thread maxima) and
    at the boundary bin: every thread max tied at c; half the thread maxima tied (fp32's 4-column runs);
    -0.0 / 0.0 ties at the bound; the K-th value exactly on a bin edge (2.0, -2.0) with the largest value
    below it packed in; a spread row; one all -inf row but for a few entries (fewer finite than K)."""
    rows = []
    x = np.clip(rng.normal(-3, 1, size=v), -9, -0.5).astype(np.float32)
    x[::8] = 1.0                                               # each 8-run holds a 1.0: every thread max is 1.0
    x[rng.permutation(v)[:40]] = 2.5
    rows.append(x)
    x = np.clip(rng.normal(-3, 1, size=v), -9, -0.5).astype(np.float32)
    x[::16] = 1.0                                              # half the runs
    x[5::16] = 0.75
    rows.append(x)
    x = np.clip(rng.normal(-5, 1, size=v), -9, -1).astype(np.float32)
    x[::8] = -0.0
    x[3::16] = 0.0
    x[rng.permutation(v)[:7]] = 1.0
    rows.append(x)
    for sign in (1.0, -1.0):                                   # K-th value on a bin edge, for K 255..257 and 64
        # 2.0 is the lowest key of its bin, -2.0 the highest of its; lo: the next bf16 value below the edge
        lo = 1.9921875 if sign > 0 else -2.015625
        x = (rng.uniform(1.0, lo, size=v) if sign > 0 else -rng.uniform(-lo, 3.0, size=v)).astype(np.float32)
        x[rng.permutation(v)[:300]] = lo
        p = rng.permutation(v)
        x[p[:250]] = (sign * 2.0 + rng.uniform(0.01, 0.9, size=250)).astype(np.float32)  # above the edge
        x[p[250:268]] = sign * 2.0                             # the edge itself: places 251..268, ties by id
        rows.append(x)
    rows.append(rng.normal(0, 3, size=v).astype(np.float32))
    x = np.full(v, -np.inf, dtype=np.float32)
    x[rng.permutation(v)[:10]] = rng.normal(0, 1, size=10)
    rows.append(x)
    return np.stack(rows)


@pytest.mark.parametrize("v", [24653, 24656, 163840])
def test_topk_histogram_chunk_bound_edges(v, groups):
    """hist_pass histograms only keys >= its chunk bound (K <= 256; none for K > 256) and the select ranks
    few candidates directly: ties at the bound, K 255 / 256 / 257 around the bound's limit, K-th values on a
    bin edge, -0.0 / 0.0, partial last chunks (V = 3 chunks + 77: unaligned kernels; + 80: aligned, partial
    groups), fp32 and bf16; ids and values exact (logprobs and TP partials) into poisoned outputs, one
    workspace reused, histograms clean after every call."""
    topk, _, _ = _gpu()
    rng = np.random.default_rng(v + 5)
    x = _chunk_bound_rows(rng, v)
    rows = x.shape[0]
    ws = topk.TopKWorkspace(rows, v, 1024, "cuda", impl="histogram")
    ws.cands.fill_(-1)
    ks = (1, 64, 255, 256, 257, 1024) if v < 100000 else (64, 256, 257)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in ks:
            out = (torch.full((rows * k,), 7.0, device="cuda"), torch.full((rows * k,), -5, dtype=torch.int64,
                                                                            device="cuda"))
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, out=out, check=True)
            _check_topk(xn, k, lp, ids)
            vals, sid, lse = topk.shard_topk_partials(t, k, 1000, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn, k, 1000)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
            np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
            assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def test_topk_histogram_rank_route_sizes(groups):
    """The select's direct ranking (<= 512 candidates in shared memory; 2..32 lanes per candidate up to 128,
    one up to 256, a loop up to 512) against the radix select (more) at the switches: rows with exactly
    64 / 65 / 128 / 129 / 256 / 257 / 511 / 512 / 513 keys at or above the boundary bin (one tied bin), every
    K to 1024, and the cut pipeline as a second opinion."""
    topk, _, _ = _gpu()
    rng = np.random.default_rng(77)
    v = 40000
    rows = []
    for tied in (64, 65, 128, 129, 256, 257, 511, 512, 513, 3000):
        x = np.clip(rng.normal(0, 1, size=v), -3.5, 3.5).astype(np.float32)
        x[rng.permutation(v)[:tied]] = 6.0
        rows.append(x)
    x = np.stack(rows)
    ws = topk.TopKWorkspace(len(rows), v, 1024, "cuda", impl="histogram")
    ws_cut = topk.TopKWorkspace(len(rows), v, 1024, "cuda", impl="cut")
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in (1, 100, 511, 512, 513, 1024):
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, check=True)
            _check_topk(xn, k, lp, ids)
            lp2, ids2 = topk.topk_logprobs(t, k, workspace=ws_cut, check=True)
            assert torch.equal(ids, ids2)
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0

def test_topk_histogram_wide_k_bound_and_segments(groups):
    """K in (256, 1024]: hist_pass's bound from each thread's fourth-largest value (bf16 full chunks) and
    hist_select's by-bin placement (candidates grouped by bin, ranked within their bin), against the numpy
    reference and the cut pipeline: peaked draft-like rows, heavy ties in and above the boundary bin, bins
    spread over more than 2,000 bins (1e-20 .. 1e30: a logsumexp far from 1 too), -0.0 / 0.0 at the boundary, a row with
    fewer finite values than K; fp32 and bf16, logprobs and TP partials, into poisoned outputs; the
    histograms and bin ranges clean after every call."""
    topk, _, _ = _gpu()
    from sglang_kdtree.bench_gpu import peaked_logits

    rng = np.random.default_rng(1515)
    v = 163840
    rows = [peaked_logits(1, 3, v, seed=3).float().cpu().numpy()[0, i] for i in range(3)]
    x = np.clip(rng.normal(0, 1, size=v), -3.5, 3.5).astype(np.float32)
    x[rng.permutation(v)[:700]] = rng.integers(40, 48, size=700) / 8.0  # 700 keys over 8 values, few bins
    rows.append(x)
    x = np.full(v, -1.0, dtype=np.float32)
    x[rng.permutation(v)[:1100]] = np.exp(rng.uniform(-46, 69, size=1100))  # 1e-20 .. 1e30: > 1024 bins
    rows.append(x)
    x = rng.normal(-2, 1, size=v).astype(np.float32)
    x[rng.permutation(v)[:900]] = -0.0
    x[rng.permutation(v)[:300]] = 0.0
    x[rng.permutation(v)[:200]] = rng.uniform(0.5, 3, size=200)
    rows.append(x)
    x = np.full(v, -np.inf, dtype=np.float32)
    x[rng.permutation(v)[:400]] = rng.normal(0, 1, size=400)  # 400 finite: fewer than K for K > 400
    rows.append(x)
    x = np.stack(rows).astype(np.float32)
    n = x.shape[0]
    ws = topk.TopKWorkspace(n, v, 1024, "cuda", impl="histogram")
    ws_cut = topk.TopKWorkspace(n, v, 1024, "cuda", impl="cut")
    for dt in (torch.bfloat16, torch.float32):
        t = torch.from_numpy(x).cuda().to(dt)
        xn = t.float().cpu().numpy()
        for k in (257, 300, 512, 777, 1024):
            out = (torch.full((n * k,), 7.0, device="cuda"), torch.full((n * k,), -5, dtype=torch.int64, device="cuda"))
            flag = topk.new_error_flag("cuda")
            lp, ids = topk.topk_logprobs(t, k, workspace=ws, out=out, error_flag=flag)
            torch.cuda.synchronize()
            finite_rows = np.isfinite(xn).any(axis=-1).all()
            assert finite_rows and int(flag.item()) == 0
            _check_topk(xn, k, lp, ids)
            lp2, ids2 = topk.topk_logprobs(t, k, workspace=ws_cut, check=True)
            assert torch.equal(ids, ids2)
            vals, sid, lse = topk.shard_topk_partials(t, k, 123, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn, k, 123)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
            np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
            assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def _sorted_rows(rng, bs, depth, k, tie_heavy):
    if tie_heavy:
        lp = -(rng.integers(0, 6, size=(bs, depth, k)) / 8.0)
    else:
        lp = -np.abs(rng.normal(0, 2, size=(bs, depth, k)))
    lp = -np.sort(-lp, axis=-1).astype(np.float32)
    if rng.random() < 0.3 and k > 1:
        cut = rng.integers(1, k + 1)
        lp[:, rng.integers(0, depth), cut:] = -np.inf
    ids = rng.integers(0, 100000, size=(bs, depth, k)).astype(np.int64)
    return lp, ids


def _compare_trees(got, want, scores_want=None):
    for f in ("tokens", "depths", "parents", "num_nodes"):
        np.testing.assert_array_equal(getattr(got, f).cpu().numpy(), getattr(want, f), err_msg=f)


def test_tree_exact_thousands_of_cases(tree_kernel):
    _, tree, _ = _gpu()
    rng = np.random.default_rng(0)
    cases = 0
    for it in range(60):
        depth = int(rng.integers(1, 8))
        k = int(rng.integers(1, 9))
        budget = int(rng.integers(1, 48))
        bs = 64
        lp, ids = _sorted_rows(rng, bs, depth, k, tie_heavy=it % 2 == 0)
        roots = rng.integers(0, 1000, size=bs).astype(np.int64)
        got = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                               torch.from_numpy(roots).cuda(), check=True)
        want = ref.build_trees(lp, ids, budget, roots)
        _compare_trees(got, want)
        sc = got.scores.cpu().numpy()
        for b in range(bs):
            t = ref.build_tree(lp[b], ids[b], budget)
            assert sc[b, 1: t.num_nodes + 1].tobytes() == t.scores.tobytes()
        cases += bs
    assert cases >= 3000


@pytest.mark.parametrize("budget,depth,k", [(1024, 31, 1024), (1024, 15, 64), (300, 2, 3), (1, 1, 1),
                                            (512, 15, 512), (0, 4, 4), (7, 7, 1)])
def test_tree_edge_sizes(budget, depth, k, tree_kernel):
    _, tree, _ = _gpu()
    rng = np.random.default_rng(budget + depth)
    lp, ids = _sorted_rows(rng, 3, depth, k, tie_heavy=True)
    roots = np.arange(3, dtype=np.int64)
    out = tree._alloc_tree(3, max(budget, 0) + 1, "cuda")
    for t in (out.tokens, out.depths, out.parents, out.ranks, out.num_nodes):
        t.fill_(12345)  # poison
    got = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                           torch.from_numpy(roots).cuda(), out=out, check=True)
    _compare_trees(got, ref.build_trees(lp, ids, budget, roots))


_VERIFY_POISON = -7  # no id, position, link or retrieve index the kernel writes is negative but -1
_MASK_POISON = 0x5A  # a FULL_MASK byte the kernel writes is 0 or 1


def _poison_verify_out(out):
    """Every verify-input buffer filled with a value the kernel never writes (bool bytes as raw 0x5A)."""
    for t in out.__dict__.values():
        if t.dtype == torch.bool:
            t.view(torch.uint8).fill_(_MASK_POISON)
        else:
            t.fill_(_VERIFY_POISON)


def _assert_untouched_past(out, mask_numel, rows):
    """Nothing written past the batch: the FULL_MASK bytes after ``mask_numel`` and the rows after ``rows``."""
    assert bool((out.full_mask.view(torch.uint8)[mask_numel:] == _MASK_POISON).all()), "wrote past the FULL_MASK"
    for name in ("input_ids", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert bool((getattr(out, name)[rows:] == _VERIFY_POISON).all()), f"wrote {name} past the batch"
    words = out.ancestor_bits.numel() // out.input_ids.numel()
    assert bool((out.ancestor_bits[rows * words:] == _VERIFY_POISON).all()), "wrote ancestor_bits past the batch"


def _verify_case(rng, bs, budget, max_seq, depth=15):
    """GPU verify inputs of GPU-built trees (outputs poisoned first, a poisoned guard past the mask) against the
    reference's on the reference's trees."""
    _, tree, verify = _gpu()
    lp, ids = _sorted_rows(rng, bs, depth, min(max(budget, 1), 64), tie_heavy=True)
    roots = rng.integers(0, 1000, size=bs).astype(np.int64)
    want_t = ref.build_trees(lp, ids, budget, roots)
    seq = rng.integers(0, max_seq, size=bs).astype(np.int64)
    seq[0] = 0
    gt = tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                          torch.from_numpy(roots).cuda(), check=True)
    mask_numel = verify.full_mask_numel(int(seq.sum()), budget + 1, bs)
    out = verify.alloc_verify_inputs(bs + 1, budget + 1, mask_numel + 4096, "cuda")
    _poison_verify_out(out)  # and the guard rows / bytes past what this batch may write
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
    _, _, verify = _gpu()
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
    _poison_verify_out(out)
    with pytest.raises(ValueError, match="malformed tree"):
        verify.verify_inputs(gt, seq, seq_lens_sum=20, out=out, check=True)
    _assert_untouched_past(out, mask_numel, bs * width)
    # the well-formed star alone raises nothing
    parents[:, 1:] = 0
    parents[:, 0] = -1
    gt.parents = torch.from_numpy(parents).cuda()
    gt.num_nodes = torch.full((bs,), width - 1, dtype=torch.int64, device="cuda")
    verify.verify_inputs(gt, seq, seq_lens_sum=20, out=out, check=True)


def test_errors_flagged_like_reference(groups, tree_kernel):
    topk, tree, _ = _gpu()
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
    _, tree, _ = _gpu()
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
        _poison_verify_out(builder.verify)
        for f in dataclasses.fields(builder.trees):
            t = getattr(builder.trees, f.name)
            t.fill_(float("nan") if t.is_floating_point() else _VERIFY_POISON)

    fill(1)
    builder.round(static_logits, budget, roots, seq, seq_sum)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    from sglang_kdtree.bench_timing import capture_graph

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
    _, tree, _ = _gpu()
    from sglang_kdtree.bench_timing import capture_graph
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
        _poison_verify_out(builder.verify)
        for f in dataclasses.fields(builder.trees):
            t = getattr(builder.trees, f.name)
            t.fill_(-7.25 if t.is_floating_point() else _VERIFY_POISON)  # finite: torch.equal compares it
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


def _poisoned_build(tree, lp, ids, budget, roots):
    out = tree._alloc_tree(lp.shape[0], max(budget, 0) + 1, "cuda")
    for t in (out.tokens, out.depths, out.parents, out.ranks, out.num_nodes):
        t.fill_(12345)  # poison
    out.scores.fill_(-7.25)
    return tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                            torch.from_numpy(roots).cuda(), out=out, check=True)


def _compare_full(got, lp, ids, budget, roots):
    """Every output of every request against reference.build_tree: tokens, depths, parents, ranks, scores
    (bytes), num_nodes, and the padding rows."""
    _compare_trees(got, ref.build_trees(lp, ids, budget, roots))
    ranks, scores = got.ranks.cpu().numpy(), got.scores.cpu().numpy()
    for b in range(lp.shape[0]):
        t = ref.build_tree(lp[b], ids[b], budget)
        n = t.num_nodes
        np.testing.assert_array_equal(ranks[b, 1: n + 1], t.ranks)
        assert scores[b, 1: n + 1].tobytes() == t.scores.tobytes()
        assert ranks[b, 0] == -1 and (ranks[b, n + 1:] == -1).all()
        assert scores[b, 0] == 0.0 and (scores[b, n + 1:] == 0.0).all()


@pytest.mark.parametrize("budget", [1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 128, 129, 255, 256, 257])
def test_tree_candidate_slot_row_boundaries(budget, tree_kernel):
    """The slot kernel stores candidate slot g in lane g % 32, row g // 32 (budget + 1 slots); the list kernels
    keep 32 * J sorted positions (J = 1 / 2 / 4 up to budget 64 / 128 / 256) and drop what shifts past the end:
    budgets around whole rows and around each list kernel's limit, heavy exact-score ties (+0.0 / -0.0 mixed, so
    the rank-tuple walk runs within and across lanes and the list must keep a -0.0 score's sign), -inf tails,
    K below and above the budget, L = 1 and L = 31."""
    _, tree, _ = _gpu()
    rng = np.random.default_rng(1000 + budget)
    for depth, k in ((1, 64), (31, 3), (15, max(1, budget // 3)), (4, budget + 2), (31, 33)):
        for tie_heavy in (True, False):
            lp, ids = _sorted_rows(rng, 6, depth, k, tie_heavy=tie_heavy)
            zero = lp == 0
            lp[zero] = rng.choice(np.array([0.0, -0.0], dtype=np.float32), size=int(zero.sum()))
            if k > 2:
                lp[1, :, k // 2:] = -np.inf  # every row cut: K effectively below the budget
            lp[2, depth // 2, :] = -np.inf  # a whole depth impossible: the tree stops there
            roots = rng.integers(0, 1000, size=6).astype(np.int64)
            _compare_full(_poisoned_build(tree, lp, ids, budget, roots), lp, ids, budget, roots)


def test_tree_all_scores_equal_forces_tuple_order(tree_kernel):
    """Every log-prob 0 (or -0.0): all candidates tie exactly, so the whole pop order is the rank-tuple order
    (shorter prefix first), decided by the rank-tuple walk (the slot kernel's argmax, the list kernels' inserts)."""
    _, tree, _ = _gpu()
    rng = np.random.default_rng(77)
    for budget, depth, k in ((64, 15, 64), (65, 31, 64), (100, 31, 4), (128, 31, 8), (129, 31, 3), (33, 2, 40),
                             (255, 31, 16), (256, 31, 8), (1024, 31, 2)):
        lp = rng.choice(np.array([0.0, -0.0], dtype=np.float32), size=(2, depth, k))
        ids = rng.integers(0, 50000, size=(2, depth, k)).astype(np.int64)
        roots = np.arange(2, dtype=np.int64)
        _compare_full(_poisoned_build(tree, lp, ids, budget, roots), lp, ids, budget, roots)


def _fused_case(rng, bs, budget, depth, k, seq, tie_heavy, fill_prefix=True):
    """``build_trees_verify`` (one launch up to budget 256) into poisoned tree and verify buffers (a poisoned guard
    past what the batch may write) against reference.verify_inputs of reference.build_trees, every output exact
    (the mask as bytes: an unwritten byte keeps the poison), and against ``build_trees`` + ``verify_inputs``."""
    _, tree, verify = _gpu()
    lp, ids = _sorted_rows(rng, bs, depth, k, tie_heavy=tie_heavy)
    if k > 2 and bs > 1:
        lp[1, :, k // 2:] = -np.inf  # every row cut short
    roots = rng.integers(0, 1000, size=bs).astype(np.int64)
    width = max(budget, 0) + 1
    mask_numel = verify.full_mask_numel(int(seq.sum()), width, bs)
    out_v = verify.alloc_verify_inputs(bs + 1, width, mask_numel + 4096, "cuda")
    _poison_verify_out(out_v)
    out_t = tree._alloc_tree(bs, width, "cuda")
    for t in (out_t.tokens, out_t.depths, out_t.parents, out_t.ranks, out_t.num_nodes):
        t.fill_(12345)
    out_t.scores.fill_(-7.25)
    g = [torch.from_numpy(a).cuda() for a in (lp, ids, roots, seq)]
    got_t, got_v = tree.build_trees_verify(g[0], g[1], budget, g[2], g[3], seq_lens_sum=int(seq.sum()), out=out_t,
                                           out_verify=out_v, fill_prefix=fill_prefix, check=True)
    _compare_full(got_t, lp, ids, budget, roots)
    want = ref.verify_inputs(ref.build_trees(lp, ids, budget, roots), seq)
    want_mask = want.full_mask.astype(np.uint8)
    if not fill_prefix:  # the prefix columns untouched (the poison), the tree columns written
        at = 0
        for b in range(bs):
            rows = np.arange(width * (int(seq[b]) + width)).reshape(width, -1) + at
            want_mask[rows[:, :int(seq[b])]] = _MASK_POISON
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
    _, tree, _ = _gpu()
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
