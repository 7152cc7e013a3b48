"""sglang_kdtree/server/host_times.py and patches/scheduler_loop_times.py: a decode round's host time, step by step of
SGLang's scheduler loop."""

from __future__ import annotations

import json
import random
import statistics
from types import SimpleNamespace

import pytest

from sglang_kdtree.server import host_times
from sglang_kdtree.patches import scheduler_loop_times


class _Clock:
    """A clock the test advances by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def spend(self, seconds):
        def work(*args, **kwargs):
            self.now += seconds
            return args, kwargs
        return work


def _pass(times, clock, bs, steps, idle=0.0):
    """One pass of the loop: ``steps`` is ``[(step, seconds, {part: seconds})]`` in order, then ``idle`` seconds
    of the loop's own lines; ``bs`` None for a pass that launches no decode round."""
    times.begin_pass()
    for step, seconds, parts in steps:
        def work(seconds=seconds, parts=parts):
            for part, inner in parts.items():
                times.timed(part, clock.spend(inner))
            clock.now += seconds - sum(parts.values())
        times.timed(step, work)
        if step == "launch" and bs is not None:
            times.launched_decode(bs)
    clock.now += idle


def test_steps_parts_and_other_against_a_hand_timeline(tmp_path):
    """Three passes at batch 2, one prefill pass (no decode: left out), one at batch 3, one after an idle second
    (too long: left out); the pass after the last one only ends it."""
    clock, path = _Clock(), tmp_path / "t.json"
    times = host_times.LoopTimes(str(path), clock=clock)
    for launch, worker, wait in ((3e-3, 2e-3, 1e-3), (5e-3, 4e-3, 0.0), (4e-3, 3e-3, 2e-3)):
        _pass(times, clock, 2, [("ingest", 1e-4, {}), ("schedule", 5e-4, {}), ("launch", launch, {"worker": worker}),
                                ("process", 2e-3, {"wait": wait}), ("sample", 1e-4, {})], idle=3e-4)
    _pass(times, clock, None, [("ingest", 1e-4, {}), ("launch", 9e-3, {})])
    _pass(times, clock, 3, [("launch", 6e-3, {"worker": 5e-3})], idle=1e-3)
    _pass(times, clock, 2, [("launch", 6e-3, {})], idle=1.0)
    times.begin_pass()
    got = times.summary()
    assert set(got) == {"2", "3"} and got["2"]["rounds"] == 3
    two = got["2"]
    assert two["launch_ms"] == pytest.approx(4.0) and two["worker_ms"] == pytest.approx(3.0)
    assert two["process_ms"] == pytest.approx(2.0) and two["wait_ms"] == pytest.approx(1.0)
    assert two["ingest_ms"] == pytest.approx(0.1) and two["schedule_ms"] == pytest.approx(0.5)
    assert two["sample_ms"] == pytest.approx(0.1) and two["other_ms"] == pytest.approx(0.3)
    assert two["period_ms"] == pytest.approx(0.1 + 0.5 + 4.0 + 2.0 + 0.1 + 0.3)
    assert two["period_mean_ms"] == pytest.approx(0.1 + 0.5 + 4.0 + 2.0 + 0.1 + 0.3)
    three = got["3"]
    assert three["rounds"] == 1 and three["period_ms"] == pytest.approx(7.0) and three["other_ms"] == pytest.approx(1.0)
    assert three["period_mean_ms"] == pytest.approx(7.0)
    assert three["process_ms"] == 0.0 and three["wait_ms"] == 0.0
    times.flush()
    assert json.loads(path.read_text())["2"]["rounds"] == 3


def test_a_step_that_raises_is_timed_and_the_error_goes_on():
    clock = _Clock()
    times = host_times.LoopTimes(None, clock=clock)
    times.begin_pass()

    def fails():
        clock.now += 2e-3
        raise RuntimeError("round failed")

    with pytest.raises(RuntimeError, match="round failed"):
        times.timed("launch", fails)
    times.launched_decode(1)
    times.begin_pass()
    assert times.summary()["1"]["launch_ms"] == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(3))
