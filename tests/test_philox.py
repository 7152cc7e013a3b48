"""``tests/philox.py`` (the test-only Philox the GPU sampled-accept test checks the kernel's draws with) against
Random123's known-answer vectors for Philox4x32-10 (its ``kat_vectors``)."""

import pytest

from philox import KDTREE_STREAM_TAG, kdtree_uniform64, philox4x32_10


@pytest.mark.parametrize(("counter", "key", "want"), [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_known_answers(counter, key, want):
    assert philox4x32_10(counter, key) == want


def test_kdtree_uniform_splits_seed_and_position_into_words():
    seed, position = -2, (1 << 32) + 7  # a negative seed: its two's-complement words
    x, y, _, _ = philox4x32_10((0, 7, 1, KDTREE_STREAM_TAG), (0xFFFFFFFE, 0xFFFFFFFF))
    assert kdtree_uniform64(seed, position) == (x << 32) | y
    assert kdtree_uniform64(seed, position) != kdtree_uniform64(seed, position + 1)
