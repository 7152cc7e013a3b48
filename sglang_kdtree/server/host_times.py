"""``KDTREE_HOST_TIMES``: where a decode round's host time goes in SGLang's scheduler loop, without a profiler.

On a host-paced target the GPU idles most of each round, so whether overlap scheduling pays is decided on the
host: overlap can hide only the device's tail after the host's last launch, and the overlapped loop does its own
host work per round. A profiler adds host cost to every CUDA call and so changes exactly what is measured; this
takes ``time.perf_counter()`` readings around the loop's steps instead, in any server (plain, DFLASH, KDTREE),
since the plugin loads in every scheduler process.

One pass of the scheduler loop (``Scheduler.event_loop_normal`` / ``event_loop_overlap``) runs from one
``ingest_requests`` call to the next. A pass that launches a decode batch is one decode round of that batch size,
and its time is split into the loop's steps (``patches/scheduler_loop_times.py`` wraps them):

* ``ingest``: ``ingest_requests`` (new requests, aborts);
* ``schedule``: ``get_next_batch_to_run`` (choosing the batch, KV allocation, ``prepare_for_decode``);
* ``launch``: ``run_batch`` (issuing the forward; ``worker``, part of it, is KDTREE's round inside
  ``forward_batch_generation``). Without overlap, a speculative round's ``run_batch`` also copies the new lengths
  to the host, which waits for the round's accept;
* ``process``: ``process_batch_result`` (appending tokens, finishing requests; ``wait``, part of it, is its wait
  for the result's device-to-host copy, ``copy_done``). With overlap it processes the previous round's result;
* ``sample``: ``launch_batch_sample_if_needed`` (overlap loop only);
* ``other``: the rest of the pass (the loop's own lines, logging, idle checks);
* ``period``: the whole pass.

A KDTREE server also splits ``worker`` by the round's own steps (``round_log.RoundMarks`` on the host clock only:
no event, no sync), as ``round_steps_ms`` beside the columns (``unmarked``: the round's host time outside its marks,
its start and its result): which step of the round grows when the loop changes (overlap off and on) is then read,
not guessed.

Off unless ``KDTREE_HOST_TIMES`` names a file (rank r > 0 of tensor parallelism writes that name + ``.tp<r>``);
then every ``FLUSH_EVERY`` rounds, when the batch size changes and at exit that file is rewritten with
``{batch size: {"rounds", "<column>_ms", ..., "period_mean_ms"}}``: per column, the median over the last ``WINDOW``
rounds of that size (medians do not add up to the period's), and the period's mean. A pass longer than
``MAX_GAP_S`` is idle time, not the loop, and is left out. Host wall time only: it runs on CPU servers too.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import time
from collections import deque

HOST_TIMES_ENV = "KDTREE_HOST_TIMES"
#: the loop's steps, in pass order; ``other`` is the pass less their sum
PHASES = ("ingest", "schedule", "launch", "process", "sample")
#: parts timed inside a step (not added again to ``other``): part -> the step it is inside
PARTS = {"worker": "launch", "wait": "process"}
COLUMNS = ("period",) + PHASES + tuple(PARTS) + ("other",)
#: ``COLUMNS`` in a table's reading order: each part beside the step it is inside
TABLE_COLUMNS = ("period", "schedule", "launch", "worker", "process", "wait", "ingest", "sample", "other")
#: rounds kept per batch size (the medians are over these)
WINDOW = 2048
#: rounds between two rewrites of the file
FLUSH_EVERY = 64
#: a longer pass is idle time or a stall, not the scheduler loop
MAX_GAP_S = 0.25


class LoopTimes:
    """Per batch size, the last ``WINDOW`` decode passes' step times; ``summary()`` gives their medians."""

    def __init__(self, path: str | None, clock=time.perf_counter):
        self.path, self.clock = path, clock
        self._rounds: dict[int, deque] = {}
        self._pass: dict | None = None  # the pass in progress: step -> seconds, plus "start" and "bs"
        self._last_bs: int | None = None
        self._since_flush = 0
        self.bound = False

    def bind_rank(self, rank: int) -> None:
        """The process's tensor-parallel rank, once: rank 0 writes the file named, rank r > 0 that name +
        ``.tp<r>`` (every rank runs the loop; one file each, not the last writer's)."""
        if self.path and not self.bound and rank:
            self.path = f"{self.path}.tp{rank}"
        self.bound = True

    def begin_pass(self) -> None:
        """A pass of the loop starts (``ingest_requests``): the one before it ends here."""
        now = self.clock()
        if self._pass is not None:
            self._end_pass(now)
        self._pass = dict.fromkeys(PHASES + tuple(PARTS), 0.0)
        self._pass.update(start=now, bs=None)

    def launched_decode(self, bs: int) -> None:
        """This pass launched a decode round of ``bs`` requests."""
        if self._pass is not None:
            self._pass["bs"] = bs

    def timed(self, step: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its wall time added to ``step`` of the pass in progress (also if it raises)."""
        start = self.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            if self._pass is not None:
                self._pass[step] += self.clock() - start

    def round_steps(self, steps: dict) -> None:
        """KDTREE's round in this pass, step by step (host ms, ``RoundMarks.host_ms``)."""
        if self._pass is not None:
            self._pass["steps"] = steps

    def _end_pass(self, now: float) -> None:
        done, self._pass = self._pass, None
        start, bs, steps = done.pop("start"), done.pop("bs"), done.pop("steps", None)
        period = now - start
        if bs is None or period >= MAX_GAP_S:
            return
        if self.path and self._last_bs is not None and self._last_bs != bs:
            self.flush()  # a stretch at one size has ended: on file before the server may be stopped
        done["period"] = period
        done["other"] = period - sum(done[step] for step in PHASES)
        if steps:  # ``unmarked``: the round's host time before its first mark and after its last
            done["steps"] = dict(steps, unmarked=1e3 * done["worker"] - sum(steps.values()))
        self._rounds.setdefault(bs, deque(maxlen=WINDOW)).append(done)
        self._last_bs = bs
        self._since_flush += 1
        if self.path and self._since_flush >= FLUSH_EVERY:
            self.flush()

    def summary(self) -> dict:
        out = {}
        for bs in sorted(self._rounds):
            rounds = self._rounds[bs]
            row = {"rounds": len(rounds)}
            row.update({f"{c}_ms": 1e3 * statistics.median(r[c] for r in rounds) for c in COLUMNS})
            # the mean too: a decode rate is tokens over the summed periods, which a median does not give
            row["period_mean_ms"] = 1e3 * statistics.fmean(r["period"] for r in rounds)
            stepped = [r["steps"] for r in rounds if "steps" in r]
            if stepped:
                names = dict.fromkeys(n for st in stepped for n in st)
                row["round_steps_ms"] = {n: statistics.median(st.get(n, 0.0) for st in stepped) for n in names}
            out[str(bs)] = row
        return out

    def flush(self) -> None:
        self._since_flush = 0
        if self.path and self._rounds:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.summary(), f, indent=1)
            os.replace(tmp, self.path)


