"""``WidthChooser``: the verify width of each round, from what earlier rounds measured.

Per round, before the tree exists, the worker asks ``choose(bs, prefix_sum)`` for a width among the server's tiers
(``widths.parse_widths``) and the chooser answers from the statistics of earlier rounds only, so the choice adds
no host synchronisation:

* **Expected tokens per round** at each tier: the drafter's expected accept length of the cut
  (``widths.expected_accepts``, a prefix sum over the whole tree), averaged per request over recent rounds, then
  **calibrated** against the realised accept lengths: ``1 + c_w * (expected_w - 1)``, where ``c_w`` is the ratio of
  realised to expected accepted draft tokens at width ``w`` (decayed sums). A round verified at width ``v`` tells
  the exact accept length of every cut ``w <= v`` (``widths.realised_accepts``), so the smallest tier is always
  calibrated; a tier wider than any verified one borrows the ratio of the widest calibrated tier.
* **The round's time** at each tier: the round from its start to its result (drafter, tree, verify forward,
  accept, commit), on the device's own clock on CUDA (a pair of timing events around the round's work, so the
  host never waits to time it) and on the host clock on CPU (where every op has finished when it returns), per
  cell of batch size (next power of two, as SGLang pads graph batches) and context (mean committed length, next
  power of two). A cell that has not timed a tier yet verifies at that tier (exploration: exact like any other
  width; its first round per cell is discarded as warm-up: graph captures); every ``REFRESH_ROUNDS`` rounds of a
  cell, its stalest tier is timed again.

The choice is ``widths.best_width`` of those two. ``policy="cycle"`` instead steps through the tiers round by round
(tests and diagnostics: outputs must not depend on the width). One tier: that width, always.

``$SGLANG_KDTREE_WIDTH_STATED_TAU`` (``STATED_TAU_ENV``; benches and tests only, never for serving) replaces the
expected tokens per round by a stated accept length per tier (``"16=6.0,32=6.5,64=7.0"``, width = tau): a target
with random weights accepts nothing and its drafter predicts nothing, so a bench on it judges the choice under
the served round times with an accept-length curve it states (``benchmarks/bench_rank.py``). Round times are
measured as always; outputs do not change (the width never changes them).

Statistics land late, and nothing waits for them: ``start`` marks a round's start, ``record`` issues the round's
statistics as one small non-blocking device-to-host copy into a ring of pinned buffers and marks its end, and
``settle`` (called before each ``choose``) folds in, oldest first, the rounds whose end has passed on the
device. Under SGLang's overlap scheduler a choice therefore sees the rounds up to one or two before it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sglang_kdtree.round.widths import best_width, realised_accepts

#: the variable choosing the policy: ``auto`` (default) or ``cycle``
POLICY_ENV = "SGLANG_KDTREE_WIDTH_POLICY"
POLICIES = ("auto", "cycle")
#: per-round decay of the calibration and expected-accept statistics (a half-life of about 70 rounds)
DECAY = 0.99
#: pseudo-count (accepted draft tokens) of the prior ratio 1 (a calibrated drafter)
PRIOR_TOKENS = 4.0
#: weight of a new round time in a cell's running estimate
TIME_WEIGHT = 0.25
#: rounds of a cell between two re-timings of its stalest tier
REFRESH_ROUNDS = 256
#: benches and tests only: stated expected tokens per round by tier instead of the drafter's (module docstring)
STATED_TAU_ENV = "SGLANG_KDTREE_WIDTH_STATED_TAU"


def parse_stated_tau(text: str | None, tiers) -> dict | None:
    """``"16=6.0,32=6.5"`` -> ``{16: 6.0, 32: 6.5}`` covering exactly ``tiers``; None or blank -> None.
    ValueError naming ``STATED_TAU_ENV`` for a malformed entry, a tau below 1, or a tier set that differs."""
    if text is None or not text.strip():
        return None
    fix = f"e.g. {STATED_TAU_ENV}=" + ",".join(f"{w}={6 + i / 2:.1f}" for i, w in enumerate(sorted(tiers)))
    stated = {}
    for part in text.split(","):
        w, _, tau = part.partition("=")  # no "=": tau is "", which float() refuses
        try:
            width, value = int(w), float(tau)
        except ValueError:
            raise ValueError(f"KDTREE: {STATED_TAU_ENV}={text!r}: {part!r} is not WIDTH=TAU; {fix}") from None
        if not value >= 1.0:
            raise ValueError(f"KDTREE: {STATED_TAU_ENV}={text!r}: {part!r} needs a tau of at least 1; {fix}")
        stated[width] = value
    if sorted(stated) != sorted(int(w) for w in tiers):
        raise ValueError(f"KDTREE: {STATED_TAU_ENV}={text!r} states widths {sorted(stated)}, the server's verify "
                         f"widths are {sorted(int(w) for w in tiers)}; {fix}")
    return stated


def _bucket(x: float) -> int:
    """Next power of two >= x (>= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(float(x), 1.0))))