def test_medians_over_random_passes_and_the_file_is_rewritten_every_flush(tmp_path, seed, monkeypatch):
    rnd, clock, path = random.Random(seed), _Clock(), tmp_path / "t.json"
    monkeypatch.setattr(host_times, "FLUSH_EVERY", 10)
    times = host_times.LoopTimes(str(path), clock=clock)
    launches, periods = [], []
    for _ in range(25):
        launch, idle = rnd.uniform(1e-4, 0.05), rnd.uniform(1e-4, 0.1)
        _pass(times, clock, 8, [("launch", launch, {})], idle=idle)
        launches.append(launch)
        periods.append(launch + idle)
    times.begin_pass()
    on_disk = json.loads(path.read_text())["8"]  # written at pass 20, not 25
    assert on_disk["rounds"] == 20
    assert on_disk["launch_ms"] == pytest.approx(1e3 * statistics.median(launches[:20]))
    got = times.summary()["8"]
    assert got["rounds"] == 25 and got["period_ms"] == pytest.approx(1e3 * statistics.median(periods))
    assert got["period_mean_ms"] == pytest.approx(1e3 * statistics.fmean(periods))
    assert got["other_ms"] == pytest.approx(1e3 * statistics.median(p - x for p, x in zip(periods, launches)))


def test_a_new_batch_size_puts_the_last_one_on_file(tmp_path):
    clock, path = _Clock(), tmp_path / "t.json"
    times = host_times.LoopTimes(str(path), clock=clock)
    for bs in (32, 32, 1):
        _pass(times, clock, bs, [("launch", 1e-3, {})])
    times.begin_pass()  # ends the pass at batch 1: the 32s are written before it is kept
    assert json.loads(path.read_text()) == {"32": pytest.approx(times.summary()["32"])}


def test_off_by_default_the_round_runs_untouched_and_nothing_is_hooked(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(host_times, "LOOP", host_times.LoopTimes(None))
    assert host_times.timed(lambda x: x + 1, 41) == 42
    assert host_times.LOOP.summary() == {}
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    scheduler_loop_times.register()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before


def test_the_hooks_time_a_loop_of_fake_scheduler_calls(monkeypatch, tmp_path):
    """The AROUND hooks as the registry calls them, ``hook(original, *args)``, over two passes of a fake loop at
    tensor-parallel rank 1: each returns SGLang's result, the decode launch names the batch size, and the result's
    ``copy_done`` is timed when ``synchronize()`` is called on it while its other attributes stay the event's."""
    import sglang.srt.runtime_context as runtime

    clock = _Clock()
    monkeypatch.setattr(host_times, "LOOP", host_times.LoopTimes(str(tmp_path / "t.json"), clock=clock))
    monkeypatch.setattr(runtime, "get_parallel", lambda: SimpleNamespace(tp_rank=1))
    hooks = {t.rsplit(".", 1)[1]: h for t, h in scheduler_loop_times.hooks().items()}
    assert set(hooks) == set(scheduler_loop_times.STEPS)
    event = SimpleNamespace(synchronize=clock.spend(4e-3), query=lambda: True)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), batch_size=lambda: 4)
    scheduler = object()
    results = []
    for _ in range(2):
        hooks["ingest_requests"](clock.spend(1e-4), scheduler)
        hooks["get_next_batch_to_run"](clock.spend(1e-3), scheduler)

        def run(scheduler, batch):
            host_times.timed(clock.spend(2e-3))  # the worker's round inside run_batch
            clock.now += 1e-3
            return SimpleNamespace(copy_done=event)

        result = hooks["run_batch"](run, scheduler, batch)
        assert isinstance(result.copy_done, host_times.TimedWait) and result.copy_done.query() is True
        results.append(result)
        hooks["process_batch_result"](lambda s, b, r: r.copy_done.synchronize(), scheduler, batch, result)
        hooks["launch_batch_sample_if_needed"](clock.spend(2e-4), scheduler, result, batch)
    host_times.LOOP.begin_pass()
    assert host_times.LOOP.path == str(tmp_path / "t.json.tp1")  # the first pass asked SGLang for the rank
    got = host_times.LOOP.summary()["4"]
    assert got["rounds"] == 2
    assert got["launch_ms"] == pytest.approx(3.0) and got["worker_ms"] == pytest.approx(2.0)
    assert got["process_ms"] == pytest.approx(4.0) and got["wait_ms"] == pytest.approx(4.0)
    assert got["period_ms"] == pytest.approx(0.1 + 1.0 + 3.0 + 4.0 + 0.2)


