"""The timers and the bandwidth probe every benchmark uses (``python -m sglang_kdtree bench``, benchmarks/*.py).

* ``cuda_time_us``: median device microseconds per call, a pair of CUDA events around each timed pass;
* ``cpu_time_us``: median wall microseconds (``time.perf_counter``), for host work (heapq, numpy, copies);
* ``capture_graph``: a CUDA graph of back-to-back calls, warmed up on a side stream first;
* ``graph_replay_us``: median device microseconds per call of such a graph, replayed back to back;
* ``copy_bandwidth``: device-to-device copy bytes/s, the denominator of every bandwidth floor;
* ``floor_us``: the microseconds ``nbytes`` take at that bandwidth.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["cuda_time_us", "cpu_time_us", "capture_graph", "graph_replay_us", "copy_bandwidth", "floor_us"]


def cuda_time_us(run, calls: int = 1, trials: int = 5, warmup: int = 1, *, budget_s: float = 0.0,
                 max_trials: int | None = None) -> float:
    """Median device microseconds per call of ``run()``, which makes ``calls`` calls.

    ``warmup`` untimed passes, a synchronize, then ``trials`` passes each between two CUDA events; with
    ``budget_s``, more passes while the timed ones have taken less than ``budget_s`` wall seconds, up to
    ``max_trials``.
    """
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    t0 = time.perf_counter()
    while len(times) < trials or (len(times) < (max_trials or trials) and time.perf_counter() - t0 < budget_s):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def cpu_time_us(fn, trials: int = 3) -> float:
    """Median wall microseconds of ``fn()`` over ``trials`` calls (no warm-up)."""
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def capture_graph(fn, repeat: int = 1):
    """``(graph, what the last captured call returned)``: a CUDA graph of ``repeat`` back-to-back calls of
    ``fn``, after one warm-up call on a side stream (allocations and lazy initialisation stay out of it)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            out = fn()
    return graph, out


def graph_replay_us(fn, repeat: int = 1, replays: int = 20, trials: int = 3) -> float:
    """Median device microseconds per call of ``fn``: a CUDA graph of ``repeat`` calls (``capture_graph``), timed
    ``trials`` times over ``replays`` back-to-back replays after one untimed pass (no host work between calls,
    as a server's captured graphs run them)."""
    graph, _ = capture_graph(fn, repeat)
    return cuda_time_us(lambda: [graph.replay() for _ in range(replays)], calls=replays * repeat, trials=trials)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 1 GiB, median of 10 copies)."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = cuda_time_us(lambda: b.copy_(a), trials=10, warmup=3)
    return 2 * a.numel() / (us * 1e-6)


def floor_us(nbytes: float, bandwidth: float) -> float:
    """Microseconds to move ``nbytes`` at ``bandwidth`` bytes/s."""
    return nbytes / bandwidth * 1e6