def _by_batch(per_server: dict):
    """``(bs, server, row)`` of ``{server: {bs: summary row}}``, by batch size then server."""
    for bs in sorted({b for per_bs in per_server.values() for b in per_bs}, key=int):
        for server, per_bs in per_server.items():
            if bs in per_bs:
                yield bs, server, per_bs[bs]


def format_table(per_server: dict, extra: tuple = ()) -> str:
    """A markdown table of ``{server: {bs: summary row}}`` (the files' contents), rows by batch size then server,
    ms per round in ``TABLE_COLUMNS`` then ``extra`` (further ``<column>_ms`` keys of the rows); "-" for none."""
    cols = TABLE_COLUMNS + tuple(extra)
    lines = ["| batch | server | rounds | " + " | ".join(f"{c} ms" for c in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for bs, server, r in _by_batch(per_server):
        cells = [f"{r[f'{c}_ms']:.3f}" if r.get(f"{c}_ms") is not None else "-" for c in cols]
        lines.append(f"| {bs} | {server} | {r['rounds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_round_steps(per_server: dict) -> str:
    """A markdown table of the KDTREE rounds' steps (``round_steps_ms``) beside ``worker``, rows by batch size then
    server; "" when no server has them."""
    rows = [(bs, server, r) for bs, server, r in _by_batch(per_server) if "round_steps_ms" in r]
    if not rows:
        return ""
    names = list(dict.fromkeys(n for _, _, r in rows for n in r["round_steps_ms"]))
    lines = ["| batch | server | worker ms | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for bs, server, r in rows:
        steps = r["round_steps_ms"]
        lines.append(f"| {bs} | {server} | {r['worker_ms']:.3f} | " + " | ".join(
            f"{steps[n]:.3f}" if n in steps else "-" for n in names) + " |")
    return "\n".join(lines)


class TimedWait:
    """A result's ``copy_done`` event whose ``synchronize()`` counts as the pass's ``wait``; the rest is the
    event's own."""

    def __init__(self, event, times: LoopTimes):
        self._event, self._times = event, times

    def synchronize(self):
        return self._times.timed("wait", self._event.synchronize)

    def __getattr__(self, name):
        return getattr(self._event, name)


LOOP = LoopTimes(os.environ.get(HOST_TIMES_ENV) or None)
if LOOP.path:
    atexit.register(LOOP.flush)


def enabled() -> bool:
    return LOOP.path is not None


def timed(round_fn, *args):
    """``round_fn(*args)``, KDTREE's decode round; with ``KDTREE_HOST_TIMES`` set, timed as the pass's ``worker``."""
    if LOOP.path is None:
        return round_fn(*args)
    return LOOP.timed("worker", round_fn, *args)


def round_steps(marks) -> None:
    """The round's steps on the host clock (``marks``: its ``round_log.RoundMarks``) into the pass in progress."""
    if LOOP.path is not None:
        LOOP.round_steps(marks.host_ms())
