"""``KDTREE_HOST_TIMES``: where a decode round's host time goes, inside the worker and around it, without a profiler.

On a host-paced target the GPU idles most of each round, so whether overlap scheduling pays is decided on the
host: overlap can hide only the device's tail after the host's last launch, and the overlapped scheduler loop does
its own host work per round. A profiler adds host cost to every CUDA call and so changes exactly what is measured;
this takes two ``time.perf_counter()`` readings per decode round instead:

* ``inside``: the wall time of the worker's decode ``forward_batch_generation`` (the round's host work: issuing
  its kernels and graphs, plus any wait inside it);
* ``outside``: from the end of one decode round to the start of the next (SGLang's scheduler: processing results,
  scheduling, preparing the batch, and any wait for the device there), counted only between two rounds of the same
  batch size less than ``MAX_GAP_S`` apart (a gap across idle time or a new batch says nothing about the loop).

Off unless ``KDTREE_HOST_TIMES`` names a file; then every ``FLUSH_EVERY`` rounds, when the batch size changes and at
exit that file is rewritten with ``{batch size: {"rounds", "inside_ms", "outside_ms", "period_ms"}}``: medians over
the last ``WINDOW`` rounds of each size. Host wall time only: it runs on CPU servers too.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import time
from collections import deque

HOST_TIMES_ENV = "KDTREE_HOST_TIMES"
#: rounds kept per batch size (the medians are over these)
WINDOW = 2048
#: rounds between two rewrites of the file
FLUSH_EVERY = 64
#: a longer gap between two rounds is idle time or a new batch, not the scheduler loop
MAX_GAP_S = 0.25


class HostTimes:
    """Per batch size, the last ``WINDOW`` rounds' inside and outside times; ``summary()`` gives their medians."""

    def __init__(self, path: str | None, clock=time.perf_counter):
        self.path, self.clock = path, clock
        self._rounds: dict[int, deque] = {}
        self._last: tuple[int, float] | None = None  # (batch size, end) of the previous round
        self._since_flush = 0

    def record(self, bs: int, start: float, end: float) -> None:
        outside = None
        if self._last is not None and self._last[0] == bs and 0 <= start - self._last[1] < MAX_GAP_S:
            outside = start - self._last[1]
        if self.path and self._last is not None and self._last[0] != bs:
            self.flush()  # a stretch at one size has ended: on file before the server may be stopped
        self._rounds.setdefault(bs, deque(maxlen=WINDOW)).append((end - start, outside))
        self._last = (bs, end)
        self._since_flush += 1
        if self.path and self._since_flush >= FLUSH_EVERY:
            self.flush()

    def summary(self) -> dict:
        out = {}
        for bs in sorted(self._rounds):
            rounds = self._rounds[bs]
            inside = [i for i, _ in rounds]
            paired = [(i, o) for i, o in rounds if o is not None]
            out[str(bs)] = {
                "rounds": len(rounds),
                "inside_ms": 1e3 * statistics.median(inside),
                "outside_ms": 1e3 * statistics.median(o for _, o in paired) if paired else None,
                "period_ms": 1e3 * statistics.median(i + o for i, o in paired) if paired else None,
            }
        return out

    def flush(self) -> None:
        self._since_flush = 0
        if self.path and self._rounds:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.summary(), f, indent=1)
            os.replace(tmp, self.path)

    def timed(self, bs: int, round_fn, *args):
        """``round_fn(*args)``, timed as one decode round of ``bs`` requests."""
        start = self.clock()
        try:
            return round_fn(*args)
        finally:
            self.record(bs, start, self.clock())


_TIMES = HostTimes(os.environ.get(HOST_TIMES_ENV) or None)
if _TIMES.path:
    atexit.register(_TIMES.flush)


def timed(batch, round_fn, *args):
    """``round_fn(*args)``; with ``KDTREE_HOST_TIMES`` set, timed as one decode round of ``batch`` (SGLang's
    ``ScheduleBatch``)."""
    if _TIMES.path is None:
        return round_fn(*args)
    return _TIMES.timed(batch.batch_size(), round_fn, *args)
