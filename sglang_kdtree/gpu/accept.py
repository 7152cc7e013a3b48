"""GPU accept walk (``sglang_kdtree/kernels/tree_accept.cu``): twins of ``reference.accept_greedy`` and
``reference.accept_sampled`` over torch CUDA tensors, one launch for the batch, no host sync.

Tree input (``trees``): any object with the reference ``TreeBatch`` attributes as torch CUDA tensors:

* ``tokens``    ``[bs, N]`` int64, node tokens (column 0 = the root/bonus token, padding rows 0);
* ``parents``   ``[bs, N]`` int64, ``parents[b, 0] = -1``, ``parents[b, i] < i`` for live nodes, padding -1;
* ``num_nodes`` ``[bs]`` int64, live nodes besides the root (``<= N - 1``).

The parent array is what the walk reads (not SGLang's first-child / next-sibling links): children are
found by a parallel scan of the parent row, the lowest matching node index wins, exactly like the
reference and like ``verify_tree_greedy`` walking ``retrive_next_token`` / ``retrive_next_sibling``.

Outputs (``contract.AcceptResult``), all on the trees' device:

* ``accepted``     ``[bs, max_depth+1]`` int64 node indices of the accepted path (root first), -1 padded;
* ``accept_lens``  ``[bs]`` int64 tau, counting the bonus (what SGLang's V2 worker calls accept_lens);
* ``bonus``        ``[bs]`` int64 the target's token after the last accepted node;
* ``committed``    ``[bs, N]`` int64, row stride N: the tau committed tokens (path tokens, then bonus),
  -1 padded; ``committed.reshape(-1)`` is SGLang's ``next_token_ids`` with stride N;
* ``new_seq_lens`` ``[bs]`` int64 ``seq_lens + tau`` (None when ``seq_lens`` is not given);
* ``errors``       ``[bs]`` int64 per-request device error bits (``sglang_kdtree.gpu.errors``; 0 when valid).

Validation: shapes, dtypes, devices and ``max_depth`` are checked here on the host (TypeError /
ValueError); values that need the data (num_nodes range, parents < i, NaN logits, a path longer than
``max_depth``) set bits in ``errors`` without a sync; ``AcceptResult.raise_on_error()`` syncs and raises.
"""

from __future__ import annotations

import functools

from sglang_kdtree.contract import AcceptResult
from sglang_kdtree.gpu import runtime
from sglang_kdtree.gpu.runtime import device_ptr as _ptr
from sglang_kdtree.state import MAX_WIDTH  # verify width limit of the kernel's shared-memory tree

__all__ = ["accept_greedy", "accept_sampled", "accept_storage_numel", "carve_accept_result",
           "MAX_WIDTH", "MAX_VOCAB"]

#: vocabulary limit of the sampler's fixed-point weights (a row's weights sum below 2^63)
MAX_VOCAB = 1 << 19
_ACCEPT_THREADS_IDS = 256
_ACCEPT_THREADS_LOGITS = 1024
#: greedy accept over logits: blocks per request (a thread-block cluster; GREEDY_CLUSTER in the .cu)
_GREEDY_CLUSTER = 8
#: its threads per block, at most the kernel's launch bound (GREEDY_THREADS, 512): 384 up to batch 16, 256 above,
#: where smaller blocks let more of the batch's clusters be resident at once (about a fifth faster than 512 threads
#: at batch 32, no slower at batch 1: benchmarks/accept_sweep.py, in RESULTS-archive.md)
_GREEDY_SMALL_BATCH = 16
_GREEDY_THREADS_SMALL, _GREEDY_THREADS_LARGE = 384, 256


def _greedy_threads(bs: int) -> int:
    return _GREEDY_THREADS_SMALL if bs <= _GREEDY_SMALL_BATCH else _GREEDY_THREADS_LARGE


def _require_tensor(name, t, dtype, ndim, device=None):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (move it to the trees' device)")


def _check_trees(trees):
    import torch

    for attr in ("tokens", "parents", "num_nodes"):
        if not hasattr(trees, attr):
            raise TypeError(f"trees must have .tokens, .parents, .num_nodes (a TreeBatch of torch tensors); missing .{attr}")
    tokens, parents, num_nodes = trees.tokens, trees.parents, trees.num_nodes
    _require_tensor("trees.tokens", tokens, torch.int64, 2)
    bs, width = tokens.shape
    _require_tensor("trees.parents", parents, torch.int64, 2, tokens.device)
    _require_tensor("trees.num_nodes", num_nodes, torch.int64, 1, tokens.device)
    if tuple(parents.shape) != (bs, width) or tuple(num_nodes.shape) != (bs,):
        raise ValueError(
            f"trees shapes disagree: tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)}, "
            f"num_nodes {tuple(num_nodes.shape)}; expected [bs, N], [bs, N], [bs]"
        )
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"verify width N = {width} is outside [1, {MAX_WIDTH}] (budget <= {MAX_WIDTH - 1})")
    return tokens.contiguous(), parents.contiguous(), num_nodes.contiguous(), bs, width


