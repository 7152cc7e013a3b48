"""benchmarks/topk_floor.py on a CPU machine: its probe kernels (an empty kernel and the four streaming reads)
compile with NVRTC and keep the entries the CLI launches, and the CLI's options parse without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("topk_floor", REPO / "benchmarks" / "topk_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_kernels_compile_with_the_launched_entries():
    mod = _module()
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    prog = nvrtc.createProgram(mod._PROBE, "topk_floor.cu", [], [])
    nvrtc.compileProgram(prog, ["-arch=compute_90", "--std=c++17"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for name in ["probe_empty"] + [f"probe_read{n}" for n in mod._LOADS]:
        assert f".entry {name}(" in ptx


def test_cli_help_needs_no_gpu(capsys):
    mod = _module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--batches" in out and "--budgets" in out and "--calls" in out
