"""KDTREE's identity and the running process's round geometry, each declared once.

Read by the worker, the SGLang patches and the kernels' launchers; none of them declares a limit or compares
an algorithm name itself. Imports nothing heavy (no torch, no SGLang), so any module may import it.

* ``ALGORITHM_NAME``: what ``--speculative-algorithm kdtree`` resolves to in SGLang's registry.
* ``MAX_BUDGET`` / ``MAX_WIDTH``: the largest node budget B and verify width N = B + 1 (the kernels' shared
  memory trees and the verify masks are sized by them).
* ``Geometry``: one process's budget, verify-width tiers, draft block and vocabulary, and what follows from them
  (the largest verify width, draft depths, the per-round KV reservation, the most tokens a round commits). The
  worker ``publish``es it once at startup; the patches read ``active()`` (None: this process runs no KDTREE
  worker).
* ``RoundShape``: one round's shape (budget, verify width, K, depths, vocabulary, the tiers it predicts for),
  the one value every composition of the round's steps takes (``contract``).
"""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHM_NAME = "KDTREE"
#: Largest node budget the plugin supports.
MAX_BUDGET = 1024
#: Largest verify width N = budget + 1 (the root plus the tree's nodes).
MAX_WIDTH = MAX_BUDGET + 1
#: the largest default verify-width tier (``widths.DEFAULT_WIDTHS``): a tile-aligned 64 rows
DEFAULT_VERIFY_WIDTH = 64
DEFAULT_BUDGET = DEFAULT_VERIFY_WIDTH - 1
#: Draft block sizes a DFlash drafter may have (L = block_size - 1 draft depths).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 2, 32


def is_kdtree(algorithm) -> bool:
    """Whether ``algorithm`` (SGLang's spec-algorithm object, anything with a ``name``, or a string such as
    ``--speculative-algorithm``'s value) is KDTREE."""
    name = getattr(algorithm, "name", algorithm)
    return isinstance(name, str) and name.upper() == ALGORITHM_NAME


@dataclass(frozen=True)
class RoundShape:
    """One round's shape: the tree is built with ``budget`` nodes and the target verifies its first ``width`` rows
    (the root and the first ``width - 1`` nodes, which are exactly the budget-``width - 1`` tree: best-first pops
    every parent before its children). ``tiers``: the verify widths whose expected accept lengths the round
    reports (``widths.expected_accepts``)."""

    budget: int  # B: tree nodes per request
    width: int  # verify rows per request, <= B + 1
    depths: int  # L = draft block - 1
    vocab: int  # the drafter head's vocabulary
    tiers: tuple = ()

    def __post_init__(self):
        if not 2 <= self.width <= self.budget + 1:
            raise ValueError(f"KDTREE: verify width {self.width} is outside [2, budget + 1 = {self.budget + 1}]")
        if any(not 2 <= w <= self.budget + 1 for w in self.tiers):
            raise ValueError(f"KDTREE: tiers {self.tiers} must lie in [2, budget + 1 = {self.budget + 1}]")

    @property
    def k(self) -> int:
        """K = min(B, V): the per-depth top-K the tree is built from."""
        return min(self.budget, self.vocab)

    @property
    def full_width(self) -> int:
        """B + 1 rows: the whole tree."""
        return self.budget + 1

    @property
    def is_cut(self) -> bool:
        return self.width < self.full_width


@dataclass(frozen=True)
class Geometry:
    """One KDTREE worker's round geometry. ``widths``: the verify-width tiers the server chooses among per round
    (``widths.parse_widths``); empty: the one width ``budget + 1``."""

    budget: int  # B: tree nodes per request (the largest tier's)
    block_size: int  # the drafter's block: the bonus token + L masked positions
    vocab_size: int | None = None  # the target's vocabulary (request admission checks)
    widths: tuple = ()

    def __post_init__(self):
        if not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"KDTREE: node budget {self.budget} is outside [1, {MAX_BUDGET}]")
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"KDTREE: draft block size {self.block_size} is outside "
                             f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        if self.widths and (max(self.widths) != self.budget + 1 or min(self.widths) < 2):
            raise ValueError(f"KDTREE: verify widths {self.widths} must lie in [2, budget + 1] and include "
                             f"budget + 1 = {self.budget + 1}")

    @property
    def verify_width(self) -> int:
        """N = B + 1: the largest verify width (rows per request; the round's KV window and result stride)."""
        return self.budget + 1

    @property
    def tiers(self) -> tuple:
        """The verify widths a round may use, ascending (one: the width is pinned)."""
        return tuple(sorted(self.widths)) if self.widths else (self.verify_width,)

    def shape(self, width: int | None = None) -> RoundShape:
        """The round shape verifying ``width`` rows (default the largest) of a budget-B tree."""
        if self.vocab_size is None:
            raise ValueError("KDTREE: a round shape needs the geometry's vocab_size")
        return RoundShape(self.budget, int(width or self.verify_width), self.depths, int(self.vocab_size), self.tiers)

    @property
    def depths(self) -> int:
        """L = block_size - 1 draft positions (tree depths 1..L)."""
        return self.block_size - 1

    @property
    def kv_reserve(self) -> int:
        """KV slots a round writes past a request's committed length: the larger of its two windows from the
        same start, the draft block and the tree verify (``sglang_kdtree/patches/decode_reserve.py``)."""
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
