"""Test-only: start ``torch.empty`` CUDA outputs poisoned, for launchers that allocate their own outputs."""

from __future__ import annotations

_SMALL_BLOCK = 512 << 10  # PyTorch's caching allocator serves requests up to 1 MiB from its small pool


def poison_allocator(byte: int, large_bytes: int = 64 << 20, small_bytes: int = 64 << 20) -> None:
    """Fill the caching allocator's free blocks with ``byte``: one block of ``large_bytes`` from the large pool
    (requests over 1 MiB, best fit) and ``small_bytes`` of 512 KiB blocks from the small pool's 2 MiB segments, all
    held at once so that every small block already cached (free) is taken and filled before new segments are.
    A later request reuses poisoned memory unless the large pool holds another free block that fits it better."""
    import torch

    junk = [torch.full((large_bytes,), byte, dtype=torch.uint8, device="cuda")]
    junk += [torch.full((_SMALL_BLOCK,), byte, dtype=torch.uint8, device="cuda")
             for _ in range(small_bytes // _SMALL_BLOCK)]
    del junk
