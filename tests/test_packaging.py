"""The built wheel carries everything the plugin needs at run time (kernels, patches, entry point)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        cwd=out,
    )
    (whl,) = out.glob("sglang_kdtree-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_ships_every_kernel_source_and_patch(wheel):
    names = set(wheel.namelist())
    sources = sorted(ROOT.glob("sglang_kdtree/kernels/**/*.cu")) + sorted(ROOT.glob("sglang_kdtree/kernels/**/*.cuh"))
    assert any(cu.parent.name == "moe" for cu in sources)  # kernels in subfolders are covered too
    for cu in sources:
        rel = cu.relative_to(ROOT / "sglang_kdtree" / "kernels").as_posix()
        assert f"sglang_kdtree/kernels/{rel}" in names, f"sglang_kdtree/kernels/{rel} is missing from the wheel"
    for py in sorted(ROOT.glob("sglang_kdtree/patches/*.py")):
        assert f"sglang_kdtree/patches/{py.name}" in names, f"patch {py.name} is missing from the wheel"
    for py in sorted(ROOT.glob("sglang_kdtree/**/*.py")):
        rel = py.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} is missing from the wheel"


def test_wheel_declares_the_sglang_entry_point_and_exact_pin(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "[sglang.srt.plugins]" in text and "kdtree = sglang_kdtree.plugin:register" in text
    (meta,) = [n for n in wheel.namelist() if n.endswith("METADATA")]
    assert "Requires-Dist: sglang==0.5.23" in wheel.read(meta).decode()
