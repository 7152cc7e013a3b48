"""benchmarks/decode_log.py: SGLang's decode-log lines, parsed and summarised per running batch size."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from benchmarks import decode_log


def _line(running: int, tok_s: float, accept: float | None = None) -> str:
    spec = f"accept len: {accept:.2f}, accept rate: 0.01, " if accept is not None else ""
    return (f"[2026-12-05 04:47:01] Decode batch, #running-req: {running}, #token: 16801, token usage: 0.51, {spec}"
            f"cuda graph: True, gen throughput (token/s): {tok_s:.2f}, #queue-req: 0")


def test_a_speculative_and_a_plain_line_parse():
    assert decode_log.parse(_line(32, 9540.6, 1.98)) == [(32, 1.98, 9540.6)]
    assert decode_log.parse(_line(1, 712.16)) == [(1, 1.0, 712.16)]
    assert decode_log.parse("[2026-12-05] INFO: POST /generate 200 OK") == []


@pytest.mark.parametrize("seed", range(3))
def test_medians_keep_only_full_batches_after_their_first_line(seed):
    """Against a direct computation: per size, every line that follows a line of the same size."""
    rnd = random.Random(seed)
    rows, expect = [], {1: [], 8: []}
    for bs in (1, 8, 1, 8):
        n = rnd.randint(1, 6)
        values = [(rnd.uniform(1, 4), rnd.uniform(100, 9000)) for _ in range(n)]
        rows += [(bs, a, t) for a, t in values]
        expect[bs] += values[1:]
        rows += [(bs - 1, 2.0, 5.0)] if bs > 1 else []  # the batch draining: a smaller running count
    text = "\n".join(_line(r, t, a) for r, a, t in rows)
    got = decode_log.summarise(decode_log.parse(text), [1, 8, 32])
    for bs, kept in expect.items():
        if kept:
            assert got[str(bs)]["lines"] == len(kept)
            assert got[str(bs)]["tok_s"] == pytest.approx(statistics.median(t for _, t in kept), abs=0.01)
            assert got[str(bs)]["accept_len"] == pytest.approx(statistics.median(a for a, _ in kept), abs=0.01)
        else:
            assert str(bs) not in got
    assert "32" not in got


def test_reading_stops_at_the_first_profile_and_the_cli_writes_json(tmp_path, capsys):
    lines = [_line(1, 500.0, 3.0), _line(1, 600.0, 3.0), _line(1, 700.0, 3.0),
             "[2026-12-05 04:47:02] Profiling starts. Traces will be saved to: /tmp/x", _line(1, 10.0, 3.0)]
    (tmp_path / "kdtree-63.log").write_text("\n".join(lines))
    (tmp_path / "plain.log").write_text("\n".join([_line(1, 700.0), _line(1, 720.0)]))
    out = tmp_path / "decode.json"
    assert decode_log.main([str(tmp_path), "--batches", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["servers"]
    assert data["kdtree-63"]["1"] == {"tok_s": 650.0, "accept_len": 3.0, "lines": 2}
    assert data["plain"]["1"]["tok_s"] == 720.0
    assert "| 1 | 650 (tau 3.00, 2 lines) | 720 (tau 1.00, 1 lines) |" in capsys.readouterr().out
    assert decode_log.main([str(tmp_path / "empty")]) == 1
