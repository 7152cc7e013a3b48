"""The histogram top-K pipeline at its edges (hist_pass's chunk bound, hist_select's boundary bin, candidate
routes and ranking switches, K above 256), exact against the numpy reference and the cut pipeline, with the
workspace's histograms clean after every call. No timing here."""

import numpy as np
import pytest

from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tree_gpu_checks import check_topk, gpu_modules  # noqa: E402


@pytest.mark.parametrize("v", [100, 5000, 8193, 163840])
def test_topk_histogram_gather_routes(v, groups):
    """hist_select's candidate routes at their edges: the keys at or above the boundary bin number exactly
    S_CACHE (gathered into shared memory), S_CACHE + 1 (the row's global buffer), or a handful; rows whose
    last chunk is partial (groups straddling V); every K; exact ids and logprobs; histograms clean after."""
    topk, _, _ = gpu_modules()
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
            check_topk(xn, k, lp, ids)
            vals, sid, lse = topk.shard_topk_partials(t, k, 7, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn, k, 7)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def test_topk_histogram_boundary_bin_capacity(groups):
    """The histogram pipeline's two routes on one workspace: rows whose candidates (bin >= boundary bin) fit
    HIST_CAP and rows that overflow it (a value repeated around the K-th place) and take the whole-row
    select; both exact, also as TP shard partials, and equal to the cut pipeline."""
    topk, _, _ = gpu_modules()
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
            check_topk(xn, k, lp, ids)
            lp2, ids2 = topk.topk_logprobs(t, k, workspace=ws_cut, check=True)
            assert torch.equal(ids, ids2)
            vals, sid, lse = topk.shard_topk_partials(t[:, 8192:], k, 8192, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn[:, 8192:], k, 8192)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
            np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
    assert int(ws.row_count.abs().sum()) == 0
    assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


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
    topk, _, _ = gpu_modules()
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
            check_topk(xn, k, lp, ids)
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
    topk, _, _ = gpu_modules()
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
            check_topk(xn, k, lp, ids)
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
    topk, _, _ = gpu_modules()
    from sglang_kdtree.cli.bench_gpu import peaked_logits

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
            check_topk(xn, k, lp, ids)
            lp2, ids2 = topk.topk_logprobs(t, k, workspace=ws_cut, check=True)
            assert torch.equal(ids, ids2)
            vals, sid, lse = topk.shard_topk_partials(t, k, 123, workspace=ws, check=True)
            rv, ri, rl = ref.shard_topk_partials(xn, k, 123)
            np.testing.assert_array_equal(sid.cpu().numpy(), ri)
            np.testing.assert_array_equal(vals.cpu().numpy(), rv)
            np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-6)
            assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0
