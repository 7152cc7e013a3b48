"""GPU tests of the MLA tree-verify kernels (sglang_kdtree/kernels/mla_tree_verify_wgmma.cu on compute capability 9.0,
sglang_kdtree/kernels/mla_tree_verify.cu and sglang_kdtree/kernels/mla_tree_verify_compact.cu) against their float64 twin (relative Frobenius error <= 2e-2 on outputs;
LSE absolute error <= 2e-2), on fresh random bf16 inputs; outputs are poisoned (NaN) first. Every test runs once per
kernel."""

import math

import numpy as np
import pytest
import torch

from sglang_kdtree.gpu.mla_attention import mla_tree_verify, mla_tree_verify_paged
from sglang_kdtree.gpu.mla_reference import mla_tree_verify_reference, synthetic_inputs

pytestmark = pytest.mark.gpu

TOL = 2e-2


@pytest.fixture(params=["wgmma", "mma", "mma_compact"], autouse=True)
def kernel(request, monkeypatch):
    """Each test once per kernel, through the environment switch the server reads (so the paged entry point and
    the launch counter are covered too)."""
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    if gpu_unavailable_reason() is not None:
        pytest.skip(gpu_unavailable_reason())
    from sglang_kdtree.gpu import limits, mla_attention

    try:
        mla_attention.choose_kernel(request.param, limits.current())
    except ValueError as exc:
        pytest.skip(f"{request.param} does not run here: {exc}")
    monkeypatch.setenv("SGLANG_KDTREE_MLA_KERNEL", request.param)
    return request.param


def _run(case, num_splits=None):
    tokens, heads = case["q"].shape[:2]
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), float("nan"), dtype=torch.float32, device="cuda")
    mla_tree_verify(case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"], case["tree_slots"],
                    case["ancestor_bits"], case["sm_scale"], out=out, lse=lse, num_splits=num_splits)
    torch.cuda.synchronize()
    return out, lse


def _reference(case):
    return mla_tree_verify_reference(case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"],
                                     case["tree_slots"], case["ancestor_bits"], case["sm_scale"])


def _check(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any(), "output rows left unwritten (NaN poison survived)"
    assert not torch.isnan(lse).any(), "LSE entries left unwritten"
    rel = (out.double() - ref_out).norm() / ref_out.norm()
    assert rel <= TOL, f"relative error {rel:.3e} > {TOL}"
    # per-row check too, so one bad row cannot hide in the global norm
    row_rel = (out.double() - ref_out).norm(dim=-1) / ref_out.norm(dim=-1).clamp_min(1e-6)
    assert row_rel.max() <= 5 * TOL, f"worst row relative error {row_rel.max():.3e}"
    assert (lse.double() - ref_lse).abs().max() <= TOL


GRID = [
    # (bs, N, H, prefix lengths)
    (1, 17, 8, [100]),
    (1, 1, 8, [64]),          # root only
    (3, 65, 16, [0, 1000, 37]),  # mixed prefixes incl. an empty one
    (2, 17, 64, [4000, 10]),
    (1, 33, 128, [500]),
    (2, 257, 8, [300, 2000]),
    (1, 513, 16, [1200]),     # widest tree: 17 ancestor words per row
    (4, 65, 8, [16384, 3, 700, 8000]),
    (2, 65, 16, [63, 64]),    # prefixes one short of / exactly one 64-key stage: tree keys start a stage
    (1, 129, 8, [1]),         # tree keys span three 64-key stages
]


@pytest.mark.parametrize("bs, width, heads, prefix", GRID)
def test_matches_float64_reference(bs, width, heads, prefix):
    case = synthetic_inputs(bs, width, heads, prefix, seed=bs * 1000 + width + heads, q_std=2.0)
    ref_out, ref_lse = _reference(case)
    out, lse = _run(case)
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 40, 64])
def test_split_k_merge_matches_reference(num_splits):
    case = synthetic_inputs(2, 65, 16, [3000, 129], seed=num_splits)
    ref_out, ref_lse = _reference(case)
    out, lse = _run(case, num_splits=num_splits)  # 40 splits leave some splits empty for the short request
    _check(out, lse, ref_out, ref_lse)


def test_padding_rows_and_partial_trees():
    case = synthetic_inputs(3, 65, 8, [50, 0, 900], seed=7, num_nodes=[64, 10, 0])
    ref_out, ref_lse = _reference(case)
    out, lse = _run(case)
    _check(out, lse, ref_out, ref_lse)


