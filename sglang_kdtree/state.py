"""KDTREE's identity and the running process's round geometry, each declared once.

Read by the worker, the SGLang patches and the kernels' launchers; none of them declares a limit or compares
an algorithm name itself. Imports nothing heavy (no torch, no SGLang), so any module may import it.

* ``ALGORITHM_NAME``: what ``--speculative-algorithm kdtree`` resolves to in SGLang's registry.
* ``MAX_BUDGET`` / ``MAX_WIDTH``: the largest node budget B and verify width N = B + 1 (the kernels' shared
  memory trees and the verify masks are sized by them).
* ``Geometry``: one process's budget, draft block and vocabulary, and what follows from them (verify width,
  draft depths, the per-round KV reservation, the most tokens a round commits). The worker ``publish``es it
  once at startup; the patches read ``active()`` (None: this process runs no KDTREE worker).
"""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHM_NAME = "KDTREE"
#: Largest node budget the plugin supports.
MAX_BUDGET = 1024
#: Largest verify width N = budget + 1 (the root plus the tree's nodes).
MAX_WIDTH = MAX_BUDGET + 1
DEFAULT_BUDGET = 64
DEFAULT_VERIFY_WIDTH = DEFAULT_BUDGET + 1
#: Draft block sizes a DFlash drafter may have (L = block_size - 1 draft depths).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 2, 32


def is_kdtree(algorithm) -> bool:
    """Whether ``algorithm`` (SGLang's spec-algorithm object, anything with a ``name``, or a string such as
    ``--speculative-algorithm``'s value) is KDTREE."""
    name = getattr(algorithm, "name", algorithm)
    return isinstance(name, str) and name.upper() == ALGORITHM_NAME


@dataclass(frozen=True)
class Geometry:
    """One KDTREE worker's round geometry."""

    budget: int  # B: tree nodes per request
    block_size: int  # the drafter's block: the bonus token + L masked positions
    vocab_size: int | None = None  # the target's vocabulary (request admission checks)

    def __post_init__(self):
        if not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"KDTREE: node budget {self.budget} is outside [1, {MAX_BUDGET}]")
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"KDTREE: draft block size {self.block_size} is outside "
                             f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")

    @property
    def verify_width(self) -> int:
        """N = B + 1 rows per request in the verify forward."""
        return self.budget + 1

    @property
    def depths(self) -> int:
        """L = block_size - 1 draft positions (tree depths 1..L)."""
        return self.block_size - 1

    @property
    def kv_reserve(self) -> int:
        """KV slots a round writes past a request's committed length: the larger of its two windows from the
        same start, the draft block and the tree verify (``patches/decode_reserve.py``)."""
        return max(self.verify_width, self.block_size)

    @property
    def commit_width(self) -> int:
        """C = min(N, L + 1): the most tokens one round commits (an accepted path of at most ``min(B, L)`` draft
        nodes, then the bonus); the columns of the round's chain logprobs and accepted hidden rows."""
        return min(self.verify_width, self.block_size)


_active: Geometry | None = None


def publish(geometry: Geometry | None) -> None:
    """Make ``geometry`` this process's KDTREE geometry (the worker, at startup; None: none again)."""
    global _active
    _active = geometry


def active() -> Geometry | None:
    """This process's KDTREE geometry, or None when it runs no KDTREE worker."""
    return _active
