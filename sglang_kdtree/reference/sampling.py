"""The target's sampling at a tree node: SGLang's top-k / top-p / min-p filters, the float64 weights, the
inverse-CDF draw, and the seeded-sampling rule (``position_uniform``) that keys a seeded request's uniforms by
absolute position."""

from __future__ import annotations

import numpy as np

from sglang_kdtree.reference._validate import _require_float, _require_no_nan


def filter_top_k_top_p(p, top_k: int | None = None, top_p: float | None = None,
                       min_p: float | None = None) -> np.ndarray:
    """SGLang's top-k / top-p / min-p filter of float64 probability rows ``[..., V]`` (one definition of the
    rules, used by ``sample_node_tokens``): order each row by probability (descending, equal probabilities
    lower token id first) and keep rank ``r`` iff

    * top-k: ``r < top_k``;
    * top-p: the mass of the ranks before it is ``<= top_p * (row mass)`` (torch's ``probs_sum - probs_sort >
      top_p`` zeroing, on a row that need not sum to 1);
    * min-p: its probability is ``>= min_p * (the row's largest probability)`` (SGLang's ``probs <
      probs_sort[:, 0] * min_ps`` zeroing; the top token passes top-k and top-p, so after them the largest
      probability is still the row max);

    zero the rest and renormalise. The kept set is the intersection of three prefixes of the sorted order,
    so the order in which SGLang applies the filters does not matter. ``None`` (or ``top_k >= V``,
    ``top_p >= 1``, ``min_p <= 0`` or NaN) leaves that filter off; ``min_p > 1`` counts as 1 (SGLang refuses
    it at admission; 1 keeps the tokens tied with the max). The top token is always kept."""
    p = np.asarray(p, dtype=np.float64)
    v = p.shape[-1]
    k = v if top_k is None else max(1, min(int(top_k), v))
    mp = None if min_p is None or not float(min_p) > 0.0 else min(float(min_p), 1.0)
    if k >= v and (top_p is None or top_p >= 1.0) and mp is None:
        return p / p.sum(axis=-1, keepdims=True)
    flat = p.reshape(-1, v)
    out = np.zeros_like(flat)
    ids = np.arange(v)
    for row in range(flat.shape[0]):
        order = np.lexsort((ids, -flat[row]))
        ps = flat[row, order]
        keep = ids < k
        if top_p is not None and top_p < 1.0:
            keep &= (np.cumsum(ps) - ps) <= top_p * ps.sum()
        if mp is not None:
            keep &= ps >= mp * ps[0]
        out[row, order[keep]] = ps[keep]
    return (out / out.sum(axis=1, keepdims=True)).reshape(p.shape)


def _filters_on(v: int, top_k, top_p, min_p) -> bool:
    return ((top_k is not None and top_k < v) or (top_p is not None and top_p < 1.0)
            or (min_p is not None and float(min_p) > 0.0))


def sampling_weights(target_logits, temperature: float, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None) -> np.ndarray:
    """The float64 weights ``sample_node_tokens`` draws from, ``[..., V]``: ``exp(x / T - max(x / T))`` (the top
    token's weight is exactly 1), then ``filter_top_k_top_p`` when a filter is on (renormalised then; the
    unfiltered weights are not). Zero weight = never drawn.

    Min-p on these weights is therefore ``exp(x_i / T - x_max / T) >= min_p`` in float64, with ``x`` the
    float64 value of each float32 logit, ``x_i / T`` and ``x_max / T`` each rounded once and ``exp`` numpy's:
    the GPU kernel (``sglang_kdtree/kernels/tree_accept.cu``, ``min_p_threshold``) evaluates this same expression with
    CUDA's double ``exp``, so the two agree on every token except one whose ``exp`` lies within the two
    libraries' ``exp`` error (about 2^-52 relative) of ``min_p``."""
    t = np.asarray(target_logits)
    x = t.astype(np.float64) / float(temperature)
    x -= x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    if _filters_on(t.shape[-1], top_k, top_p, min_p):
        p = filter_top_k_top_p(p, top_k, top_p, min_p)
    return p


