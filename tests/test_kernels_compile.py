"""Every kernel under kernels/ (subfolders included: kernels/moe/) compiles with NVRTC for sm_90 with the
runtime's options (NVRTC needs no GPU), and every ``extern "C" __global__`` function it declares is an entry
of the PTX, so a kernel that no longer compiles fails on a CPU machine too."""

from __future__ import annotations

import pathlib
import re

import pytest

from sglang_kdtree.gpu import runtime

#: every ``.cu`` below kernels/, by its path relative to it (the name ``runtime.kernel_source`` takes)
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
    assert len(KERNELS) >= 11 and "topk_histogram.cu" in KERNELS
    assert {"moe/moe_align.cu", "moe/moe_topk_sum.cu", "moe/silu_and_mul.cu"} <= set(KERNELS)


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_with_nvrtc(name):
    nvrtc = _nvrtc()
    source = runtime.kernel_source(name)
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90", "--std=c++17", "-fmad=false",
                                    f"-I{runtime.kernels_dir()}"])
    except Exception as exc:
        pytest.fail(f"{name} does not compile: {exc}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    # kernels declared directly (those stamped out by a macro are covered by the PTX's own entry count)
    direct = "\n".join(line for line in source.splitlines() if not line.rstrip().endswith("\\"))
    entries = re.findall(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+'
                         r'(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(', direct)
    if not entries:
        assert text.count(".entry ") > 0, f"{name} produced no kernel entry"
    for entry in entries:
        assert f".entry {entry}" in text, f"{entry} of {name} is missing from the PTX"
