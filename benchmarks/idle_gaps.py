"""The GPU's idle time between decode rounds, from a torch-profiler trace of a live SGLang server.

With overlap scheduling the host prepares round k+1 while the GPU still runs round k; without it the GPU waits
for the host between rounds. What that is worth shows as the gaps in the device timeline of a decode window,
so this measures them directly rather than inferring them from tokens/s:

1. ``bs`` concurrent greedy requests (``ignore_eos``, streamed) go to the server; once every one has produced its
   first token, all are decoding together;
2. SGLang's own ``/start_profile`` records ``steps`` forward steps of that batch with the GPU activity only (no
   CPU ops, stacks or shapes: the profiler's own host cost would otherwise widen the gaps it measures) and
   writes a Chrome trace;
3. ``analyse`` takes the device's kernel, memcpy and memset intervals, merges those that overlap (several
   streams), and reports the window, the busy time and the idle time, per step and as gap sizes; from the CUDA API
   events CUPTI records alongside, ``host_calls`` reports the host's time in CUDA calls, waiting and issuing.

Used by ``benchmarks/bench_server.py --idle-steps N`` on servers it has already timed (same run, same servers).
The trace files are kept (``traces/``): ``chrome://tracing`` or Perfetto open them.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: the trace categories that occupy the device (kineto's names)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: a gap at least this long counts as one the host left (launch-to-launch spacing inside a graph is below it)
GAP_US = 5.0


def device_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """``(start_us, end_us)`` of every device activity of the busiest device in a Chrome trace's events (those of
    zero duration occupy nothing and are left out)."""
    by_device: dict = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in DEVICE_CATEGORIES and float(ev.get("dur", 0)) > 0:
            start = float(ev["ts"])
            by_device.setdefault(ev.get("pid"), []).append((start, start + float(ev["dur"])))
    if not by_device:
        return []
    return max(by_device.values(), key=len)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint, sorted intervals (kernels of several streams overlap)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


#: host-side CUDA API events, which CUPTI records with the device activity (no CPU profiling needed)
HOST_API_CATEGORIES = ("cuda_runtime", "cuda_driver")
#: API calls in which the calling host thread waits for the device
HOST_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cuEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize", "cudaMemcpy", "cudaMemcpy2D")
#: API calls that put work on the device (a CUDA graph's launch counts once)
HOST_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                 "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def host_calls(events: list[dict], steps: int) -> dict:
    """Per step, from the trace's CUDA API events: the host's time inside CUDA calls, the part of it spent waiting
    for the device (``HOST_WAITS``), and the work it issued (``HOST_LAUNCHES``), summed over the host threads. Where
    a host-paced round's time goes: an overlapped round that waits in the scheduler shows it here."""
    api_us = wait_us = 0.0
    launches = 0
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in HOST_API_CATEGORIES:
            continue
        dur = float(ev.get("dur", 0))
        api_us += dur
        if ev.get("name") in HOST_WAITS:
            wait_us += dur
        elif ev.get("name") in HOST_LAUNCHES:
            launches += 1
    per = max(steps, 1)
    return {"host_api_ms_per_step": api_us / 1e3 / per, "host_wait_ms_per_step": wait_us / 1e3 / per,
            "launches_per_step": launches / per}