def _check_max_depth(max_depth, width):
    if max_depth is None:
        return width - 1
    if isinstance(max_depth, bool) or not isinstance(max_depth, int):
        raise TypeError(f"max_depth must be an int, got {type(max_depth).__name__} {max_depth!r}")
    if max_depth < 0:
        raise ValueError(f"max_depth = {max_depth} must be >= 0 (pass the draft depth L)")
    return max_depth


def _check_seq_lens(seq_lens, bs, device, required):
    import torch

    if seq_lens is None:
        if required:
            raise ValueError("seq_lens is required: the sampler's counter is (seed, seq_len + depth + 1)")
        return None
    _require_tensor("seq_lens", seq_lens, torch.int64, 1, device)
    if tuple(seq_lens.shape) != (bs,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({bs},)")
    return seq_lens.contiguous()


def _check_round(trees, max_depth, seq_lens, *, sampled: bool):
    """The checks both accept launchers start with: the trees (on CUDA), max_depth and seq_lens (required when
    sampling). Returns (tokens, parents, num_nodes, bs, width, device, max_depth, seq_lens)."""
    tokens, parents, num_nodes, bs, width = _check_trees(trees)
    device = tokens.device
    if device.type != "cuda":
        twin = "reference.accept_sampled" if sampled else "reference.accept_greedy"
        raise ValueError(f"trees are on {device}; the GPU accept needs CUDA tensors (use {twin} on CPU)")
    max_depth = _check_max_depth(max_depth, width)
    seq_lens = _check_seq_lens(seq_lens, bs, device, required=sampled)
    return tokens, parents, num_nodes, bs, width, device, max_depth, seq_lens


def _check_logits(target_logits, bs, width, device):
    """Accepts ``[bs*N, V]`` (SGLang's verify logits) or ``[bs, N, V]``; returns (tensor, V, row stride)."""
    import torch

    _require_tensor("target_logits", target_logits, (torch.float32, torch.bfloat16), None, device)
    t = target_logits
    if t.dim() == 3:
        if tuple(t.shape[:2]) != (bs, width):
            raise ValueError(f"target_logits has shape {tuple(t.shape)}, expected [{bs}, {width}, V]")
        t = t.reshape(bs * width, t.shape[2])
    if t.dim() != 2 or t.shape[0] != bs * width:
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}, expected [bs*N = {bs * width}, V]")
    vocab = int(t.shape[1])
    if not 1 <= vocab < MAX_VOCAB:
        raise ValueError(f"vocabulary size {vocab} is outside [1, {MAX_VOCAB})")
    if t.stride(1) != 1:
        t = t.contiguous()
    return t, vocab, int(t.stride(0))


def _outputs(bs, width, max_depth, device, with_seq_lens, out):
    import torch

    if out is not None:
        # preallocated (CUDA graphs, or tests that poison the buffers): shapes must match exactly
        expect = {
            "accepted": (bs, max_depth + 1),
            "accept_lens": (bs,),
            "bonus": (bs,),
            "committed": (bs, width),
            "errors": (bs,),
        }
        for name, shape in expect.items():
            t = getattr(out, name)
            _require_tensor(f"out.{name}", t, torch.int64, None, device)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"out.{name} must be a contiguous {shape} tensor, got {tuple(t.shape)}")
        if with_seq_lens:
            _require_tensor("out.new_seq_lens", out.new_seq_lens, torch.int64, 1, device)
        return out
    # one allocation for every output: allocator calls are a visible part of the launch cost
    flat = torch.empty(accept_storage_numel(bs, width, max_depth), dtype=torch.int64, device=device)
    return carve_accept_result(flat, bs, width, max_depth, with_seq_lens)


def accept_storage_numel(bs: int, width: int, max_depth: int) -> int:
    """int64 elements ``carve_accept_result`` needs for a batch of ``bs`` trees of width ``width``."""
    return bs * (max_depth + 1 + width + 4)


