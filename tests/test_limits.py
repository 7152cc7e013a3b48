"""``sglang_kdtree.gpu.limits`` without a GPU: the architecture table, the launch check's arithmetic and messages, the
profile's narrowing rule, the records behind the server's launch-limits line, and the tree launchers' sizing from
those limits (budgets that fit or are refused, by hand-computed shared memory)."""

import pytest

from sglang_kdtree.gpu import limits, tree

# the tree kernels' static shared memory on sm_120 and sm_90 (ptxas -v of best_first_tree.cu; the same on both)
TREE_STATIC = {"build_trees_kernel": 34_464, "build_trees_list1": 784, "build_trees_list2": 1_552,
               "build_trees_list4": 3_088, "build_trees_verify_list1": 2_096, "build_trees_verify_list2": 5_168,
               "build_trees_verify_list4": 14_400}


def test_arch_table_and_parsing():
    sm120 = limits.for_arch("12.0")
    assert limits.for_arch("sm_120") is sm120 and limits.for_arch((12, 0)) is sm120 and limits.for_arch("sm_120a") is sm120
    assert (sm120.smem_per_block, sm120.smem_per_sm, sm120.sm_count, sm120.threads_per_sm) == (101_376, 102_400, 188, 1536)
    assert not sm120.wgmma and limits.for_arch("9.0").wgmma and not limits.for_arch("10.0").wgmma
    assert limits.for_arch("9.0").smem_per_block == 227 * 1024
    with pytest.raises(ValueError, match="8.9"):
        limits.for_arch("8.9")
    with pytest.raises(ValueError, match="compute capability like"):
        limits.for_arch("hopper")


def test_check_launch_names_kernel_request_and_limit():
    sm120 = limits.for_arch("12.0")
    limits.check_launch("k", 256, 101_376 - 1_000, 1_000, sm120)  # exactly the limit fits
    with pytest.raises(limits.LaunchDoesNotFit) as err:
        limits.check_launch("mla_tree_verify (mma, i64)", 256, 155_648, 0, sm120, fix="use auto")
    msg = str(err.value)
    assert "mla_tree_verify (mma, i64)" in msg and "155,648 B" in msg and "101,376 B" in msg and msg.endswith("use auto")
    with pytest.raises(limits.LaunchDoesNotFit, match="1536 threads per block > 1024"):
        limits.check_launch("k", 1536, 0, 0, sm120)
    # registers: 255 x 256 threads = 8 warps x 8,192 = 65,536 fits exactly; 1,024 threads at 65 registers do not
    limits.check_launch("k", 256, 0, 0, sm120, registers=255)
    with pytest.raises(limits.LaunchDoesNotFit, match="65 registers x 1024 threads"):
        limits.check_launch("k", 1024, 0, 0, sm120, registers=65)


def test_registers_fit_rounds_per_warp():
    sm90 = limits.for_arch("9.0")
    assert limits.registers_fit(64, 1024, sm90)          # 32 warps x 2,048 = 65,536
    assert not limits.registers_fit(65, 1024, sm90)      # 65 x 32 = 2,080 -> 2,304 per warp
    assert limits.registers_fit(240, 256, sm90) and limits.registers_fit(204, 192, sm90)


def test_profile_narrows_only(monkeypatch):
    h200 = limits.DeviceLimits((9, 0), 232_448, 233_472, 132, 2048, 65_536, True, "device 0 (NVIDIA H200)")
    small = limits.DeviceLimits((8, 9), 101_376, 102_400, 84, 1536, 65_536, False, "device 0 (a small card)")
    monkeypatch.setenv(limits.PROFILE_ENV, "sm_120")
    monkeypatch.setattr(limits, "from_device", lambda index: h200)
    limits._profiled.cache_clear()
    got = limits.current(0)
    assert got.smem_per_block == 101_376 and got.sm_count == 188 and not got.wgmma
    assert got.source == "profile sm_120 on device 0 (NVIDIA H200)"
    monkeypatch.setenv(limits.PROFILE_ENV, "sm_90")
    monkeypatch.setattr(limits, "from_device", lambda index: small)
    limits._profiled.cache_clear()
    with pytest.raises(ValueError, match="can only narrow"):
        limits.current(0)
    monkeypatch.delenv(limits.PROFILE_ENV)
    assert limits.current(0) is small
    limits._profiled.cache_clear()


def test_records_and_summary():
    limits.reset_records()
    limits.record_launch("tree", "build_trees_list1", 5_000)
    limits.record_launch("tree", "build_trees_list1", 4_000)   # a smaller launch of the same variant keeps the max
    limits.record_launch("mla_verify", "mma_compact", 99_584)
    assert limits.launch_records() == {"tree": ("build_trees_list1", 5_000), "mla_verify": ("mma_compact", 99_584)}
    line = limits.summary(limits.for_arch("12.0"))
    assert "mla_verify=mma_compact, tree=build_trees_list1" in line and "largest shared memory asked: 99,584 B" in line
    limits.reset_records()


def test_tree_budgets_fit_or_are_refused_by_the_limit():
    """The slot kernel stages depth x budget floats (plus 34,464 B static): on sm_120 every budget fits at 15 depths
    ((101,376 - 34,464) / 60 = 1,115 >= 1,024) and at most 539 at 31 ((101,376 - 34,464) / 124 = 539.6); sm_90's
    232,448 B take every budget at both."""
    sm120, sm90 = limits.for_arch("12.0"), limits.for_arch("9.0")
    assert tree.largest_budget(15, sm120, TREE_STATIC.get) == 1024
    assert tree.largest_budget(31, sm120, TREE_STATIC.get) == 539 == (101_376 - 34_464) // (31 * 4)
    assert tree.largest_budget(31, sm90, TREE_STATIC.get) == 1024
    tree.check_tree_fits(539, 31, sm120, TREE_STATIC.get)
    tree.check_tree_fits(256, 31, sm120, TREE_STATIC.get)   # the list kernels: (31 x 257 + 1) x 8 + 14,400 B
    with pytest.raises(limits.LaunchDoesNotFit) as err:
        tree.check_tree_fits(540, 31, sm120, TREE_STATIC.get)
    msg = str(err.value)
    assert "101,376 B" in msg and "budget 540" in msg and "largest budget that fits at 31 draft depths is 539" in msg
    assert "--speculative-num-draft-tokens" in msg


def test_tree_launches_cover_both_list_kernels():
    assert tree.tree_launches(63, 15) == [("build_trees_list1", (15 * 64 + 1) * 8),
                                          ("build_trees_verify_list1", (15 * 64 + 1) * 8)]
    assert tree.tree_launches(1024, 15) == [("build_trees_kernel", 15 * 1024 * 4)]
