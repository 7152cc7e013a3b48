"""``benchmarks/idle_gaps.py``: the device's idle time in a profiler trace, against a brute-force count."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from benchmarks import idle_gaps


def _kernel(ts: float, dur: float, pid=0, tid=7, cat="kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def test_overlapping_streams_count_once_and_host_events_are_ignored():
    events = [
        _kernel(100, 10),                      # stream 7: 100-110
        _kernel(105, 10, tid=8),               # stream 8 overlaps it: busy 100-115
        _kernel(115, 5, cat="gpu_memcpy"),     # touches it: busy 100-120
        _kernel(150, 2, cat="gpu_memset"),     # a 30 us gap before it
        _kernel(153, 7),                       # a 1 us gap (inside a graph): not a long gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1234, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1234, "tid": 1, "ts": 90, "dur": 3},
        {"ph": "i", "cat": "kernel", "name": "marker", "pid": 0, "ts": 5},
    ]
    got = idle_gaps.analyse(events, steps=2)
    assert got["window_ms"] == pytest.approx(0.060)
    assert got["busy_ms"] == pytest.approx(0.029)
    assert got["idle_ms"] == pytest.approx(0.031)
    assert got["idle_per_step_ms"] == pytest.approx(0.0155)
    assert got["gaps"] == 1 and got["gap_max_us"] == pytest.approx(30.0)
    assert got["long_gap_share_of_idle"] == pytest.approx(30 / 31)


def test_the_busiest_device_is_measured():
    events = [_kernel(0, 5, pid=1), _kernel(0, 1, pid=0), _kernel(10, 1, pid=0), _kernel(20, 1, pid=0)]
    assert idle_gaps.analyse(events, steps=1)["window_ms"] == pytest.approx(0.021)


def test_no_device_activity_is_none():
    assert idle_gaps.analyse([{"ph": "X", "cat": "cpu_op", "pid": 1, "ts": 0, "dur": 5}], steps=3) is None


@pytest.mark.parametrize("seed", range(6))
def test_random_intervals_against_a_unit_grid(seed):
    """Integer intervals on several streams (ties, nesting, zero lengths, shared ends): busy time is the number of
    covered unit cells, the window runs from the first covered cell to the last, and each maximal run of uncovered
    cells inside it is one gap."""
    rng = random.Random(seed)
    events = []
    for _ in range(rng.randint(1, 60)):
        start = rng.randint(0, 400)
        events.append(_kernel(start, rng.choice([0, 1, 1, 2, 5, 17, 40]), tid=rng.randint(0, 3)))
    cells = set()
    for ev in events:
        cells.update(range(ev["ts"], ev["ts"] + ev["dur"]))
    if not cells:
        assert idle_gaps.analyse(events, steps=4) is None
        return
    first, last = min(cells), max(cells) + 1
    got = idle_gaps.analyse(events, steps=4)
    assert got["busy_ms"] * 1e3 == pytest.approx(len(cells))
    assert got["window_ms"] * 1e3 == pytest.approx(last - first)
    runs, run = [], 0
    for c in range(first, last):
        if c in cells:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    long_runs = sorted(r for r in runs if r >= idle_gaps.GAP_US)
    assert got["gaps"] == len(long_runs)
    assert got["gap_max_us"] == (long_runs[-1] if long_runs else 0.0)


def test_read_trace_reads_gzipped_chrome_traces(tmp_path):
    path = tmp_path / "x-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [_kernel(0, 4), _kernel(10, 4)]}, f)
    assert idle_gaps.analyse(idle_gaps.read_trace(path), steps=1)["idle_ms"] == pytest.approx(0.006)


def test_waiting_for_a_trace_stops_when_the_batch_ends_before_the_window(tmp_path):
    """Requests that end early (refused, or too few new tokens) never let SGLang write the trace: the wait says so
    at once instead of running out its timeout."""
    import time

    start = time.time()
    with pytest.raises(RuntimeError, match="ended before the profiled window"):
        idle_gaps._wait_for_trace(tmp_path, "x-bs1", timeout=60, decoding=lambda: False)
    assert time.time() - start < 5
    with pytest.raises(TimeoutError):
        idle_gaps._wait_for_trace(tmp_path, "x-bs1", timeout=0.6)


def test_host_calls_sum_the_api_time_the_waits_and_the_launches_per_step():
    """Against a hand count: two steps, one wait and three launches, device events and CPU ops left out."""
    def api(name, dur, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": name, "ts": 0.0, "dur": dur, "pid": 1, "tid": 1}

    events = [api("cudaLaunchKernel", 10.0), api("cuLaunchKernelEx", 20.0, "cuda_driver"), api("cudaGraphLaunch", 30.0),
              api("cudaEventSynchronize", 1000.0), api("cudaStreamIsCapturing", 4.0),
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 0.0, "dur": 500.0, "pid": 0, "tid": 7},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 50.0, "pid": 1, "tid": 1},
              {"ph": "i", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "pid": 1, "tid": 1}]
    got = idle_gaps.host_calls(events, steps=2)
    assert got == {"host_api_ms_per_step": pytest.approx(1064.0 / 1e3 / 2), "host_wait_ms_per_step": 0.5,
                   "launches_per_step": 1.5}
    assert idle_gaps.analyse(events, 2)["launches_per_step"] == 1.5


def test_the_cli_reads_traces_by_their_names(tmp_path, capsys):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": 10.0, "pid": 0, "tid": 7} for t in (0.0, 100.0)]
    for name in ("kdtree-63-bs32-TP-0.trace.json.gz", "plain-bs1-TP-0.trace.json.gz"):
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump({"traceEvents": events}, f)
    out = tmp_path / "idle.json"
    assert idle_gaps.main([*map(str, sorted(tmp_path.glob("*.gz"))), "--steps", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data) == ["1", "32"] and data["32"]["kdtree-63"]["idle_ms"] == pytest.approx(0.09)
    assert "| 1 | plain | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        idle_gaps.main([str(out), "--steps", "2"])