def carve_accept_result(flat, bs: int, width: int, max_depth: int, with_seq_lens: bool = True) -> AcceptResult:
    """An ``AcceptResult`` whose fields are contiguous views of the int64 storage ``flat`` (at least
    ``accept_storage_numel`` elements): pass it as ``out`` to reuse one buffer every round."""
    m = max_depth + 1
    parts = flat[: accept_storage_numel(bs, width, max_depth)].split([bs * m, bs * width, bs, bs, bs, bs])
    return AcceptResult(
        accepted=parts[0].view(bs, m),
        accept_lens=parts[2],
        bonus=parts[3],
        committed=parts[1].view(bs, width),
        new_seq_lens=parts[4] if with_seq_lens else None,
        errors=parts[5],
    )


@functools.cache
def _kernel(name: str):
    return runtime.load_module("tree_accept.cu").get_function(name)




def accept_greedy(trees, target_logits, max_depth: int | None = None, *, seq_lens=None, out=None) -> AcceptResult:
    """Greedy (T = 0) accept walk for a batch, twin of ``reference.accept_greedy``.

    Args:
        trees: tree batch of torch CUDA tensors (module docstring).
        target_logits: the target's verify logits, ``[bs*N, V]`` or ``[bs, N, V]``, float32 or bfloat16
            (argmax fused; ties go to the lower token id; only the rows on the accepted path are read);
            or argmax ids ``[bs*N]`` / ``[bs, N]`` int64.
        max_depth: ``accepted`` has ``max_depth + 1`` columns (pass the draft depth L); default N - 1.
            A longer path is truncated and flagged (the reference raises). May exceed N - 1 (e.g. L = 15 with
            a budget of 4): the extra columns stay -1.
        seq_lens: ``[bs]`` int64 committed lengths P before this round; gives ``new_seq_lens = P + tau``.
        out: optional preallocated ``AcceptResult`` (e.g. for CUDA graphs); every field is overwritten.

    Returns:
        ``AcceptResult`` (module docstring); no host sync.
    """
    import numpy as np
    import torch

    tokens, parents, num_nodes, bs, width, device, max_depth, seq_lens = _check_round(
        trees, max_depth, seq_lens, sampled=False)
    t = target_logits
    ids = isinstance(t, torch.Tensor) and not t.is_floating_point()
    if ids:
        _require_tensor("target ids", t, torch.int64, None, device)
        if t.numel() != bs * width or t.dim() not in (1, 2) or (t.dim() == 2 and tuple(t.shape) != (bs, width)):
            raise ValueError(f"target ids have shape {tuple(t.shape)}, expected [{bs * width}] or [{bs}, {width}]")
        t = t.contiguous()
    else:
        t, vocab, ld = _check_logits(t, bs, width, device)
    res = _outputs(bs, width, max_depth, device, seq_lens is not None, out)
    if bs == 0:
        return res
    common_out = (_ptr(res.accepted), _ptr(res.accept_lens), _ptr(res.bonus), _ptr(res.committed),
                  _ptr(res.new_seq_lens if seq_lens is not None else None), _ptr(res.errors))
    dims = (np.int32(width), np.int32(max_depth + 1), np.int32(width))
    with runtime.current_stream():
        if ids:
            _kernel("accept_ids")(
                (bs,), (_ACCEPT_THREADS_IDS,),
                (_ptr(tokens), _ptr(parents), _ptr(num_nodes), _ptr(t), _ptr(seq_lens), *dims, *common_out),
            )
        else:
            # one cluster of _GREEDY_CLUSTER blocks per request splits each visited row (kernel's comment)
            name = "accept_greedy_f32" if t.dtype == torch.float32 else "accept_greedy_bf16"
            _kernel(name)(
                (bs * _GREEDY_CLUSTER,), (_greedy_threads(bs),),
                (_ptr(tokens), _ptr(parents), _ptr(num_nodes), _ptr(t), np.int64(vocab), np.int64(ld),
                 _ptr(seq_lens), *dims, *common_out),
            )
    return res