@dataclass
class _Cell:
    """Round times (seconds) of one (batch, context) cell by width, and when each was last timed."""

    seconds: dict = field(default_factory=dict)
    warm: set = field(default_factory=set)  # widths whose warm-up round has passed
    timed_at: dict = field(default_factory=dict)
    rounds: int = 0


class WidthChooser:
    """The per-round width choice of one worker (module docstring)."""

    def __init__(self, tiers, policy: str = "auto", device="cpu", log_stats: bool = False, timer=None,
                 stated_tau: dict | None = None):
        if policy not in POLICIES:
            raise ValueError(f"KDTREE: {POLICY_ENV}={policy!r} is not one of {', '.join(POLICIES)}")
        self.tiers = tuple(sorted(int(w) for w in tiers))
        self.policy = policy
        self.stated_tau = dict(stated_tau) if stated_tau else None
        self.device = torch.device(device)
        # one pinned width needs no statistics, except for the round log's record
        self.keep_stats = len(self.tiers) > 1 or log_stats
        t = len(self.tiers)
        self.expected_sum = [0.0] * t  # decayed sums, per request, of the drafter's expected accept length
        self.expected_n = 0.0
        self.pred_tokens = [0.0] * t  # decayed sums of expected accepted draft tokens, rounds where w was verified
        self.real_tokens = [0.0] * t  # ... and of the realised ones
        self._cells: dict = {}
        self._rounds = 0
        self._pending: deque = deque()  # (timer ticket, round info) recorded, not yet folded in, oldest first
        self.last: dict = {}  # the latest settled round (the round log's fields)
        if timer is None:
            timer = DeviceTimer(self.device, t) if self.device.type == "cuda" and self.keep_stats else HostTimer()
        self._timer = timer

    @property
    def per_rank(self) -> bool:
        """Whether the choice depends on this process's own round times (automatic, several tiers), so ranks of
        one TP group could choose differently; a single tier or ``cycle`` is chosen alike everywhere."""
        return self.policy == "auto" and len(self.tiers) > 1

    # -- estimates -------------------------------------------------------------------------------------------

    def calibration(self) -> list:
        """``c_w`` per tier: realised / expected accepted draft tokens (prior 1); an uncalibrated tier borrows the
        widest calibrated tier's ratio."""
        ratios, borrowed = [], 1.0
        for i in range(len(self.tiers)):
            if self.pred_tokens[i] > 0:
                borrowed = (self.real_tokens[i] + PRIOR_TOKENS) / (self.pred_tokens[i] + PRIOR_TOKENS)
            ratios.append(borrowed)
        return ratios

    def expected_tokens(self) -> dict | None:
        """Calibrated expected committed tokens per request at each tier, or None before any round settled; the
        stated accept lengths instead when the chooser was given some."""
        if self.stated_tau is not None:
            return dict(self.stated_tau)
        if self.expected_n <= 0:
            return None
        ratios = self.calibration()
        return {w: 1.0 + ratios[i] * (self.expected_sum[i] / self.expected_n - 1.0) for i, w in enumerate(self.tiers)}

    def _cell(self, bs: int, prefix_sum: int) -> tuple:
        return _bucket(bs), _bucket(prefix_sum / max(bs, 1))

    # -- the choice ------------------------------------------------------------------------------------------

    def choose(self, bs: int, prefix_sum: int) -> int:
        """The width of the round about to run (host only)."""
        if len(self.tiers) == 1:
            return self.tiers[0]
        if self.policy == "cycle":
            return self.tiers[self._rounds % len(self.tiers)]
        cell = self._cells.setdefault(self._cell(bs, prefix_sum), _Cell())
        untimed = [w for w in self.tiers if w not in cell.seconds]
        if untimed:
            return untimed[0]
        if cell.rounds and cell.rounds % REFRESH_ROUNDS == 0:
            return min(self.tiers, key=lambda w: cell.timed_at.get(w, -1))
        tokens = self.expected_tokens()
        if tokens is None:
            return self.tiers[0]
        return best_width(tokens, cell.seconds)

    # -- statistics ------------------------------------------------------------------------------------------

    def start(self):
        """Mark the start of the round about to run (after ``choose``); None when no statistics are kept."""
        return self._timer.start() if self.keep_stats else None

    def record(self, width: int, bs: int, prefix_sum: int, started, expected, accepted) -> None:
        """Issue the round's statistics: ``expected`` ``[bs, T]`` (``widths.expected_accepts``) and ``accepted``
        ``[bs, L+1]`` node indices, summed over the batch on the device and copied to the host without waiting;
        ``started``: what ``start`` returned (None: the round is counted, not measured)."""
        self._rounds += 1
        if expected is None or started is None:
            return
        realised = realised_accepts(accepted, self.tiers).to(torch.float32)
        stats = torch.stack([expected.sum(dim=0), realised.sum(dim=0)])  # [2, T]
        self._pending.append((self._timer.stop(started, stats), (int(width), int(bs), int(prefix_sum))))

    def settle(self, wait: bool = False) -> None:
        """Fold in, oldest first, every recorded round that has landed (its end has passed on the device), and
        stop at the first that has not; ``wait=True`` (diagnostics only) waits for every one."""
        while self._pending:
            ticket, info = self._pending[0]
            if not wait and not self._timer.ready(ticket):
                return
            self._timer.wait(ticket)
            self._pending.popleft()
            stats, seconds = self._timer.read(ticket)
            self._fold(stats, info, seconds)

    @property
    def pending(self) -> int:
        """Rounds recorded and not yet folded in."""
        return len(self._pending)

    def _fold(self, stats, info, seconds: float) -> None:
        width, bs, prefix_sum = info
        expected, realised = stats
        i = self.tiers.index(width)
        before = self.calibration()[i]  # the ratio this round's choice could have known
        self.last = {"width": width, "predicted": round(1.0 + before * (expected[i] / bs - 1.0), 4),
                     "predicted_raw": round(expected[i] / bs, 4), "realised": round(realised[i] / bs, 4),
                     "round_ms": round(seconds * 1e3, 4)}
        for i in range(len(self.tiers)):
            self.expected_sum[i] *= DECAY
            self.pred_tokens[i] *= DECAY
            self.real_tokens[i] *= DECAY
        self.expected_n = self.expected_n * DECAY + bs
        for i, w in enumerate(self.tiers):
            self.expected_sum[i] += expected[i]
            if w <= width:  # the realised length of a cut is exact up to the verified width
                self.pred_tokens[i] += expected[i] - bs
                self.real_tokens[i] += realised[i] - bs
        cell = self._cells.setdefault(self._cell(bs, prefix_sum), _Cell())
        cell.rounds += 1
        if width in cell.warm:
            old = cell.seconds.get(width)
            cell.seconds[width] = seconds if old is None else (1 - TIME_WEIGHT) * old + TIME_WEIGHT * seconds
            cell.timed_at[width] = cell.rounds
        else:
            cell.warm.add(width)


