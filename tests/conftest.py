"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA device (or CuPy) is present; the terminal
summary counts the session's skips by reason (``skip_reasons``)."""

import pytest

from sglang_kdtree.gpu.runtime import gpu_unavailable_reason


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_verify_widths(monkeypatch):
    """The plugin's startup check writes the resolved verify widths into the process environment for the
    scheduler processes it spawns (``spec.resolve_widths``); each test resolves its own configuration."""
    from sglang_kdtree.round.widths import WIDTHS_ENV

    monkeypatch.delenv(WIDTHS_ENV, raising=False)
    monkeypatch.delenv("SGLANG_KDTREE_VERIFY_WIDTHS_RESOLVED", raising=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per skip reason group with its count (``skip_reasons.summary_lines``): "N skipped" alone does not
    say how many are the GPU tests and how many lack an optional tool or package."""
    from skip_reasons import write_summary

    write_summary(terminalreporter)
