"""``sglang_kdtree.server.sync_debug``: what it writes for torch's sync warnings, and that it leaves everything else as it was."""

from __future__ import annotations

import json
import warnings

import pytest

from sglang_kdtree.server import sync_debug


def _sync_here():
    warnings.warn("Warning: called a synchronizing CUDA operation (function warn_or_error_on_sync)", UserWarning)
    return _sync_here.__code__.co_firstlineno + 1


def test_each_sync_is_one_line_naming_the_calling_line(tmp_path):
    path = tmp_path / "syncs.jsonl"
    with sync_debug.record_syncs(str(path)):
        line = _sync_here()
        _sync_here()
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(records) == 2
    assert all(r["file"] == __file__ and r["line"] == line for r in records)
    assert sync_debug.SYNC_MESSAGE in records[0]["message"]


def test_other_warnings_pass_through_and_nothing_is_written_without_a_sync(tmp_path):
    path = tmp_path / "syncs.jsonl"
    with pytest.warns(DeprecationWarning, match="unrelated"):
        with sync_debug.record_syncs(str(path)):
            warnings.warn("unrelated", DeprecationWarning)
    assert not path.exists()


def test_watch_runs_the_round_as_it_is_when_off_or_without_cuda(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(sync_debug, "_PATH", None)
    assert sync_debug.watch(lambda *a: calls.append(a) or "result", 1, 2) == "result"
    monkeypatch.setattr(sync_debug, "_PATH", str(tmp_path / "syncs.jsonl"))
    monkeypatch.setattr(sync_debug.torch.cuda, "is_available", lambda: False)
    assert sync_debug.watch(lambda *a: calls.append(a) or "again", 3) == "again"
    assert calls == [(1, 2), (3,)] and not (tmp_path / "syncs.jsonl").exists()
