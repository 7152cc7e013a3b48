"""Test-only Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11)
in plain Python integers, written from the paper's round function: an independent computation of the draws
of the CUDA sampled accept (``sglang_kdtree/kernels/tree_accept.cu``). Checked against Random123's published
known-answer vectors in ``tests/test_philox.py``."""

from __future__ import annotations

MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)  # the key schedule's increments (golden ratio, sqrt(3) - 1)

#: The stream tag in the fourth counter word of every KDTREE draw ("kdtr")
KDTREE_STREAM_TAG = 0x6B647472


def philox4x32_10(counter, key) -> tuple[int, int, int, int]:
    """The four 32-bit output words for a 4-word counter and a 2-word key (ten rounds)."""
    c0, c1, c2, c3 = (int(x) & MASK32 for x in counter)
    k0, k1 = (int(x) & MASK32 for x in key)
    for _ in range(10):
        p0, p1 = _MULTIPLIERS[0] * c0, _MULTIPLIERS[1] * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + _WEYL[0]) & MASK32, (k1 + _WEYL[1]) & MASK32
    return c0, c1, c2, c3


def kdtree_uniform64(seed: int, position: int) -> int:
    """The 64-bit uniform the CUDA accept draws the token at absolute ``position`` of a request seeded ``seed``
    with (``reference.sampling.position_uniform``'s docstring): key = the int64 seed's low and high words,
    counter = (0, position low, position high, "kdtr"), the first two output words as one 64-bit integer."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    p = int(position) & 0xFFFFFFFFFFFFFFFF
    x, y, _, _ = philox4x32_10((0, p & MASK32, p >> 32, KDTREE_STREAM_TAG), (s & MASK32, s >> 32))
    return (x << 32) | y
