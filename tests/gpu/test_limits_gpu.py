"""``sglang_kdtree.gpu.limits`` on a GPU: the driver's figures against torch's (an independent reader), and the
sm_120 profile on whatever GPU runs: sm_120's limits, the kernel variants an sm_120 card picks, and launches that
would not fit it refused by name."""

import pytest
import torch

from sglang_kdtree.gpu import limits

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    if gpu_unavailable_reason() is not None:
        pytest.skip(gpu_unavailable_reason())


def test_device_limits_agree_with_torch():
    props = torch.cuda.get_device_properties(0)
    got = limits.from_device(0)
    assert got.arch == (props.major, props.minor)
    assert got.sm_count == props.multi_processor_count
    assert got.smem_per_block == props.shared_memory_per_block_optin
    assert got.smem_per_sm == props.shared_memory_per_multiprocessor
    assert got.wgmma == ((props.major, props.minor) == (9, 0))


def test_sm120_profile_picks_the_sm120_variants(monkeypatch):
    from sglang_kdtree.gpu import mla_attention, tree

    monkeypatch.setenv(limits.PROFILE_ENV, "sm_120")
    lim = limits.current(0)
    assert (lim.smem_per_block, lim.sm_count, lim.wgmma) == (101_376, 188, False)
    assert "profile sm_120 on device 0" in lim.source
    monkeypatch.delenv(mla_attention.KERNEL_ENV, raising=False)
    assert mla_attention.resolve_kernel(None, 0) == "mma_compact"
    with pytest.raises(limits.LaunchDoesNotFit, match="101,376 B"):
        mla_attention._kernels.__wrapped__("mma", 0)  # the default shape asks for 155,648 B
    fns = mla_attention._kernels.__wrapped__("mma_compact", 0)
    assert fns["asked"] <= 101_376
    with pytest.raises(limits.LaunchDoesNotFit, match="largest budget that fits at 31 draft depths is 539"):
        tree.TreeBuilder(2, 1024, 31, 1000)
    tree.TreeBuilder(2, 539, 31, 1000)
    tree.TreeBuilder(2, 1024, 15, 2000)


def test_tree_launch_at_budget_1024_depth_15_runs_under_the_profile(monkeypatch):
    """A budget of 1,024 at 15 depths: the slot kernel's 61,440 B + static shared memory, asked as needed (an opt-in
    of a constant 227 KiB would exceed sm_120's limit), fit the profile, and the tree matches the reference."""
    import numpy as np

    from sglang_kdtree import reference
    from sglang_kdtree.gpu import tree

    monkeypatch.setenv(limits.PROFILE_ENV, "sm_120")
    rng = np.random.default_rng()
    bs, depth, budget = 2, 15, 1024
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(2048), size=(bs, depth))), axis=-1)[..., :budget]
    ids = np.argsort(-rng.random((bs, depth, budget)), axis=-1).astype(np.int64)
    roots = rng.integers(0, 100, size=bs).astype(np.int64)
    got = tree.build_trees(torch.tensor(lp, dtype=torch.float32, device="cuda"), torch.tensor(ids, device="cuda"),
                           budget, torch.tensor(roots, device="cuda"), check=True)
    want = reference.build_trees(lp.astype(np.float32), ids, budget, roots)
    assert np.array_equal(got.parents.cpu().numpy(), want.parents)
    assert np.array_equal(got.tokens.cpu().numpy(), want.tokens)
    assert limits.launch_records()["tree"][1] <= 101_376
