"""The names of the servers the benches and the testbed start, and what a name says about its server.

``plain`` and ``dflash`` are SGLang's own; a KDTREE server is ``kdtree`` plus a tail: ``kdtree-63`` pins budget 63
(verify width 64), ``kdtree-auto*`` chooses the width per round, other tails (``-log``, ``-nomla``, ...) keep the
bench's ``--budget``; a trailing ``-overlap`` puts any of them on SGLang's overlap scheduler.
"""

from __future__ import annotations

#: a KDTREE kind ending in this runs on SGLang's overlap scheduler (``kdtree-63-overlap``); the others without it
OVERLAP_SUFFIX = "-overlap"


def overlapped(kind: str) -> bool:
    return kind.startswith("kdtree") and kind.endswith(OVERLAP_SUFFIX)


def pinned_budget(kind: str) -> int | None:
    """The budget a kind's name pins: ``kdtree-15`` and ``kdtree-15-overlap`` -> 15; None for every other kind."""
    if not kind.startswith("kdtree-"):
        return None
    tail = kind.removesuffix(OVERLAP_SUFFIX).split("-", 1)[1]
    return int(tail) if tail.isdigit() else None


def chooses_width(kind: str) -> bool:
    """A ``kdtree-auto*`` server: no pinned width, chosen per round."""
    return kind.removesuffix(OVERLAP_SUFFIX).startswith("kdtree-auto")
