"""The built wheel carries everything the plugin needs at run time (kernels, patches, entry point), and the
checkout keeps its layout rules: no tracked symlinks, kernel sources only in sglang_kdtree/kernels/, the GPU-machine
scripts only in device/, no Python file over 500 lines."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

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


# ---- the checkout's layout -------------------------------------------------------------------------------------

MAX_PY_LINES = 500
#: the scripts that drive a run on the GPU machine, by name: they live in device/ only
DEVICE_SCRIPT = re.compile(r"(device_[\w-]+\.sh|device_carry\.py|commit_stamp\.sh)")


def tracked_entries() -> list[tuple[str, str]]:
    """``(mode, path)`` of every file git tracks in this checkout; skips where the tree is not a git checkout."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    top = subprocess.run([git, "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout")
    out = subprocess.run([git, "-C", str(ROOT), "ls-files", "-s", "-z"], check=True, capture_output=True).stdout
    entries = []
    for record in out.decode().split("\0"):
        if record:
            meta, path = record.split("\t", 1)
            entries.append((meta.split()[0], path))
    return entries


def symlinks(entries) -> list[str]:
    return [path for mode, path in entries if mode == "120000"]


def misplaced_kernel_sources(paths) -> list[str]:
    return [p for p in paths if p.endswith((".cu", ".cuh")) and not p.startswith("sglang_kdtree/kernels/")]


def misplaced_device_scripts(paths) -> list[str]:
    return [p for p in paths if DEVICE_SCRIPT.fullmatch(PurePosixPath(p).name)
            and PurePosixPath(p).parent != PurePosixPath("device")]


def long_python_files(line_counts: dict[str, int]) -> list[str]:
    """``path: N lines`` for each Python file over MAX_PY_LINES, longest first."""
    over = sorted(((n, p) for p, n in line_counts.items() if n > MAX_PY_LINES), key=lambda t: (-t[0], t[1]))
    return [f"{p}: {n} lines" for n, p in over]


def test_no_symlinks_among_tracked_files():
    """A symlink does not survive every copy of the tree (the GPU machine's copy, an archive): one real folder per
    thing instead."""
    links = symlinks(tracked_entries())
    assert not links, f"tracked symlinks: {links}"


def test_kernel_sources_live_in_the_kernels_package():
    """Every .cu / .cuh is under sglang_kdtree/kernels/, the folder NVRTC includes from and the wheel ships."""
    stray = misplaced_kernel_sources(path for _, path in tracked_entries())
    assert not stray, f"kernel sources outside sglang_kdtree/kernels/: {stray}"


def test_gpu_machine_scripts_live_in_device():
    paths = [path for _, path in tracked_entries()]
    stray = misplaced_device_scripts(paths)
    assert not stray, f"GPU-machine scripts outside device/: {stray}"
    assert "device/device_server.sh" in paths and "device/device_carry.py" in paths


def test_no_python_file_over_500_lines():
    counts = {}
    for _, path in tracked_entries():
        file = ROOT / path
        if path.endswith(".py") and file.is_file():
            counts[path] = len(file.read_text(errors="replace").splitlines())
    assert counts  # the rule saw the tree
    over = long_python_files(counts)
    assert not over, f"Python files over {MAX_PY_LINES} lines (split them): " + "; ".join(over)


def test_the_layout_rules_catch_what_they_forbid():
    """Each rule flags a violation, so a passing rule test means a clean tree, not a blind rule."""
    assert symlinks([("100644", "a.py"), ("120000", "sglang_kdtree/_kernels")]) == ["sglang_kdtree/_kernels"]
    assert misplaced_kernel_sources(["sglang_kdtree/kernels/a.cu", "sglang_kdtree/kernels/moe/b.cuh",
                                     "kernels/c.cu", "tests/d.cuh", "e.cup"]) == ["kernels/c.cu", "tests/d.cuh"]
    assert misplaced_device_scripts(["device/device_server.sh", "device/commit_stamp.sh", "device/device_carry.py",
                                     "benchmarks/device_mla.sh", "commit_stamp.sh", "benchmarks/device_carry.py",
                                     "benchmarks/bench_server.py", "tests/test_device_carry.py"]) == [
        "benchmarks/device_mla.sh", "commit_stamp.sh", "benchmarks/device_carry.py"]
    assert long_python_files({"a.py": 500, "b.py": 501, "c.py": 900}) == ["c.py: 900 lines", "b.py: 501 lines"]
