"""Verify-width tiers: which widths a server serves, and the choice among them.

A KDTREE server builds every round's tree at its largest budget and verifies a prefix of it. Best-first pops
nodes in non-increasing path score and every parent precedes its children, so the first ``n`` nodes of the
budget-``B`` tree are exactly the budget-``n`` tree (``reference.tree``): cutting never changes what DDTree would
have built, it only chooses how much of it the target verifies.

* ``parse_widths``: the tier set of ``SGLANG_KDTREE_VERIFY_WIDTHS`` (verify widths N = budget + 1, the root
  included), refused with a message naming the variable, the value and the fix.
* ``best_width``: the width with the most expected committed tokens per second (ties: the smaller width).

The server's online estimator (``width_choice.WidthChooser``) and the Kimi round model
(``benchmarks/kimi_round.py``) both choose with ``best_width``.
"""

from __future__ import annotations

from sglang_kdtree.state import MAX_WIDTH

#: the tiers' environment variable: comma-separated verify widths, e.g. ``16,32,48,64``
WIDTHS_ENV = "SGLANG_KDTREE_VERIFY_WIDTHS"
#: tile-aligned tiers (multiples of 16 rows: the MoE and attention tiles), the smallest being DFLASH's 16 rows
DEFAULT_WIDTHS = (16, 32, 48, 64)
#: the most tiers one server captures verify graphs for (each costs graph memory and startup time)
MAX_TIERS = 8


def parse_widths(text: str | None, name: str = WIDTHS_ENV) -> tuple[int, ...]:
    """``"16,32,48,64"`` -> ``(16, 32, 48, 64)``; None or blank -> ``DEFAULT_WIDTHS``. ValueError naming ``name``
    for a non-integer, a width outside ``[2, MAX_WIDTH]``, a repeated width or more than ``MAX_TIERS``."""
    if text is None or not text.strip():
        return DEFAULT_WIDTHS
    fix = f"e.g. {name}={','.join(map(str, DEFAULT_WIDTHS))}"
    try:
        widths = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"KDTREE: {name}={text!r} is not a comma-separated list of integers; {fix}") from None
    bad = [w for w in widths if not 2 <= w <= MAX_WIDTH]
    if bad:
        raise ValueError(f"KDTREE: {name}={text!r}: verify width {bad[0]} is outside [2, {MAX_WIDTH}] (a width is "
                         f"the node budget + 1, the root included); {fix}")
    if len(set(widths)) != len(widths):
        raise ValueError(f"KDTREE: {name}={text!r} repeats a width; {fix}")
    if len(widths) > MAX_TIERS:
        raise ValueError(f"KDTREE: {name}={text!r} has {len(widths)} tiers; at most {MAX_TIERS} (each captures its "
                         f"own verify CUDA graphs); {fix}")
    return tuple(sorted(widths))


def best_width(tokens: dict, seconds: dict) -> int:
    """The width ``w`` maximising ``tokens[w] / seconds[w]`` (expected committed tokens per round over the round's
    time), over the widths both dicts hold with a positive time; ties go to the smaller width. ValueError when no
    width qualifies."""
    best, best_rate = None, None
    for w in sorted(tokens):
        t = seconds.get(w)
        if t is None or not t > 0:
            continue
        rate = tokens[w] / t
        if best_rate is None or rate > best_rate:
            best, best_rate = w, rate
    if best is None:
        raise ValueError(f"no width has both an expected token count and a positive time: {sorted(tokens)} / "
                         f"{sorted(seconds)}")
    return int(best)