def accept_sampled(
    trees,
    target_logits,
    temperatures,
    seeds,
    seq_lens,
    max_depth: int | None = None,
    *,
    top_ks=None,
    top_ps=None,
    min_ps=None,
    out=None,
) -> AcceptResult:
    """T > 0 accept walk, twin of ``reference.accept_sampled`` (same walk, counter-based RNG).

    At every visited node the token is drawn from ``softmax(logits / T)`` restricted like SGLang's
    ``top_k_top_p_min_p`` sampling: sort by probability (ties: lower token id first), keep rank r iff
    ``r < top_k``, the probability mass of ranks ``< r`` is ``<= top_p`` and (min-p) its probability is
    ``>= min_p`` times the top token's, renormalise. The min-p test is ``reference.sampling_weights``'s, in
    float64: ``exp(x / T - x_max / T) >= min_p`` (the kernel finds the smallest float logit that passes it,
    ``min_p_threshold``); it agrees with the reference except for a token whose ``exp`` lies within the two
    ``exp`` implementations' error (~2^-52 relative) of ``min_p`` (min-p costs one more pass over the row
    when it cuts deeper than top-k / top-p). The draw is a pure function of ``(seeds[b], P + depth + 1)``
    (Philox4x32-10), the absolute position of the token it draws (as ``pipeline.ReferenceBackend`` keys its
    uniforms): independent of the tree's shape and node numbering, reproducible, and successive rounds
    (seq_len grows) draw at new positions. Weights are 2^-44 fixed point relative to the row max: tokens
    below ``2^-44`` of the top token's probability are never drawn. Requests with ``T <= 0``
    walk greedily (argmax, lower id on ties), as do those with ``top_k == 1``.

    Args:
        trees: tree batch of torch CUDA tensors (module docstring).
        target_logits: ``[bs*N, V]`` or ``[bs, N, V]`` float32 / bfloat16 target logits (V < 2^19).
        temperatures: ``[bs]`` (or SGLang's ``[bs, 1]``) float32 per-request temperature.
        seeds: ``[bs]`` int64 per-request seeds.
        seq_lens: ``[bs]`` int64 committed lengths P (RNG counter and ``new_seq_lens``).
        max_depth: as in ``accept_greedy``.
        top_ks: optional ``[bs]`` int64 (or int32) top-k (>= 1; SGLang's "off" value 1 << 30 is fine).
        top_ps: optional ``[bs]`` float32 top-p in (0, 1].
        min_ps: optional ``[bs]`` float32 min-p in [0, 1] (SGLang's ``SamplingBatchInfo.min_ps``; 0 = off). The
            values are read on the device only (no sync): ``<= 0`` or NaN is off, ``> 1`` counts as 1 (SGLang
            refuses values outside [0, 1] at admission). None: off for every request (no extra pass).
        out: optional preallocated ``AcceptResult``.
    """
    import numpy as np
    import torch

    tokens, parents, num_nodes, bs, width, device, max_depth, seq_lens = _check_round(
        trees, max_depth, seq_lens, sampled=True)
    t, vocab, ld = _check_logits(target_logits, bs, width, device)
    temperatures, seeds = _check_temperatures_and_seeds(temperatures, seeds, bs, device)
    top_ks = _check_per_request("top_ks", top_ks, (torch.int64, torch.int32), bs, device)
    top_ks = top_ks.to(torch.int64) if top_ks is not None else None
    top_ps = _check_per_request("top_ps", top_ps, torch.float32, bs, device)
    min_ps = _check_per_request("min_ps", min_ps, torch.float32, bs, device)
    res = _outputs(bs, width, max_depth, device, True, out)
    if bs == 0:
        return res
    name = "accept_sampled_f32" if t.dtype == torch.float32 else "accept_sampled_bf16"
    with runtime.current_stream():
        _kernel(name)(
            (bs,), (_ACCEPT_THREADS_LOGITS,),
            (_ptr(tokens), _ptr(parents), _ptr(num_nodes), _ptr(t), np.int64(vocab), np.int64(ld),
             _ptr(seq_lens), _ptr(temperatures), _ptr(top_ks), _ptr(top_ps), _ptr(min_ps), _ptr(seeds),
             np.int32(width), np.int32(max_depth + 1), np.int32(width),
             _ptr(res.accepted), _ptr(res.accept_lens), _ptr(res.bonus), _ptr(res.committed),
             _ptr(res.new_seq_lens), _ptr(res.errors)),
        )
    return res


def _check_temperatures_and_seeds(temperatures, seeds, bs, device):
    """``accept_sampled``'s per-request temperatures (``[bs]`` or ``[bs, 1]`` float32, flattened) and seeds
    (``[bs]`` int64), contiguous."""
    import torch

    _require_tensor("temperatures", temperatures, torch.float32, None, device)
    temperatures = temperatures.reshape(-1).contiguous()
    _require_tensor("seeds", seeds, torch.int64, 1, device)
    if temperatures.shape[0] != bs or seeds.shape[0] != bs:
        raise ValueError(
            f"temperatures {tuple(temperatures.shape)} and seeds {tuple(seeds.shape)} must have {bs} entries"
        )
    return temperatures, seeds.contiguous()


def _check_per_request(name, x, dtype, bs, device):
    """An optional ``[bs]`` per-request sampling parameter (top_ks, top_ps, min_ps), contiguous; None stays None."""
    if x is None:
        return None
    _require_tensor(name, x, dtype, 1, device)
    if x.shape[0] != bs:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({bs},)")
    return x.contiguous()
