"""benchmarks/host_loop_cpu.py: the loop's own host work per round, from the servers' host-time files."""

from __future__ import annotations

import pytest

from benchmarks import host_loop_cpu
from sglang_kdtree.server import host_times


def _row(**ms):
    return {"rounds": 10, **{f"{c}_ms": ms.get(c, 0.0) for c in host_times.COLUMNS}}


def test_the_loop_is_the_period_less_the_forward():
    """KDTREE's forward is its round (``worker``, inside ``launch``); a plain server's is its whole ``run_batch``."""
    kdtree = _row(period=10.0, launch=8.5, worker=8.0)
    plain = _row(period=10.0, launch=8.5)
    assert host_loop_cpu.loop_ms("kdtree-overlap", kdtree) == pytest.approx(2.0)
    assert host_loop_cpu.loop_ms("plain", plain) == pytest.approx(1.5)

