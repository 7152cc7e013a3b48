"""sglang_kdtree/host_times.py: the decode round's host time inside the worker and around it."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from sglang_kdtree import host_times


class _Clock:
    """A clock the test advances by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_inside_and_outside_against_a_hand_timeline(tmp_path):
    """Rounds of 2 requests: inside 3, 5, 4 ms with 1 and 2 ms between them, then a round of 3 (no pair: another
    batch size) and one of 2 after an idle second (no pair: too long a gap)."""
    clock, path = _Clock(), tmp_path / "t.json"
    times = host_times.HostTimes(str(path), clock=clock)
    for bs, gap, inside in ((2, 0.0, 3e-3), (2, 1e-3, 5e-3), (2, 2e-3, 4e-3), (3, 1e-3, 6e-3), (2, 1.0, 7e-3)):
        clock.now += gap

        def work(inside=inside):
            clock.now += inside
            return "result"

        assert times.timed(bs, work) == "result"
    got = times.summary()
    assert got["2"]["rounds"] == 4 and got["2"]["inside_ms"] == pytest.approx(4.5)
    assert got["2"]["outside_ms"] == pytest.approx(1.5) and got["2"]["period_ms"] == pytest.approx(6.0)
    assert got["3"] == {"rounds": 1, "inside_ms": pytest.approx(6.0), "outside_ms": None, "period_ms": None}
    times.flush()
    assert json.loads(path.read_text())["2"]["rounds"] == 4


def test_a_round_that_raises_is_timed_and_the_error_goes_on():
    clock = _Clock()
    times = host_times.HostTimes(None, clock=clock)

    def fails():
        clock.now += 2e-3
        raise RuntimeError("round failed")

    with pytest.raises(RuntimeError, match="round failed"):
        times.timed(1, fails)
    assert times.summary()["1"]["inside_ms"] == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(3))
def test_medians_over_random_rounds_and_the_file_is_rewritten_every_flush(tmp_path, seed, monkeypatch):
    rnd, clock, path = random.Random(seed), _Clock(), tmp_path / "t.json"
    monkeypatch.setattr(host_times, "FLUSH_EVERY", 10)
    times = host_times.HostTimes(str(path), clock=clock)
    insides, outsides = [], []
    for n in range(25):
        gap, inside = rnd.uniform(1e-4, 0.1), rnd.uniform(1e-4, 0.05)
        clock.now += gap
        if n:
            outsides.append(gap)
        insides.append(inside)
        times.timed(8, lambda inside=inside: setattr(clock, "now", clock.now + inside))
    on_disk = json.loads(path.read_text())["8"]  # written at round 20, not 25
    assert on_disk["rounds"] == 20
    assert on_disk["inside_ms"] == pytest.approx(1e3 * statistics.median(insides[:20]))
    got = times.summary()["8"]
    assert got["outside_ms"] == pytest.approx(1e3 * statistics.median(outsides))
    assert got["period_ms"] == pytest.approx(1e3 * statistics.median(i + o for i, o in zip(insides[1:], outsides)))


def test_off_by_default_the_round_runs_untouched(monkeypatch):
    monkeypatch.setattr(host_times, "_TIMES", host_times.HostTimes(None))

    class NoBatchSize:  # timing off: the batch is not even asked its size
        pass

    assert host_times.timed(NoBatchSize(), lambda x: x + 1, 41) == 42
    assert host_times._TIMES.summary() == {}