def analyse(events: list[dict], steps: int) -> dict | None:
    """Window, busy and idle time (ms) of the device in ``events``, idle per step, and the gaps of at least
    ``GAP_US`` (count, median, largest, and their share of the idle time). None when the trace holds no device
    activity (a CPU server, or a profiler without CUPTI)."""
    busy = merge(device_intervals(events))
    if not busy:
        return None
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    gaps = sorted(b[0] - a[1] for a, b in zip(busy, busy[1:]))
    long_gaps = [g for g in gaps if g >= GAP_US]
    idle_us = span - busy_us
    return {
        "steps": steps,
        "window_ms": span / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": idle_us / 1e3,
        "idle_fraction": idle_us / span if span > 0 else 0.0,
        "idle_per_step_ms": idle_us / 1e3 / steps if steps else None,
        "gaps": len(long_gaps),
        "gap_median_us": long_gaps[len(long_gaps) // 2] if long_gaps else 0.0,
        "gap_max_us": long_gaps[-1] if long_gaps else 0.0,
        "long_gap_share_of_idle": sum(long_gaps) / idle_us if idle_us > 0 else 0.0,
        **host_calls(events, steps),
    }


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _post(url: str, payload: dict, timeout: float = 60) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _stream_one(url: str, payload: dict, first_token: threading.Event) -> None:
    """One streamed ``/generate``; ``first_token`` is set at its first data chunk, and the stream is read to the end."""
    req = urllib.request.Request(url + "/generate", data=json.dumps({**payload, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data:") and not first_token.is_set():
                first_token.set()
    first_token.set()


def _wait_for_trace(folder: Path, profile_id: str, timeout: float, decoding=lambda: True) -> Path:
    """The trace SGLang writes once the profiled steps are done (``{profile_id}-TP-0.trace.json.gz``), once whole.
    Raises as soon as ``decoding()`` is False with no trace: the batch ended before the profiled window did (SGLang
    then never writes it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ended = not decoding()
        for path in folder.glob(f"{profile_id}-TP-*.trace.json*"):
            try:
                read_trace(path)
                return path
            except (EOFError, OSError, ValueError):  # still being written
                pass
        if ended:
            raise RuntimeError(f"every request ended before the profiled window {profile_id} did (new_tokens too few, "
                               "or the requests were refused: see the server's log)")
        time.sleep(0.5)
    raise TimeoutError(f"no complete trace {profile_id}-TP-*.trace.json* in {folder} after {timeout:.0f} s")


def profile_decode(url: str, batch: list[list[int]], new_tokens: int, steps: int, folder: Path, profile_id: str,
                   activities=("GPU",), timeout: float = 120) -> tuple[Path, dict | None]:
    """Profile ``steps`` forward steps of ``batch`` decoding together on the server at ``url``; returns the trace's
    path and ``analyse``'s figures. ``new_tokens`` must outlast the window: each request keeps decoding until the
    trace is written (``ignore_eos``)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    firsts = [threading.Event() for _ in batch]
    payloads = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                     "ignore_eos": True}} for p in batch]
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        futures = [pool.submit(_stream_one, url, p, e) for p, e in zip(payloads, firsts)]
        deadline = time.time() + timeout
        for event in firsts:
            if not event.wait(max(0.0, deadline - time.time())):
                raise TimeoutError(f"{url}: not every request of the batch of {len(batch)} started decoding")
        _post(url + "/start_profile", {"output_dir": str(folder), "num_steps": steps, "activities": list(activities),
                                       "with_stack": False, "record_shapes": False, "profile_id": profile_id})
        path = _wait_for_trace(folder, profile_id, max(10.0, deadline - time.time()),
                               decoding=lambda: not all(f.done() for f in futures))
        for fut in futures:
            fut.result()
    return path, analyse(read_trace(path), steps)


def trace_servers(servers: dict, batches, steps: int, new_tokens: int, folder: Path, prompts) -> dict:
    """``profile_decode`` for every server (name -> an object with ``url``) at every batch size; ``prompts(bs)``
    gives the batch. Returns ``{bs: {name: figures or {"error": ...}}}``; one server's failure does not stop the
    others."""
    out: dict = {}
    for bs in batches:
        for name, server in servers.items():
            try:
                path, figures = profile_decode(server.url, prompts(bs), new_tokens, steps, folder, f"{name}-bs{bs}")
                row = figures if figures is not None else {"error": "no device activity in the trace"}
                row["trace"] = path.name
            except Exception as exc:  # noqa: BLE001  (recorded in the JSON, printed in the table)
                row = {"error": repr(exc)[:300]}
            out.setdefault(str(bs), {})[name] = row
    return out


def format_table(idle: dict) -> str:
    lines = ["| batch | server | steps | window ms | busy ms | idle ms | idle % | idle/step ms | gaps >= "
             f"{GAP_US:g} us | median gap us | max gap us | host in CUDA calls / waiting, ms/step | launches/step |",
             "|" + "---|" * 13]
    for bs, rows in idle.items():
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {bs} | {name} | {r['error'][:120]} |")
                continue
            lines.append(f"| {bs} | {name} | {r['steps']} | {r['window_ms']:.2f} | {r['busy_ms']:.2f} | "
                         f"{r['idle_ms']:.2f} | {100 * r['idle_fraction']:.1f} | {r['idle_per_step_ms']:.3f} | "
                         f"{r['gaps']} | {r['gap_median_us']:.1f} | {r['gap_max_us']:.1f} | "
                         f"{r.get('host_api_ms_per_step', 0):.2f} / {r.get('host_wait_ms_per_step', 0):.2f} | "
                         f"{r.get('launches_per_step', 0):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Analyse traces already taken (``bench_server.py --idle-steps``' ``traces/``):
    ``<server>-bs<N>-TP-0.trace.json.gz``."""
    import argparse
    import re

    ap = argparse.ArgumentParser(description="The GPU's idle time and the host's CUDA calls in profiled decode windows")
    ap.add_argument("traces", type=Path, nargs="+", help="trace files named <server>-bs<N>-TP-<rank>.trace.json[.gz]")
    ap.add_argument("--steps", type=int, required=True, help="the decode steps each trace profiled (--idle-steps)")
    ap.add_argument("--json", type=Path, help="write {bs: {server: figures}} here")
    args = ap.parse_args(argv)
    idle: dict = {}
    for path in args.traces:
        m = re.match(r"(.+)-bs(\d+)-TP-\d+\.trace\.json", path.name)
        if not m:
            ap.error(f"{path.name}: not a <server>-bs<N>-TP-<rank>.trace.json[.gz] name")
        figures = analyse(read_trace(path), args.steps) or {"error": "no device activity in the trace"}
        idle.setdefault(m[2], {})[m[1]] = {**figures, "trace": path.name}
    idle = {bs: idle[bs] for bs in sorted(idle, key=int)}
    if args.json:
        args.json.write_text(json.dumps(idle, indent=1))
    print(format_table(idle))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
