"""CPU tests of sglang_kdtree.gpu.mla_attention's host side: the ancestor-bit layout and the split heuristic."""

import numpy as np
import pytest

from sglang_kdtree import reference as R
from sglang_kdtree.gpu.mla_attention import choose_num_splits
from sglang_kdtree.gpu.mla_reference import ancestor_bits_from_parents


@pytest.mark.parametrize("width, num_nodes", [(1, [0]), (33, [32, 3, 0]), (70, [69, 40])])
def test_ancestor_bits_match_reference_verify_inputs(width, num_nodes):
    rng = np.random.default_rng(width)
    bs = len(num_nodes)
    parents = np.full((bs, width), -1, dtype=np.int64)
    for b, n in enumerate(num_nodes):
        for i in range(1, n + 1):
            parents[b, i] = rng.integers(0, i)
    trees = R.TreeBatch(tokens=np.zeros((bs, width), np.int64), depths=np.zeros((bs, width), np.int64),
                        parents=parents, num_nodes=np.array(num_nodes, dtype=np.int64))
    expect = R.verify_inputs(trees, np.arange(bs, dtype=np.int64)).ancestor_bits
    got = ancestor_bits_from_parents(parents)
    assert got.dtype == np.uint32 and np.array_equal(got, expect)


def test_split_heuristic_fills_the_gpu_only_when_needed():
    assert choose_num_splits(1, 136, 4096 + 17, 132) > 8      # one request, 3 row tiles: split the keys
    assert choose_num_splits(1, 136, 200, 132) == 1           # too few keys to be worth a merge
    big = choose_num_splits(32, 65 * 16, 16384 + 65, 132)
    assert 1 <= big <= 8


def test_split_heuristic_counts_the_wgmma_kernels_64_key_stages():
    from sglang_kdtree.gpu.mla_attention import _MIN_KEYS_PER_SPLIT

    s = choose_num_splits(1, 136, 4096 + 17, 132, key_tile=64)
    assert s > 8 and ((4096 + 17) / s) >= _MIN_KEYS_PER_SPLIT - 64
    assert choose_num_splits(1, 136, 200, 132, key_tile=64) == 1


def test_kernel_choice_follows_the_limits_and_the_switch(monkeypatch):
    """auto: wgmma where it runs (sm_90), mma where its 155,648 B fit (sm_100), mma_compact on sm_120 (101,376 B per
    block); the switch is read when no kernel= is given; a kernel the GPU cannot run, or a name that is no kernel,
    fails with the variable named (no silent fallback)."""
    from sglang_kdtree.gpu import limits
    from sglang_kdtree.gpu import mla_attention as mla

    sm90, sm100, sm120 = (limits.for_arch(a) for a in ("9.0", "10.0", "12.0"))
    monkeypatch.delenv(mla.KERNEL_ENV, raising=False)
    assert [mla.choose_kernel(None, lim) for lim in (sm90, sm100, sm120)] == ["wgmma", "mma", "mma_compact"]
    assert mla.choose_kernel("mma", sm90) == "mma" and mla.choose_kernel("mma_compact", sm90) == "mma_compact"
    monkeypatch.setenv(mla.KERNEL_ENV, "MMA")
    assert mla.choose_kernel(None, sm90) == "mma"
    with pytest.raises(ValueError, match="101,376 B"):
        mla.choose_kernel(None, sm120)  # mma asks for 155,648 B
    monkeypatch.setenv(mla.KERNEL_ENV, "auto")
    with pytest.raises(ValueError, match="compute capability 9.0"):
        mla.choose_kernel("wgmma", sm120)
    monkeypatch.setenv(mla.KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match=mla.KERNEL_ENV):
        mla.choose_kernel(None, sm90)


