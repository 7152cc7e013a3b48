"""``python -m sglang_kdtree bench --kimi-round`` imports the Kimi round model as ``benchmarks.kimi_round``, a
module of the source checkout: where only the installed package is importable it says so and names the command to
run from a checkout's root; a dependency the model itself lacks stays its own error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_kdtree.cli import bench


def test_bench_flag_without_a_checkout_names_the_command(tmp_path):
    """The installed package alone (``sglang_kdtree`` importable, the checkout's ``benchmarks`` not): exit 2 with
    one line saying a source checkout is needed and what to run from its root, no traceback."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sglang_kdtree").symlink_to(Path(bench.__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-m", "sglang_kdtree", "bench", "--kimi-round"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a source checkout" in result.stderr and "python -m benchmarks.kimi_round" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_load_kimi_round_reraises_a_missing_dependency_of_the_model(monkeypatch):
    """Only a missing ``benchmarks`` package means "no checkout"; a module the model itself imports stays its own
    error."""
    bench.load_kimi_round()  # imported once, so that the import below is a fresh one
    monkeypatch.delitem(sys.modules, "benchmarks.kimi_round")
    monkeypatch.setitem(sys.modules, "benchmarks.kimi_measure", None)
    with pytest.raises(ModuleNotFoundError) as info:
        bench.load_kimi_round()
    assert not isinstance(info.value, bench.NeedsCheckout) and info.value.name == "benchmarks.kimi_measure"
