"""Verify-width tiers: which widths a server serves, and the choice among them.

A KDTREE server builds every round's tree at its largest budget and verifies a prefix of it. Best-first pops
nodes in non-increasing path score and every parent precedes its children, so the first ``n`` nodes of the
budget-``B`` tree are exactly the budget-``n`` tree (``reference.tree``): cutting never changes what DDTree would
have built, it only chooses how much of it the target verifies.

* ``parse_widths``: the tier set of ``SGLANG_KDTREE_VERIFY_WIDTHS`` (verify widths N = budget + 1, the root
  included), refused with a message naming the variable, the value and the fix.
* ``best_width``: the width with the most expected committed tokens per second (ties: the smaller width).
* ``expected_accepts`` / ``realised_accepts``: per request and tier, the drafter's expected accept length of the
  cut (a prefix sum over the whole tree) and the accept length the cut would have had (from the verified walk).

The server's online estimator (``width_choice.WidthChooser``) and the Kimi round model
(``benchmarks.kimi_round``) both choose with ``best_width``.
"""

from __future__ import annotations

from sglang_kdtree.state import DEFAULT_VERIFY_WIDTH, MAX_WIDTH

#: the tiers' environment variable: comma-separated verify widths, e.g. ``16,32,48,64``
WIDTHS_ENV = "SGLANG_KDTREE_VERIFY_WIDTHS"
#: tile-aligned tiers (multiples of 16 rows: the MoE and attention tiles), the smallest being DFLASH's 16 rows
DEFAULT_WIDTHS = (16, 32, 48, DEFAULT_VERIFY_WIDTH)
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


def expected_accepts(scores, num_nodes, tiers) -> "torch.Tensor":
    """Every request's expected accept length (bonus included) at each verify width of ``tiers``, under the
    drafter: ``1 + sum(exp(score_i))`` over the first ``w - 1`` nodes of its tree (``exp(score_i)`` is the
    drafter's probability that the walk reaches node ``i``, and the cut at ``w`` is the budget-``w - 1`` tree).
    ``scores`` ``[bs, N]`` float64 path scores (root in column 0), ``num_nodes`` ``[bs]``; returns ``[bs, T]``
    float32 on their device. A width past ``N`` counts the whole tree."""
    import torch

    bs, width = scores.shape
    reach = torch.exp(scores[:, 1:].to(torch.float32))
    node = torch.arange(1, width, device=scores.device)
    reach = torch.where(node[None, :] <= num_nodes[:, None], reach, torch.zeros((), device=scores.device))
    cum = torch.cat([torch.zeros((bs, 1), device=scores.device), torch.cumsum(reach, dim=1)], dim=1)
    # column by column from host ints: no host-to-device copy, so the GPU round can capture it in a CUDA graph
    return 1.0 + torch.stack([cum[:, min(int(w), width) - 1] for w in tiers], dim=1)


def realised_accepts(accepted, tiers) -> "torch.Tensor":
    """Every request's accept length (bonus included) had the round verified each width of ``tiers`` instead:
    the walk on a cut tree is the walk on the whole tree stopped at its first node past the cut (a node's verify
    logits depend on its ancestors only, which precede it), so it is the number of accepted node indices below
    ``w``. Exact for widths up to the verified one; a larger width's count is only a lower bound. ``accepted``
    ``[bs, L+1]`` node indices (-1 padded); returns ``[bs, T]`` int64."""
    import torch

    live = accepted >= 0
    return torch.stack([(live & (accepted < int(w))).sum(dim=1) for w in tiers], dim=1)