def test_kernel_shapes_shared_memory():
    """The shared memory each shape asks for, computed by hand from its .cu's layout. mma: Q tile + two 32-key stages +
    P tile (bf16, row pitches 584 and 40) + four float rows; mma_compact: Q tile + two 16-key stages + 32 B of partial
    scores per thread, within sm_120's 101,376 B."""
    from sglang_kdtree.gpu import mla_attention as mla

    assert mla.SHAPES["mma"].smem_bytes == 2 * (64 * 584 + 64 * 584 + 64 * 40) + 1024 == 155_648
    assert mla.SHAPES["mma_compact"].smem_bytes == 2 * (48 * 584 + 32 * 584) + 192 * 32 == 99_584
    assert mla.SHAPES["mma_compact"].smem_bytes <= 101_376 < mla.SHAPES["mma"].smem_bytes
    assert mla.SHAPES["wgmma"].smem_bytes == 230_912


def test_load_module_arch_compiles_to_a_cached_cubin(tmp_path, monkeypatch):
    """The sm_90a path compiles with NVRTC (no GPU needed) into the cache folder, once: a second call with a
    fresh process-level cache finds the file."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing here
        pytest.skip(f"NVRTC unavailable: {exc}")
    import cupy

    from sglang_kdtree.gpu import mla_attention as mla
    from sglang_kdtree.gpu import runtime

    loaded = []
    monkeypatch.setattr(cupy, "RawModule", lambda path: loaded.append(path) or path)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    runtime.load_module_arch.cache_clear()
    first = runtime.load_module_arch(mla.WGMMA_SOURCE, mla.WGMMA_ARCH)
    files = list(tmp_path.glob("*.cubin"))
    assert len(files) == 1 and str(files[0]) == first and files[0].stat().st_size > 10_000
    stamp = files[0].stat().st_mtime_ns
    runtime.load_module_arch.cache_clear()
    assert runtime.load_module_arch(mla.WGMMA_SOURCE, mla.WGMMA_ARCH) == first
    assert files[0].stat().st_mtime_ns == stamp and len(loaded) == 2
    runtime.load_module_arch.cache_clear()


def test_launch_counts_are_per_device_and_per_kernel(monkeypatch):
    """The round log's ``mla_launches_by_kernel`` / ``mla_launches``: one counter per (device, kernel); a
    device's counts name only the kernels prepared or launched there. CPU tensors stand in for the device
    counters (torch.device("cuda:i") needs no GPU)."""
    import torch

    from sglang_kdtree.gpu import mla_attention as mla

    monkeypatch.setattr(mla, "_counters", {(0, "wgmma"): torch.tensor([5]), (0, "mma"): torch.tensor([2]),
                                           (1, "mma"): torch.tensor([7])})
    assert mla.launch_counts("cuda:0") == {"mma": 2, "wgmma": 5}
    assert mla.launch_count("cuda:0") == 7
    assert mla.launch_counts("cuda:1") == {"mma": 7}
    assert mla.launch_counts("cuda:2") == {} and mla.launch_count("cuda:2") == 0


def test_planned_splits_cap_the_context_only_under_capture():
    """The launcher's plan (``planned_num_splits``): eager launches plan for the batch's mean prefix, captured ones
    for at most ``_GRAPH_MEAN_PREFIX`` keys. Kimi's batch 32 / N 65 / 8 heads at 16k: 288 CTAs of 64 rows, so 5
    splits eagerly (1,440 CTAs, 10.9 waves of 132) and 3 captured (the plan for 4,096 keys: 864 CTAs, 6.5 waves,
    which the cost model prefers to 4's 8.7 by 328 to 330 units)."""
    from sglang_kdtree.gpu.mla_attention import _GRAPH_MEAN_PREFIX, planned_num_splits

    assert planned_num_splits(32, 65 * 8, 16384, 65, 132, "wgmma") == 5
    assert planned_num_splits(32, 65 * 8, 16384, 65, 132, "wgmma", capturing=True) == 3
    for kernel, tile in (("wgmma", 64), ("mma", 32)):
        for mean, capturing in ((16384, False), (16384, True), (300, True), (2000, False)):
            planned = min(mean, _GRAPH_MEAN_PREFIX) if capturing else mean
            assert planned_num_splits(8, 17 * 16, mean, 17, 132, kernel, capturing) == choose_num_splits(
                8, 17 * 16, planned + 17, 132, key_tile=tile)
