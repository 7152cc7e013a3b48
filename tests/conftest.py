"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA device (or CuPy) is present."""

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
