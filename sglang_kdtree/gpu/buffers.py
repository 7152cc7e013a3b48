"""The grow-only capacity rule of the GPU path's reusable buffers (``GpuBackend``'s round storages and the round
graphs' static inputs): a buffer is reallocated only when a batch or context is larger than any before, so a
serving round allocates nothing once the largest shapes have been seen."""

from __future__ import annotations


def grown(current: int, needed: int) -> int:
    """Capacity after a grow-only resize: ``needed`` if it fits, else at least double (amortised, no per-round
    reallocation once the largest batch and context have been seen)."""
    return current if needed <= current else max(int(needed), 2 * int(current))