def sample_node_tokens(target_logits, temperature: float, rng: np.random.Generator, top_k: int | None = None,
                       top_p: float | None = None, min_p: float | None = None) -> np.ndarray:
    """Sample one token per node independently from ``softmax(logits / T)``, filtered by ``top_k`` / ``top_p``
    / ``min_p`` as SGLang's sampler does (``sampling_weights``, ``filter_top_k_top_p``; off by default).

    Args:
        target_logits: ``[bs, N, V]`` float logits.
        temperature: T > 0.
        rng: an explicit ``numpy.random.Generator`` (draws ``bs*N`` uniforms in row-major node order), or a
            seeded request's ``PositionUniforms`` (the uniform of the position each node's token would take).
        top_k, top_p, min_p: the request's filters (``top_k = 1``: the argmax, lower id on ties).

    Returns:
        ``[bs, N]`` int64 sampled tokens (inverse-CDF on float64 probabilities, in token-id order).
    """
    t = np.asarray(target_logits)
    _require_float("target_logits", t)
    _require_no_nan("target_logits", t)
    if t.ndim != 3:
        raise ValueError(f"target_logits must be [bs, N, V], got shape {t.shape}")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0 for sampling, got {temperature!r}")
    p = sampling_weights(t, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(t.shape[:2]) * cdf[..., -1]
    out = np.empty(t.shape[:2], dtype=np.int64)
    for idx in np.ndindex(*t.shape[:2]):
        out[idx] = min(int(np.searchsorted(cdf[idx], u[idx], side="right")), t.shape[-1] - 1)
    return out


def position_uniform(seed: int, position: int) -> float:
    """The seeded-sampling rule, its one definition: the uniform in [0, 1) that draws the token at absolute
    ``position`` (its index in the sequence) of a request seeded ``seed``, the first float64 of numpy's PCG64
    seeded with ``SeedSequence([seed mod 2^48, position])``.

    Keyed by (seed, absolute position), not by node number, round or batch row, a seeded request's draws equal
    autoregressive inverse-CDF sampling with the same uniforms: independent of the tree's shape (the drafter,
    the budget, fp ties in the draft ranking) and of the batch, so the request is reproducible, and each
    emitted token is still an exact sample of the target's conditional. A round with committed length P
    draws the token after a node of depth d at position ``P + d + 1`` (the root sits at P); a request's
    first sampled token outside the tree (``pipeline``'s ``sample_tokens``) at its ``seq_len``.

    The CUDA accept (``sglang_kdtree/kernels/tree_accept.cu``, launched by ``gpu.accept.accept_sampled``) follows the
    same keying with counter-based Philox4x32-10 instead of PCG64: key = the int64 seed's low and high 32-bit
    words, counter = ``(0, pos & 0xFFFFFFFF, pos >> 32, 0x6b647472)`` ("kdtr", the stream tag) with
    ``pos = P + depth + 1``; the first two output words form a 64-bit uniform, scaled into the kept 2^-44
    fixed-point weight mass for its inverse-CDF. Both are pure functions of (seed, position) with the
    properties above; their streams differ, so a seeded request is reproducible per backend, not across them.
    """
    return float(np.random.default_rng([int(seed) & 0xFFFFFFFFFFFF, int(position)]).random())


class PositionUniforms:
    """A seeded request's uniforms, ``position_uniform(seed, p)`` for every ``p`` of ``positions`` (an integer
    array, e.g. ``[[P + depth + 1 for each node]]``), given to ``sample_node_tokens`` as its ``rng``: the
    draw's ``random(shape)`` gets them, and ``shape`` must be the shape of ``positions``."""

    def __init__(self, seed: int, positions):
        positions = np.asarray(positions)
        flat = [position_uniform(seed, p) for p in positions.ravel()]
        self._uniforms = np.array(flat, dtype=np.float64).reshape(positions.shape)

    def random(self, shape) -> np.ndarray:
        if tuple(shape) != self._uniforms.shape:
            raise ValueError(f"the uniforms are for positions of shape {self._uniforms.shape}, the draw wants "
                             f"{tuple(shape)}")
        return self._uniforms
