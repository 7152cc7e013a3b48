"""The MLA tree-verify kernel an sm_120 GPU runs (``mma_compact``) against the float64 reference at Kimi K2.6's TP 8
shapes (8 heads per GPU): 216 cases over batch 1-64, widths 1-1025 (every verify tier up to the server's widest),
contexts 0-16k with prefixes on and off the 16-key stage boundaries, int64 CSR and int32 CSR indices, random, chain
and partial trees, flat and peaked softmaxes (query scale 0.25-4), split-K on and off.

Tolerances (fp32 softmax and accumulation, bf16 P and output): relative Frobenius error of the output at most 3e-3 per
case, LSE within 1e-4 absolute. Inputs are fresh each run (``SEED`` below, printed on failure); outputs are poisoned
with NaN first. The same grid under ``KDTREE_DEVICE_PROFILE=sm_120`` is what the profile runs."""

import numpy as np
import pytest
import torch

from sglang_kdtree.gpu.mla_attention import mla_tree_verify
from sglang_kdtree.gpu.mla_reference import mla_tree_verify_reference, synthetic_inputs

pytestmark = pytest.mark.gpu

KERNEL = "mma_compact"
HEADS = 8  # Kimi K2.6's 64 heads at TP 8
REL_TOL, LSE_TOL = 3e-3, 1e-4
SEED = int(np.random.SeedSequence().entropy % (2**31))


def _cases():
    rng = np.random.default_rng(12345)  # the grid itself is fixed; the values in it are fresh (SEED)
    widths = [1, 2, 16, 17, 32, 33, 48, 64, 65, 128, 256, 1025]
    contexts = [0, 1, 15, 16, 47, 48, 1000, 4096, 16384]
    cases = []
    for i in range(216):
        width = widths[i % len(widths)]
        context = contexts[(i // len(widths)) % len(contexts)]
        batch = int(rng.choice([1, 2, 8, 32, 64])) if width <= 65 and context <= 4096 else int(rng.choice([1, 2, 3]))
        prefix = [int(min(context, max(0, context - rng.integers(0, 40)))) for _ in range(batch)]
        prefix[0] = context  # the cell's context exactly, for one request at least
        cases.append(dict(batch=batch, width=width, prefix=prefix, q_std=float(rng.choice([0.25, 1.0, 2.0, 4.0])),
                          index32=bool(i % 2), chain=i % 7 == 3, partial=i % 5 == 1,
                          num_splits=None if i % 3 else int(rng.choice([1, 3, 16]))))
    return cases


CASES = _cases()


@pytest.fixture(autouse=True)
def _gpu():
    from sglang_kdtree.gpu import limits, mla_attention
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    if gpu_unavailable_reason() is not None:
        pytest.skip(gpu_unavailable_reason())
    mla_attention.choose_kernel(KERNEL, limits.current())


def test_grid_size():
    assert len(CASES) >= 200
    assert {c["width"] for c in CASES} >= {16, 32, 64, 1025} and max(max(c["prefix"]) for c in CASES) == 16384


@pytest.mark.parametrize("i", range(len(CASES)))
def test_case_matches_float64(i):
    c = CASES[i]
    num_nodes = None
    if c["partial"]:
        num_nodes = [max(0, c["width"] - 1 - (b * 7) % max(c["width"], 1)) for b in range(c["batch"])]
    case = synthetic_inputs(c["batch"], c["width"], HEADS, c["prefix"], seed=SEED + i, q_std=c["q_std"],
                            chain=c["chain"], num_nodes=num_nodes)
    kv_indices = case["kv_indices"].to(torch.int32) if c["index32"] else case["kv_indices"]
    tokens = case["q"].shape[0]
    out = torch.full((tokens, HEADS, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, HEADS), float("nan"), dtype=torch.float32, device="cuda")
    mla_tree_verify(case["q"], case["kv_buffer"], case["kv_indptr"], kv_indices, case["tree_slots"],
                    case["ancestor_bits"], case["sm_scale"], out=out, lse=lse, num_splits=c["num_splits"],
                    kernel=KERNEL)
    ref_out, ref_lse = mla_tree_verify_reference(case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"],
                                                 case["tree_slots"], case["ancestor_bits"], case["sm_scale"])
    torch.cuda.synchronize()
    where = f"case {i} {c} seed {SEED + i}"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"unwritten rows: {where}"
    rel = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    dlse = (lse.double() - ref_lse).abs().max().item()
    assert rel <= REL_TOL, f"relative error {rel:.3e} > {REL_TOL}: {where}"
    assert dlse <= LSE_TOL, f"|lse difference| {dlse:.3e} > {LSE_TOL}: {where}"
