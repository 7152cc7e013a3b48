"""Every kernel under sglang_kdtree/kernels/ (subfolders included: sglang_kdtree/kernels/moe/) compiles with NVRTC for
sm_90 (for its own target when ``runtime.ARCH_SPECIFIC`` names one: sm_90a for the wgmma MLA kernel) with the runtime's
options (NVRTC needs no GPU), and every ``extern "C" __global__`` function it declares is an entry of the PTX, so a
kernel that no longer compiles fails on a CPU machine too."""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

from sglang_kdtree.gpu import mla_attention, runtime

#: NVRTC's virtual target for the kernels built for an architecture-specific one
ARCH_SPECIFIC = {name: arch.replace("sm_", "compute_") for name, arch in runtime.ARCH_SPECIFIC.items()}

#: every ``.cu`` below sglang_kdtree/kernels/, by its path relative to it (the name ``runtime.kernel_source`` takes)
KERNELS = sorted(p.relative_to(runtime.kernels_dir()).as_posix()
                 for p in pathlib.Path(runtime.kernels_dir()).rglob("*.cu"))


def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    return nvrtc


def test_every_kernel_is_listed():
    assert len(KERNELS) >= 12 and "topk_histogram.cu" in KERNELS and set(ARCH_SPECIFIC) <= set(KERNELS)
    assert runtime.ARCH_SPECIFIC[mla_attention.WGMMA_SOURCE] == mla_attention.WGMMA_ARCH == "sm_90a"
    assert {"moe/moe_align.cu", "moe/moe_topk_sum.cu", "moe/silu_and_mul.cu"} <= set(KERNELS)


@functools.cache
def _ptx(name) -> str:
    """sglang_kdtree/kernels/<name> compiled with NVRTC (once per test session: two tests read topk_histogram.cu's
    PTX)."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(runtime.kernel_source(name), name, [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={ARCH_SPECIFIC.get(name, 'compute_90')}", "--std=c++17", "-fmad=false",
                                    f"-I{runtime.kernels_dir()}"])
    except Exception as exc:
        pytest.fail(f"{name} does not compile: {exc}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_with_nvrtc(name):
    source = runtime.kernel_source(name)
    text = _ptx(name)
    # kernels declared directly (those stamped out by a macro are covered by the PTX's own entry count)
    direct = "\n".join(line for line in source.splitlines() if not line.rstrip().endswith("\\"))
    entries = re.findall(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+'
                         r'(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(', direct)
    if not entries:
        assert text.count(".entry ") > 0, f"{name} produced no kernel entry"
    for entry in entries:
        assert f".entry {entry}" in text, f"{entry} of {name} is missing from the PTX"


def _header_bits(path) -> dict[str, int]:
    """``#define ERR_NAME value`` lines of a kernel source (value a number or ``(1 << n)``)."""
    out = {}
    for name, value in re.findall(r"^#define\s+(ERR_\w+)\s+(\(1 << \d+\)|\d+)", pathlib.Path(path).read_text(), re.M):
        out[name] = eval(value, {})  # noqa: S307 - an integer literal or a shift of two
    return out


def test_error_table_is_one_and_mirrored_in_python():
    """sglang_kdtree/kernels/common.cuh holds the one device error table (unique bits); gpu/errors.py mirrors it bit for
    bit, no other top-level kernel defines an ERR_ bit of its own, and the MoE align kernel's bit is the table's."""
    from sglang_kdtree.gpu import errors, topk
    from sglang_kdtree.moe import routing

    kdir = pathlib.Path(runtime.kernels_dir())
    table = _header_bits(kdir / "common.cuh")
    assert len(set(table.values())) == len(table) and all(v & (v - 1) == 0 for v in table.values())
    assert {n: getattr(errors, n) for n in table} == table
    assert {n for n in errors.__all__ if n.startswith("ERR_")} == set(table)
    assert set(errors.DEVICE_ERRORS) == set(table.values())
    assert set(topk.TOPK_ERRORS) <= set(errors.DEVICE_ERRORS)
    for path in [*kdir.glob("*.cu"), *kdir.glob("*.cuh")]:
        if path.name != "common.cuh":
            assert not _header_bits(path), f"{path.name} defines its own error bits; they belong in common.cuh"
    # moe_align.cu defines the expert-id bit itself (the table's value) or takes it from common.cuh
    assert _header_bits(kdir / "moe" / "moe_align.cu") in ({}, {"ERR_EXPERT_ID": errors.ERR_EXPERT_ID})
    assert routing.ERR_EXPERT_ID == errors.ERR_EXPERT_ID


def test_top_level_kernels_include_only_headers():
    for path in pathlib.Path(runtime.kernels_dir()).glob("*.cu*"):
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            assert inc.endswith(".cuh"), f"{path.name} includes {inc}: only headers may be included"


def test_compile_source_carries_the_headers_digest(tmp_path, monkeypatch):
    """CuPy caches compiled kernels by source text: a header-only change must still change what is compiled."""
    (tmp_path / "k.cu").write_text('#include "common.cuh"\n')
    (tmp_path / "common.cuh").write_text("#define X 1\n")
    monkeypatch.setattr(runtime, "kernels_dir", lambda: tmp_path)
    runtime.headers_digest.cache_clear()
    try:
        first = runtime.compile_source("k.cu")
        (tmp_path / "common.cuh").write_text("#define X 2\n")
        runtime.headers_digest.cache_clear()
        second = runtime.compile_source("k.cu")
    finally:
        runtime.headers_digest.cache_clear()
    assert first != second
    assert first.endswith('#include "common.cuh"\n') and second.endswith('#include "common.cuh"\n')


def test_histogram_launcher_names_are_ptx_entries():
    """Every kernel name ``topk.hist_kernel_names`` can hand the histogram launcher (bf16 / fp32, aligned or not,
    one or two groups, K on both sides of 256 and past V, both modes) is an entry of topk_histogram.cu's PTX, and
    the WIDE kernels are chosen exactly for min(K, V) > 256 (the pass only for bf16 rows)."""
    from sglang_kdtree.gpu import topk

    text = _ptx("topk_histogram.cu")
    seen = set()
    for bf16 in (True, False):
        for aligned in (True, False):
            for g2 in ((False, True) if bf16 and aligned else (False,)):
                for k, v in ((64, 163840), (256, 163840), (257, 163840), (1024, 163840), (1024, 200), (300, 257)):
                    for mode in (0, 1):
                        p, s = topk.hist_kernel_names(bf16, aligned, g2, k, v, mode)
                        assert f".entry {p}(" in text and f".entry {s}(" in text, (p, s)
                        wide = min(k, v) > 256
                        assert ("wide_" in p) == (wide and bf16) and ("wide_" in s) == wide, (bf16, k, v, p, s)
                        assert p.endswith("_g2") == g2 == s.endswith("_g2")
                        seen |= {p, s}
    assert len(seen) == 3 * 2 + 2 + 5 * 2 * 2  # passes: 3 bf16 x (plain, wide) + 2 fp32; selects: 5 x 2 modes x 2
