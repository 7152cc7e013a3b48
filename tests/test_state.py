"""``sglang_kdtree.state``: KDTREE's name, limits and the process's published round geometry, and the patches
that read it instead of the worker's module globals."""

from __future__ import annotations

import contextlib
import types

import pytest

from sglang_kdtree import state


def test_is_kdtree_accepts_sglang_algorithm_objects_and_flag_strings():
    assert state.is_kdtree(types.SimpleNamespace(name="KDTREE"))
    assert state.is_kdtree("kdtree") and state.is_kdtree("KDTREE")
    assert not state.is_kdtree(types.SimpleNamespace(name="DFLASH"))
    assert not state.is_kdtree(None) and not state.is_kdtree(types.SimpleNamespace())


def test_limits_are_declared_once():
    from sglang_kdtree.gpu import accept, compact, topk, tree, verify

    assert state.MAX_WIDTH == state.MAX_BUDGET + 1 == 1025
    assert tree.MAX_BUDGET is state.MAX_BUDGET and topk.MAX_BUDGET is state.MAX_BUDGET
    assert accept.MAX_WIDTH is state.MAX_WIDTH
    assert verify._MAX_WIDTH is state.MAX_WIDTH and compact._MAX_ROWS is state.MAX_WIDTH


@pytest.mark.parametrize("budget, block, reserve, commit", [(64, 16, 65, 16), (4, 16, 16, 5), (1, 2, 2, 2)])
def test_geometry_derives_the_round_widths(budget, block, reserve, commit):
    g = state.Geometry(budget=budget, block_size=block, vocab_size=100)
    assert g.verify_width == budget + 1 and g.depths == block - 1
    assert g.kv_reserve == reserve and g.commit_width == commit


@pytest.mark.parametrize("budget, block", [(0, 16), (state.MAX_BUDGET + 1, 16), (64, 1), (64, 33)])
def test_geometry_refuses_what_the_round_cannot_run(budget, block):
    with pytest.raises(ValueError, match="KDTREE"):
        state.Geometry(budget=budget, block_size=block)


def test_publish_and_active(monkeypatch):
    monkeypatch.setattr(state, "_active", None)
    assert state.active() is None
    g = state.Geometry(budget=8, block_size=4)
    state.publish(g)
    assert state.active() is g
    state.publish(None)
    assert state.active() is None


class _Spec:
    def __init__(self, width):
        self.speculative_num_draft_tokens = width
        self.seen = []

    @contextlib.contextmanager
    def override(self, **fields):
        old = self.speculative_num_draft_tokens
        self.speculative_num_draft_tokens = fields["speculative_num_draft_tokens"]
        try:
            yield
        finally:
            self.speculative_num_draft_tokens = old


@pytest.mark.parametrize("geometry, expect", [(None, 5), (state.Geometry(budget=4, block_size=16), 16),
                                              (state.Geometry(budget=64, block_size=16), 65)])
def test_decode_reserve_covers_both_windows_of_the_published_geometry(monkeypatch, geometry, expect):
    import sglang.srt.runtime_context as runtime_context

    from sglang_kdtree.patches import decode_reserve

    width = 5 if geometry is None else geometry.verify_width
    spec = _Spec(width)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    monkeypatch.setattr(state, "_active", geometry)
    seen = decode_reserve.prepare_for_decode(lambda self, batch: spec.speculative_num_draft_tokens, None, None)
    assert seen == expect and spec.speculative_num_draft_tokens == width
