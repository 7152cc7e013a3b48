"""Fixtures of the GPU top-K and tree tests that run a test once per kernel variant (set on the launcher
modules by monkeypatch)."""

import pytest


@pytest.fixture(params=["one group", "two groups"])
def groups(request, monkeypatch):
    """Runs a histogram top-K test twice: with the one-group kernels (8192-column chunks) and with the two-group
    ``*_g2`` kernels (16384-column chunks) forced for every aligned bf16 call (``topk.HIST_G2_MIN_BLOCKS``)."""
    from sglang_kdtree.gpu import topk

    monkeypatch.setattr(topk, "HIST_G2_MIN_BLOCKS", 0 if request.param == "two groups" else 1 << 62)
    return request.param


@pytest.fixture(params=["histogram", "cut"])
def topk_impl(request, monkeypatch):
    """Runs a top-K test with each pipeline (``SGLANG_KDTREE_TOPK_IMPL``: the default histogram select and the
    cut pipeline) for the workspaces the launcher builds itself."""
    from sglang_kdtree.gpu import topk

    monkeypatch.setattr(topk, "IMPL", request.param)
    return request.param


@pytest.fixture(params=["list", "slots"])
def tree_kernel(request, monkeypatch):
    """Runs a tree test twice: with the launcher's choice (the sorted-list kernels ``build_trees_list1/2/4``
    up to budget 256, the slot kernel above) and with the shared-memory slot kernel ``build_trees_kernel``
    forced at every budget (``tree.LIST_MAX_BUDGET = 0``)."""
    from sglang_kdtree.gpu import tree

    monkeypatch.setattr(tree, "LIST_MAX_BUDGET", 256 if request.param == "list" else 0)
    return request.param
