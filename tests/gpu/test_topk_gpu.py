"""GPU top-K + lse against the numpy reference: fp32 / bf16 rows, ties and -inf, chunk boundaries, unaligned
rows, both pipelines (histogram, cut) and both group widths, TP shard partials and their merge, rows whose later
chunks cut at published thresholds, poisoned outputs and reused workspaces. No timing here."""

import numpy as np
import pytest

from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tree_gpu_checks import check_topk, gpu_modules  # noqa: E402


@pytest.mark.parametrize("v", [1, 7, 100, 8191, 8192, 8193, 20000, 163840])
@pytest.mark.parametrize("k", [1, 5, 64, 1024])
def test_topk_fp32_random_and_ties(v, k, topk_impl):
    topk, _, _ = gpu_modules()
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
        check_topk(x, k, lp, ids)


@pytest.mark.parametrize("k", [16, 512])
def test_topk_bf16_batch(k, groups):
    topk, _, _ = gpu_modules()
    g = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(2, 15, 163840, device="cuda", generator=g) * 4).to(torch.bfloat16)
    lp, ids = topk.topk_logprobs(x, k, check=True)
    check_topk(x.float().cpu().numpy(), k, lp, ids)


def test_topk_two_group_kernels_run_and_are_exact(groups):
    """The launcher's kernel choice, seen in the workspace: aligned bf16 rows write one logsumexp partial per
    16384-column chunk with the two-group kernels (10 per 163,840-column row; the other 10 slots keep their
    poison) and one per 8192 columns without; fp32 rows always take 8192-column chunks. Ids and logprobs exact
    both ways, into poisoned outputs, and the TP partials too."""
    topk, _, _ = gpu_modules()
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
        check_topk(xn, k, lp, ids)
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
    topk, _, _ = gpu_modules()
    g = torch.Generator(device="cuda").manual_seed(v + k)
    x = (torch.randn(7, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[2, -1] = 30.0  # the winner in the last column
    x[3] = -2.0  # a fully tied row
    lp, ids = topk.topk_logprobs(x, k, check=True)
    check_topk(x.float().cpu().numpy(), k, lp, ids)


def test_topk_unaligned_rows(topk_impl):
    topk, _, _ = gpu_modules()
    rng = np.random.default_rng(3)
    x = (rng.integers(-4, 4, size=(4, 10007)) / 4).astype(np.float32)
    for dt in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).cuda().to(dt)
        lp, ids = topk.topk_logprobs(t, 300, check=True)
        check_topk(t.float().cpu().numpy(), 300, lp, ids)


@pytest.mark.parametrize(("shards", "k"), [(1, 256), (2, 256), (4, 256), (8, 256), (3, 256), (5, 100), (8, 1024)])
def test_tp_shards_merge_to_unsharded(shards, k, groups):
    """S x Ks candidates per row: powers of two, 768 and 500 (the merge's sort pads them) and 8192 (its limit);
    with two or more shards one row is entirely -inf in shard 0 (that shard's lse is -inf, which is legal)."""
    topk, _, _ = gpu_modules()
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
    check_topk(x, k, lp, ids)


@pytest.mark.parametrize("impl", ["histogram", "cut"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_topk_peaked_many_rows_published_thresholds(dtype, impl, groups):
    """Many rows of Zipf-like logits: later chunks of a row cut at thresholds published by earlier chunks,
    and the cut must never drop a winner (ids exact for every K)."""
    from sglang_kdtree.cli.bench_gpu import peaked_logits

    topk, _, _ = gpu_modules()
    x = peaked_logits(4, 15, 163840, seed=11)
    if dtype == "fp32":
        x = x.float() + 1e-3 * torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    ws = topk.TopKWorkspace(60, 163840, 1024, "cuda", impl=impl)
    xn = x.float().cpu().numpy()
    for k in (1, 16, 64, 256, 513, 1024):
        lp, ids = topk.topk_logprobs(x, k, workspace=ws, check=True)
        check_topk(xn, k, lp, ids)


@pytest.mark.parametrize("impl", ["histogram", "cut"])
def test_topk_adversarial_chunk_layouts(impl, groups):
    """Rows whose winners sit in the last chunk (rising), in the first chunk (falling: later chunks keep
    nothing), all equal (every chunk falls back to the exact select), and equal values straddling chunk
    borders; one workspace reused across K (the per-row counters and thresholds must reset)."""
    topk, _, _ = gpu_modules()
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
            check_topk(xn, k, lp, ids)
    # the counters are back at zero after every call
    assert int(ws.row_count.abs().sum()) == 0 and int(ws.row_thresh.abs().sum()) == 0
    if impl == "histogram":
        # hist_select leaves the histograms and bin ranges clean for the next call
        assert int(ws.hist.abs().sum()) == 0 and int(ws.row_range.abs().sum()) == 0


def test_topk_poisoned_outputs_and_reused_builder_buffers():
    topk, _, _ = gpu_modules()
    rng = np.random.default_rng(9)
    x = (rng.integers(-30, 5, size=(3, 7, 50000)) / 4).astype(np.float32)
    ws = topk.TopKWorkspace(21, 50000, 512, "cuda")
    ws.cands.fill_(-1)  # poison the candidate buffer
    out = (torch.full((21 * 512,), 7.0, device="cuda"), torch.full((21 * 512,), -5, dtype=torch.int64, device="cuda"))
    t = torch.from_numpy(x).cuda()
    for k in (512, 33, 512):
        lp, ids = topk.topk_logprobs(t, k, workspace=ws, out=out, check=True)
        check_topk(x, k, lp, ids)
