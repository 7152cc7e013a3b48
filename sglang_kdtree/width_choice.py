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
* **The round's time** at each tier: the host wall time of the whole round (drafter, tree, verify forward,
  accept, commit; the round ends with a host read of its error flags, so the device work is inside it), per cell
  of batch size (next power of two, as SGLang pads graph batches) and context (mean committed length, next power
  of two). A cell that has not timed a tier yet verifies at that tier (exploration: exact like any other width;
  its first round per cell is discarded as warm-up: graph captures); every ``REFRESH_ROUNDS`` rounds of a cell,
  its stalest tier is timed again.

The choice is ``widths.best_width`` of those two. ``policy="cycle"`` instead steps through the tiers round by round
(tests and diagnostics: outputs must not depend on the width). One tier: that width, always.

``record`` issues the round's statistics as one small non-blocking device-to-host copy; ``settle`` reads them
once the round's own host read has passed (nothing waits for them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from sglang_kdtree.widths import best_width, realised_accepts

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

    def __init__(self, tiers, policy: str = "auto", device="cpu", log_stats: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"KDTREE: {POLICY_ENV}={policy!r} is not one of {', '.join(POLICIES)}")
        self.tiers = tuple(sorted(int(w) for w in tiers))
        self.policy = policy
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
        self._pending: list = []  # (host buffer, event, round info) not yet settled
        self.last: dict = {}  # the latest settled round (the round log's fields)

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
        """Calibrated expected committed tokens per request at each tier, or None before any round settled."""
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

    def record(self, width: int, bs: int, prefix_sum: int, started: float, expected, accepted) -> None:
        """Issue the round's statistics: ``expected`` ``[bs, T]`` (``widths.expected_accepts``) and ``accepted``
        ``[bs, L+1]`` node indices, summed over the batch on the device and copied to the host without waiting."""
        self._rounds += 1
        if expected is None or not self.keep_stats:
            return
        realised = realised_accepts(accepted, self.tiers).to(torch.float32)
        stats = torch.stack([expected.sum(dim=0), realised.sum(dim=0)])  # [2, T]
        if stats.device.type == "cuda":
            host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host.copy_(stats, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = stats, None
        self._pending.append((host, event, (int(width), int(bs), int(prefix_sum), started)))

    def settle(self, ended: float | None = None) -> None:
        """Fold in every recorded round whose copy has landed (the worker calls it after the round's host read,
        so the latest one has); ``ended``: the host clock at the round's end (default now)."""
        ended = time.perf_counter() if ended is None else ended
        keep = []
        for host, event, info in self._pending:
            if event is not None and not event.query():
                keep.append((host, event, info))
                continue
            self._fold(host.tolist(), info, ended)
        self._pending = keep

    def _fold(self, stats, info, ended: float) -> None:
        width, bs, prefix_sum, started = info
        expected, realised = stats
        i = self.tiers.index(width)
        before = self.calibration()[i]  # the ratio this round's choice could have known
        self.last = {"width": width, "predicted": round(1.0 + before * (expected[i] / bs - 1.0), 4),
                     "predicted_raw": round(expected[i] / bs, 4), "realised": round(realised[i] / bs, 4),
                     "round_ms": round((ended - started) * 1e3, 4)}
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
        seconds = ended - started
        if width in cell.warm:
            old = cell.seconds.get(width)
            cell.seconds[width] = seconds if old is None else (1 - TIME_WEIGHT) * old + TIME_WEIGHT * seconds
            cell.timed_at[width] = cell.rounds
        else:
            cell.warm.add(width)
