"""benchmarks/topk_floor.py on a CPU machine: its probe kernels (an empty kernel and the four streaming reads)
compile with NVRTC and keep the entries the CLI launches, and the CLI's options parse without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("topk_floor", REPO / "benchmarks" / "topk_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_kernels_compile_with_the_launched_entries():
    mod = _module()
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    prog = nvrtc.createProgram(mod._PROBE, "topk_floor.cu", [], [])
    nvrtc.compileProgram(prog, ["-arch=compute_90", "--std=c++17"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for name in ["probe_empty"] + [f"probe_read{n}" for n in mod._LOADS]:
        assert f".entry {name}(" in ptx


def test_cli_help_needs_no_gpu(capsys):
    mod = _module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--batches" in out and "--budgets" in out and "--calls" in out


def test_graph_replay_us_divides_by_every_call_it_replays(monkeypatch):
    """``bench_timing.graph_replay_us`` (topk_floor's, topk_ab's and bench_mla_attention's graph timer): a graph
    of ``repeat`` calls, ``replays`` replays per timed pass, per-call time = pass time / (replays x repeat). The
    CUDA parts are stood in for."""
    from sglang_kdtree.cli import bench_timing

    captured, replayed = [], []

    class Graph:
        def replay(self):
            replayed.append(1)

    monkeypatch.setattr(bench_timing, "capture_graph", lambda fn, repeat=1: (captured.append(repeat), (Graph(), None))[1])

    def fake_cuda_time_us(run, calls=1, trials=5, **kw):
        run()
        return 60.0 / calls  # a pass "took" 60 us

    monkeypatch.setattr(bench_timing, "cuda_time_us", fake_cuda_time_us)
    assert bench_timing.graph_replay_us(lambda: None) == 60.0 / 20 and len(replayed) == 20
    assert bench_timing.graph_replay_us(lambda: None, repeat=4, replays=1, trials=5) == 15.0
    assert captured == [1, 4]