def test_each_tensor_parallel_rank_writes_its_own_file(tmp_path):
    path = tmp_path / "t.json"
    rank0, rank1 = host_times.LoopTimes(str(path)), host_times.LoopTimes(str(path))
    for rank, times in enumerate((rank0, rank1)):
        times.bind_rank(rank)
        times.bind_rank(rank)  # once: a later call does not add another suffix
    assert rank0.path == str(path) and rank1.path == f"{path}.tp1" and rank1.bound
    assert host_times.LoopTimes(None).path is None


def _row(**ms):
    return {"rounds": 10, **{f"{c}_ms": ms.get(c, 0.0) for c in host_times.COLUMNS}}


def test_the_table_has_rows_by_batch_then_server_and_extra_columns_last():
    found = {"plain": {"4": dict(_row(period=3.0), loop_ms=1.0), "1": dict(_row(period=2.0), loop_ms=0.5)},
             "kdtree-overlap": {"1": dict(_row(period=9.0, worker=7.0), loop_ms=2.0)}}
    lines = host_times.format_table(found, extra=("loop",)).splitlines()  # as the host-loop bench printed it
    assert ([line.split(" | ")[:2] for line in lines[2:]]
            == [["| 1", "plain"], ["| 1", "kdtree-overlap"], ["| 4", "plain"]])
    assert lines[3].startswith("| 1 | kdtree-overlap | 10 | 9.000 |") and lines[3].endswith("| 2.000 |")


def test_the_rounds_own_steps_are_host_clock_medians_of_the_rounds_that_have_them(monkeypatch):
    """``round_steps``: the KDTREE round's marks, read on the host clock only, go into the pass in progress; per batch
    size their medians sit beside the columns, over the rounds that carry them (a plain server's rounds carry
    none), and the table shows them beside ``worker``."""
    from sglang_kdtree.round.log import RoundMarks

    clock = _Clock()
    times = host_times.LoopTimes("unused", clock=clock)
    monkeypatch.setattr(host_times, "LOOP", times)
    rng = random.Random(5)
    drawn = {"draft": [], "verify": []}
    for n in range(5):
        times.begin_pass()

        def round_fn(n=n):
            marks = RoundMarks("cuda", enabled=True, device_clock=False)  # no event: nothing here has a GPU
            marks._clock = clock
            marks._marks[0] = ("start", clock(), clock())
            for name in ("draft", "verify"):
                seconds = rng.uniform(1e-4, 3e-3)
                drawn[name].append(seconds * 1e3)
                clock.now += seconds
                marks.mark(name)
            host_times.round_steps(marks)
            clock.now += 5e-4  # the round's result, after its last mark

        times.timed("launch", lambda: times.timed("worker", round_fn))
        times.launched_decode(4)
    _pass(times, clock, 4, [("launch", 2e-3, {"worker": 1e-3})])  # a round that marked nothing
    times.begin_pass()
    row = times.summary()["4"]
    assert row["rounds"] == 6
    for name, values in drawn.items():
        assert row["round_steps_ms"][name] == pytest.approx(statistics.median(values))
    # the round's own time outside its marks: the worker's extra 0.5 ms a round
    assert row["round_steps_ms"]["unmarked"] == pytest.approx(0.5)
    table = host_times.format_round_steps({"kdtree": {"4": row}, "plain": {"4": {"worker_ms": 0.0, "rounds": 3}}})
    lines = table.splitlines()
    assert lines[0] == "| batch | server | worker ms | draft ms | verify ms | unmarked ms |" and len(lines) == 3
    assert lines[2].startswith(f"| 4 | kdtree | {row['worker_ms']:.3f} | {row['round_steps_ms']['draft']:.3f} |")
    assert host_times.format_round_steps({"plain": {"4": {"worker_ms": 0.0, "rounds": 3}}}) == ""


def test_round_steps_off_by_default_and_the_host_only_marks_make_no_cuda_event(monkeypatch):
    from sglang_kdtree.round.log import RoundMarks

    monkeypatch.setattr(host_times, "LOOP", host_times.LoopTimes(None))
    marks = RoundMarks("cuda", enabled=True, device_clock=False, events=None)
    marks.mark("draft")
    assert marks._events == [] and set(marks.host_ms()) == {"draft"} and marks.host_ms()["draft"] >= 0
    host_times.round_steps(marks)
    assert host_times.LOOP.summary() == {}
    assert RoundMarks("cpu", enabled=False).host_ms() == {}
