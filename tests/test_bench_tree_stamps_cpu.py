"""benchmarks/tree_stamps.py on a CPU machine: its stamps still fit ``build_trees_list``'s body in
sglang_kdtree/kernels/best_first_tree.cu (else the CLI exits naming the missing text), and the stamped kernel compiles
with NVRTC, keeping the kernel entry and the stamp buffer the CLI reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sglang_kdtree.gpu import runtime

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("tree_stamps", REPO / "benchmarks" / "tree_stamps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stamps_fit_the_kernel_and_compile():
    mod = _module()
    text = (runtime.kernels_dir() / "best_first_tree.cu").read_text()
    src = mod.stamped_source(text, "best_first_tree.cu")
    assert all(f"STAMP({i})" in src for i in range(7)) and "g_st[10] = g" in src and "g_st[11] = g" in src
    # the headers' digest line, as load_module's
    assert src.splitlines()[0].startswith("// sglang_kdtree/kernels/*.cuh sha256 ")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    prog = nvrtc.createProgram(src, "tree_stamps.cu", [], [])
    nvrtc.compileProgram(prog, ["-arch=compute_90", "--std=c++17", "-fmad=false", f"-I{runtime.kernels_dir()}"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert ".entry build_trees_list1" in ptx and "g_st" in ptx


def test_a_changed_kernel_body_is_named():
    mod = _module()
    text = (runtime.kernels_dir() / "best_first_tree.cu").read_text().replace(
        "const int n = list_tree<J>(S, L, stride, budget, node_meta, node_score);",
        "const int n = list_tree<J>(S, L, stride, budget, node_meta, node_score); ")
    with pytest.raises(SystemExit, match="best_first_tree.cu: build_trees_list is not one this script stamps"):
        mod.stamped_source(text, "best_first_tree.cu")


def test_the_older_list_body_still_stamps():
    """``--old`` copies from before the padded-row list kernel carry the older body text."""
    mod = _module()
    text = (runtime.kernels_dir() / "best_first_tree.cu").read_text()
    new_body, old_body = mod.BODIES[1], mod.BODIES[0]
    assert new_body in text and old_body not in text
    src = mod.stamped_source(text.replace(new_body, old_body), "old best_first_tree.cu")
    assert all(f"STAMP({i})" in src for i in range(7)) and "list_tree<J>(S, L, KS, budget, node_parent" in src