class HostTimer:
    """Round times on the host clock, statistics already on the host: a CPU server, where every op has finished
    when it returns."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float, stats: torch.Tensor):
        return stats, time.perf_counter() - started

    def ready(self, ticket) -> bool:
        return True

    def wait(self, ticket) -> None:
        pass

    def read(self, ticket) -> tuple[list, float]:
        stats_cpu, seconds = ticket
        return stats_cpu.tolist(), seconds


class DeviceTimer:
    """Round times on the device's clock (a pair of timing events) and statistics copied into pinned host
    buffers, in a ring of ``RING`` slots so nothing is allocated per round. A round that finds every slot still
    in flight is counted but not measured (``start`` returns None); a started round that never stopped (it
    raised and was retried) leaves its slot to the next ``start``."""

    RING = 8

    def __init__(self, device, tiers: int, event=None):
        device = torch.device(device)
        event = event or torch.get_device_module(device).Event  # the tests' stand-in: an object with the same calls
        pin = device.type == "cuda"
        self._slots = [(torch.empty((2, tiers), dtype=torch.float32, pin_memory=pin),
                        event(enable_timing=True), event(enable_timing=True)) for _ in range(self.RING)]
        self._free = deque(range(self.RING))
        self._open: int | None = None

    def start(self) -> int | None:
        if self._open is None:
            if not self._free:
                return None
            self._open = self._free.popleft()
        self._slots[self._open][1].record()
        return self._open

    def stop(self, slot: int, stats: torch.Tensor) -> int:
        host, _, end = self._slots[slot]
        host.copy_(stats, non_blocking=True)
        end.record()
        self._open = None
        return slot

    def ready(self, slot: int) -> bool:
        return self._slots[slot][2].query()

    def wait(self, slot: int) -> None:
        self._slots[slot][2].synchronize()

    def read(self, slot: int) -> tuple[list, float]:
        host, begin, end = self._slots[slot]
        out = host.tolist(), begin.elapsed_time(end) / 1e3
        self._free.append(slot)
        return out


def agreed_width(width: int, group) -> int:
    """Rank 0's width, on every rank of the tensor-parallel ``group`` (a CPU / gloo process group).

    Under TP every rank runs the same verify forward, so all must verify the same width. Each rank's chooser sees
    its own round times and, under overlap, its own set of settled rounds, so left alone the ranks could choose
    differently and their collectives would no longer match. A broadcast of one int64 between host processes; no
    device is involved."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return width
    choice = torch.tensor([width], dtype=torch.int64)
    dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
    return choice.tolist()[0]