def test_non_ancestor_keys_are_invisible():
    """Poison the KV row of tree node j with huge values: rows that do not have j as ancestor-or-self must
    be bit-identical to the unpoisoned run (masked keys are selected away, never added)."""
    case = synthetic_inputs(2, 65, 16, [700, 1500], seed=11)
    base_out, base_lse = _run(case)
    bits = case["ancestor_bits"].cpu().numpy()
    width, heads = 65, 16
    for j in (1, 5, 30, 64):
        poisoned = dict(case)
        kv = case["kv_buffer"].clone()
        slots = case["tree_slots"].view(2, width)[:, j]
        kv[slots] = 1.0e30
        poisoned["kv_buffer"] = kv
        out, lse = _run(poisoned)
        sees_j = torch.from_numpy(((bits[:, :, j // 32] >> np.uint32(j % 32)) & 1).astype(bool)).cuda()
        unaffected = (~sees_j).reshape(-1)
        assert unaffected.any()
        assert torch.equal(out[unaffected], base_out[unaffected])
        assert torch.equal(lse[unaffected], base_lse[unaffected])
        assert torch.isfinite(out.float()[unaffected]).all()
    # spare pool rows (never addressed) poisoned too: nothing changes anywhere
    kv = case["kv_buffer"].clone()
    kv[case["spare"]] = 1.0e30
    out, lse = _run(dict(case, kv_buffer=kv))
    assert torch.equal(out, base_out) and torch.equal(lse, base_lse)


def test_chain_tree_equals_causal_attention():
    """A chain (parent i-1) is plain causal verify: node i sees the prefix and tree nodes 0..i."""
    bs, width, heads, prefix = 2, 65, 16, [900, 333]
    case = synthetic_inputs(bs, width, heads, prefix, seed=5, chain=True)
    out, lse = _run(case)
    assert not torch.isnan(out).any()
    kv = case["kv_buffer"].double()
    indptr = case["kv_indptr"].tolist()
    for b in range(bs):
        slots = torch.cat([case["kv_indices"][indptr[b]:indptr[b + 1]], case["tree_slots"][b * width:(b + 1) * width]])
        keys = kv[slots]
        q = case["q"][b * width:(b + 1) * width].double()
        total = slots.shape[0]
        # causal: query i sits at key position prefix + i
        allowed = torch.arange(total, device="cuda")[None, :] <= (prefix[b] + torch.arange(width, device="cuda"))[:, None]
        scores = torch.einsum("nhd,ld->nhl", q, keys) * case["sm_scale"]
        scores = scores.masked_fill(~allowed[:, None, :], -math.inf)
        expect = torch.einsum("nhl,lv->nhv", torch.softmax(scores, dim=-1), keys[:, :512])
        got = out[b * width:(b + 1) * width].double()
        assert (got - expect).norm() / expect.norm() <= TOL


def test_paged_addressing_matches_csr():
    """req_to_token rows (int32, the fa3 view) give bit-identical results to the CSR form."""
    bs, width, heads, prefix = 3, 17, 8, [40, 2100, 0]
    case = synthetic_inputs(bs, width, heads, prefix, seed=3)
    csr_out, csr_lse = _run(case, num_splits=1)
    max_ctx = 4096
    table = torch.zeros((5, max_ctx), dtype=torch.int32, device="cuda")
    rows = torch.tensor([4, 0, 2], device="cuda")
    indptr = case["kv_indptr"].tolist()
    for b in range(bs):
        table[rows[b], : prefix[b]] = case["kv_indices"][indptr[b]:indptr[b + 1]].to(torch.int32)
        table[rows[b], prefix[b]:prefix[b] + width] = case["tree_slots"][b * width:(b + 1) * width].to(torch.int32)
    out = torch.full_like(csr_out, float("nan"))
    lse = torch.full_like(csr_lse, float("nan"))
    mla_tree_verify_paged(case["q"], case["kv_buffer"].view(-1, 1, 576), table, rows,
                          torch.tensor(prefix, device="cuda"), case["tree_slots"], case["ancestor_bits"],
                          case["sm_scale"], out=out, lse=lse, num_splits=1)
    torch.cuda.synchronize()
    assert torch.equal(out, csr_out) and torch.equal(lse, csr_lse)


def test_launch_counter_counts_eager_calls_and_graph_replays():
    """The counter the CUDA server's round log reports: +1 per eager launch and +1 per replay of a graph
    that recorded one (split-K launches count once: the merge is not the fused kernel), on the counter of the
    kernel that ran."""
    from sglang_kdtree.gpu import mla_attention

    case = synthetic_inputs(2, 17, 8, [300, 40], seed=5)
    mla_attention.prepare(case["q"].device)
    kernel = mla_attention.resolve_kernel(None, torch.cuda.current_device())
    before, before_by = mla_attention.launch_count(), mla_attention.launch_counts()
    _run(case)
    _run(case, num_splits=3)
    assert mla_attention.launch_count() == before + 2
    after_by = mla_attention.launch_counts()  # the per-kernel counter names the kernel that ran
    assert after_by[kernel] == before_by.get(kernel, 0) + 2
    assert all(n == before_by.get(k, 0) for k, n in after_by.items() if k != kernel)
    tokens, heads = case["q"].shape[:2]
    out = torch.empty((tokens, heads, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((tokens, heads), dtype=torch.float32, device="cuda")
    args = (case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"], case["tree_slots"],
            case["ancestor_bits"], case["sm_scale"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_tree_verify(*args, out=out, lse=lse)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_tree_verify(*args, out=out, lse=lse)
    start = mla_attention.launch_count()
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert mla_attention.launch_count() == start + 3
    ref_out, ref_lse = _reference(case)
    _check(out, lse, ref_out, ref_lse)


def test_kernels_agree_with_each_other(kernel):
    """Another kernel that runs here on the same inputs, as an independent computation: within 2e-2 of each other."""
    case = synthetic_inputs(3, 65, 16, [2000, 64, 517], seed=21, q_std=2.0)
    out, lse = _run(case)
    from sglang_kdtree.gpu import limits, mla_attention

    others = []
    for name in mla_attention.KERNELS:
        try:
            others += [mla_attention.choose_kernel(name, limits.current())] if name != kernel else []
        except ValueError:  # does not run on this GPU (or under its profile)
            pass
    if not others:
        pytest.skip("no second kernel on this GPU")
    other = others[0]
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    mla_tree_verify(case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"], case["tree_slots"],
                    case["ancestor_bits"], case["sm_scale"], out=out2, lse=lse2, kernel=other)
    torch.cuda.synchronize()
    assert not torch.isnan(out2).any()
    rel = (out.double() - out2.double()).norm() / out2.double().norm()
    assert rel <= TOL, f"{kernel} vs {other}: relative difference {rel:.3e}"
    assert (lse - lse2).abs().max() <= TOL
