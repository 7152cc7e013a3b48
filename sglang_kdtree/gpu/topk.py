"""GPU per-depth vocabulary top-K + logsumexp (``sglang_kdtree/kernels/topk_logsumexp.cu``); twins of
``reference.topk_logprobs``, ``reference.shard_topk_partials`` and ``reference.merge_topk_partials``.

All functions take and return torch CUDA tensors, launch on torch's current stream and never sync the host.
Shape, dtype, device and range errors raise at the boundary (``TypeError`` / ``ValueError``, the reference's
wording). Value errors that need the data (NaN / +inf logits, a row entirely -inf) set bits in an int32
``error_flag`` tensor (``TOPK_ERRORS``) that the caller reads at its next natural sync
(``raise_on_flag``); ``check=True`` syncs and raises at once (tests, debugging).

Two exact pipelines (``IMPL``): "histogram" (``sglang_kdtree/kernels/topk_histogram.cu``: a streaming 12-bit key
histogram per row, then per row the boundary bin, a gather of the candidates above it and an exact select)
and "cut" (``sglang_kdtree/kernels/topk_logsumexp.cu``: per-chunk cut + merge). Both return identical results.

Workspaces come from a ``TopKWorkspace`` sized for the largest rows / K / vocabulary, so a call allocates
nothing when one is passed (CUDA-graph capture).
"""

from __future__ import annotations

import os

import numpy as np

from sglang_kdtree.gpu import limits, runtime
from sglang_kdtree.gpu.runtime import device_ptr as _ptr
from sglang_kdtree.gpu.runtime import require_cuda as _require_cuda
#: the one device error table (gpu.errors, mirroring sglang_kdtree/kernels/common.cuh)
from sglang_kdtree.gpu.errors import TREE_ERRORS as TOPK_ERRORS
from sglang_kdtree.state import MAX_BUDGET  # top-K is taken with K <= the node budget

__all__ = [
    "TOPK_ERRORS",
    "TopKWorkspace",
    "candidate_allowance",
    "hist_kernel_names",
    "topk_logprobs",
    "shard_topk_partials",
    "merge_topk_partials",
    "new_error_flag",
    "raise_on_flag",
]

CHUNK_COLS = 8192  # columns per block of topk_chunk_* (CHUNK_THREADS * CHUNK_ELEMS in the .cu)
CHUNK_THREADS = 512
MERGE_THREADS = 1024
MAX_SHARD_CANDIDATES = 8192  # S * Ks sorted in shared memory by topk_merge_shards (64 KiB)
_KERNEL = "topk_logsumexp.cu"  # the cut-based top-K kernel and the TP shard merge
_HIST_KERNEL = "topk_histogram.cu"  # streaming-histogram top-K
_OPTIONS: tuple[str, ...] = ()  # extra NVRTC options (benchmarks compare -DCHUNK_MIN_BLOCKS variants)
#: which top-K pipeline topk_logprobs / shard_topk_partials run: "histogram" (topk_histogram.cu) or "cut"
#: (topk_logsumexp.cu's chunk + merge kernels). A workspace is built for one of them.
#: SGLANG_KDTREE_TOPK_IMPL overrides the default (A/B benchmarks of whole rounds).
IMPL = os.environ.get("SGLANG_KDTREE_TOPK_IMPL", "histogram")
HIST_THREADS = 256  # threads of hist_pass / hist_select
HIST_BINS = 4096  # 12-bit key histogram per row
HIST_CAP = 8192  # candidates (bin >= the boundary bin) a row may collect; more -> whole-row exact select
#: bf16 rows (16-byte aligned) run the two-groups-per-thread kernels (``*_g2``: 16384-column chunks, the block's
#: fixed work paid once per 16384 columns) when the one-group grid would have at least this many blocks (rows x
#: 8192-column chunks); fewer blocks keep the 8192-column chunks, whose larger grid fills the GPU at small batch.
#: Two groups are 5-10 % faster from batch 32 up (9600 blocks at K 64, vocab 163,840, 15 rows per request) and
#: slower at batch 16 (4800 blocks) and below (the comparison: benchmarks/topk_groups.py, in RESULTS-archive.md).
#: SGLANG_KDTREE_TOPK_G2_MIN_BLOCKS overrides it (A/B benchmarks; 0: always, a huge value: never).
HIST_G2_MIN_BLOCKS = int(os.environ.get("SGLANG_KDTREE_TOPK_G2_MIN_BLOCKS", "6000"))

#: error-flag bits shared by the tree-construction kernels (topk, best-first tree, verify inputs): their part of


def new_error_flag(device):
    """A zeroed ``int32 [1]`` CUDA tensor for the kernels' error bits."""
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_on_flag(error_flag, what: str = "tree construction") -> None:
    """Sync, read ``error_flag`` and raise ``ValueError`` naming every problem it records."""
    bits = int(error_flag.item())
    if bits:
        msgs = [m for bit, m in TOPK_ERRORS.items() if bits & bit]
        raise ValueError(f"{what}: " + "; ".join(msgs) + f" (device error bits {bits:#x})")






def _check_k(k) -> int:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > MAX_BUDGET:
        raise ValueError(f"k = {k} exceeds the GPU top-K limit {MAX_BUDGET} (the largest node budget)")
    return k


def _check_logits(name, logits):
    import torch

    _require_cuda(name, logits)
    if logits.dtype not in (torch.bfloat16, torch.float32):
        if logits.dtype.is_floating_point:
            raise TypeError(f"{name} must be bfloat16 or float32, got {logits.dtype}; cast with .float()")
        raise TypeError(f"{name} must be a floating-point array, got dtype {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty vocabulary axis, got shape {tuple(logits.shape)}")
    if logits.shape[-1] >= 2**31:
        raise ValueError(f"{name} vocabulary {logits.shape[-1]} does not fit int32 column ids")
    if logits.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocabulary axis; call .contiguous()")


def candidate_allowance(k: int) -> int:
    """Most candidates one 8192-column chunk may hand to the merge for a given K (``allow`` in the .cu):
    room for the cut's slack above K; a chunk whose cut keeps more (heavy ties) selects exactly K instead."""
    return min(CHUNK_COLS, 2 * int(k) + 256)


class TopKWorkspace:
    """Scratch for ``topk_logprobs`` / ``shard_topk_partials`` for one pipeline (``impl``, default ``IMPL``):
    per-row candidate buffers (u64 composites: ``HIST_CAP`` per row for "histogram", ``chunks *
    candidate_allowance(max_k)`` for "cut"), "histogram"'s per-row key histograms (zeroed between calls by its
    select) and per-group largest bins, "cut"'s per-row candidate counts and published thresholds (zeroed
    here; each call's merge zeroes them again, so CUDA-graph replays start clean), and logsumexp partials, for
    up to ``max_rows`` rows of ``vocab`` columns and K <= ``max_k``. Allocate once (outside graph capture); one
    workspace serves one stream at a time.
    """

    def __init__(self, max_rows: int, vocab: int, max_k: int, device, impl: str | None = None):
        import torch

        self.impl = IMPL if impl is None else impl
        if self.impl not in ("histogram", "cut"):
            raise ValueError(f"impl must be 'histogram' or 'cut', got {self.impl!r}")
        self.max_rows, self.vocab, self.max_k = int(max_rows), int(vocab), min(int(max_k), MAX_BUDGET)
        self.chunks = -(-self.vocab // CHUNK_COLS)
        if self.impl == "histogram":
            # per row: a 12-bit key histogram (zero between calls: hist_select clears it after reading), each
            # 32-column group's largest bin, and HIST_CAP candidate composites (rows with more than S_CACHE)
            self.row_cap = HIST_CAP
            self.hist = torch.zeros(self.max_rows * HIST_BINS, dtype=torch.int32, device=device)
            # one entry per 32-column group, chunks of 8192 or (the *_g2 kernels) 16384 columns
            groups = max(self.chunks * HIST_THREADS, -(-self.vocab // (2 * CHUNK_COLS)) * 2 * HIST_THREADS)
            self.group_bin = torch.empty(self.max_rows * groups, dtype=torch.int16, device=device)
            # each chunk's histogram bound (hist_pass counts only keys >= it; the select's gather applies it too)
            self.chunk_cut = torch.empty(self.max_rows * self.chunks, dtype=torch.int32, device=device)
            # per row (highest nonzero histogram bin + 1, H_BINS - lowest), from the chunks' bounds; zero between calls
            self.row_range = torch.zeros(self.max_rows * 2, dtype=torch.int32, device=device)
        else:
            self.row_cap = self.chunks * candidate_allowance(self.max_k)
        self.cands = torch.empty(self.max_rows * self.row_cap, dtype=torch.int64, device=device)
        self.row_count = torch.zeros(self.max_rows, dtype=torch.int32, device=device)
        self.row_thresh = torch.zeros(self.max_rows, dtype=torch.int32, device=device)
        self.chunk_max = torch.empty(self.max_rows * self.chunks, dtype=torch.float32, device=device)
        self.chunk_sum = torch.empty(self.max_rows * self.chunks, dtype=torch.float64, device=device)

    def fits(self, rows: int, vocab: int, k: int) -> bool:
        return rows <= self.max_rows and -(-vocab // CHUNK_COLS) <= self.chunks and min(k, CHUNK_COLS) <= self.max_k


def _chunk_kernel(logits):
    import torch

    mod = runtime.load_module(_KERNEL, _OPTIONS)
    vec = 8 if logits.dtype == torch.bfloat16 else 4
    aligned = (
        logits.data_ptr() % 16 == 0
        and logits.shape[-1] % vec == 0
        and (logits.ndim == 1 or logits.stride(-2) % vec == 0)
    )
    name = ("topk_chunk_bf16_v" if logits.dtype == torch.bfloat16 else "topk_chunk_f32_v") + (
        str(vec) if aligned else "1"
    )
    return mod.get_function(name)


def _rows_view(logits):
    """[..., V] -> a [R, V] view with a uniform row stride (copies only when the layout has none)."""
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    if flat.shape[0] > 1 and flat.stride(0) < v:
        flat = flat.contiguous()
    return flat


def _run_topk(logits, k, id_offset, mode, workspace, out_vals, out_ids, out_lse, error_flag):
    import torch

    flat = _rows_view(logits)
    rows, v = flat.shape
    kout = min(k, v)
    dev = logits.device
    if workspace is None:
        workspace = TopKWorkspace(max(rows, 1), v, k, dev)
    elif not workspace.fits(rows, v, k):
        raise ValueError(
            f"workspace (rows {workspace.max_rows}, vocab {workspace.vocab}, max_k {workspace.max_k}) is too small "
            f"for rows {rows}, vocab {v}, k {k}; build a larger TopKWorkspace"
        )
    if out_vals is None:
        out_vals = torch.empty(rows * kout, dtype=torch.float32, device=dev)
    if out_ids is None:
        out_ids = torch.empty(rows * kout, dtype=torch.int64, device=dev)
    if mode == 1 and out_lse is None:
        out_lse = torch.empty(rows, dtype=torch.float64, device=dev)
    if error_flag is None:
        error_flag = new_error_flag(dev)
    if rows == 0:
        return out_vals, out_ids, out_lse, error_flag
    chunks = -(-v // CHUNK_COLS)
    if rows * chunks >= 2**31:
        raise ValueError(f"rows {rows} x chunks {chunks} exceeds the 1-D grid; split the batch")
    row_stride = flat.stride(0) if rows > 1 else v
    if workspace.impl == "histogram":
        if rows > 65535:  # hist_pass's grid is (chunks, rows)
            raise ValueError(f"rows {rows} exceeds the histogram top-K's 65535 rows per call; split the batch")
        _run_histogram(flat, rows, v, k, chunks, row_stride, id_offset, mode, workspace, out_vals, out_ids, out_lse,
                       error_flag)
        return out_vals, out_ids, out_lse, error_flag
    allow = candidate_allowance(k)
    mod = runtime.load_module(_KERNEL, _OPTIONS)
    ws = workspace
    with runtime.current_stream():
        _chunk_kernel(flat)(
            (rows * chunks,),
            (CHUNK_THREADS,),
            (_ptr(flat), np.int64(row_stride), np.int32(v), np.int32(k), np.int32(rows), np.int32(chunks),
             np.int32(allow), np.int64(ws.row_cap), _ptr(ws.cands), _ptr(ws.row_count), _ptr(ws.row_thresh),
             _ptr(ws.chunk_max), _ptr(ws.chunk_sum), _ptr(error_flag)),
        )
        common = (_ptr(ws.cands), _ptr(ws.row_count), _ptr(ws.row_thresh), np.int64(ws.row_cap), np.int32(chunks),
                  np.int32(v), np.int32(k), _ptr(ws.chunk_max), _ptr(ws.chunk_sum), _ptr(out_vals), _ptr(out_ids))
        if mode == 0:
            mod.get_function("topk_merge_logprobs")((rows,), (MERGE_THREADS,), common + (_ptr(error_flag),))
        else:
            mod.get_function("topk_merge_partials")(
                (rows,), (MERGE_THREADS,), common + (_ptr(out_lse), np.int64(id_offset), _ptr(error_flag))
            )
    return out_vals, out_ids, out_lse, error_flag


def hist_kernel_names(bf16: bool, aligned: bool, g2: bool, k: int, v: int, mode: int) -> tuple[str, str]:
    """The (hist_pass, hist_select) kernels of sglang_kdtree/kernels/topk_histogram.cu for a call: bf16 or fp32 rows,
    16-byte aligned or not (vector loads), two groups per thread (``g2``: aligned bf16 of large batches), and K:
    ``min(K, V) > 256`` takes the WIDE kernels (bf16: the pass whose chunk bound comes from each thread's
    fourth-largest value; any dtype: the select that places the candidates by bin). ``mode`` 0: logprobs, 1:
    TP shard partials."""
    suffix = ("bf16_v" if bf16 else "f32_v") + (str(8 if bf16 else 4) if aligned else "1") + ("_g2" if g2 else "")
    wide = min(k, v) > HIST_THREADS
    pass_name = ("hist_pass_wide_" if wide and bf16 else "hist_pass_") + suffix
    select_name = ("hist_select_logprobs_" if mode == 0 else "hist_select_partials_") + ("wide_" if wide else "") + suffix
    return pass_name, select_name


def _run_histogram(flat, rows, v, k, chunks, row_stride, id_offset, mode, ws, out_vals, out_ids, out_lse,
                   error_flag):
    """hist_pass -> hist_select (see sglang_kdtree/kernels/topk_histogram.cu)."""
    import torch

    mod = runtime.load_module(_HIST_KERNEL, _OPTIONS)
    bf16 = flat.dtype == torch.bfloat16
    vec = 8 if bf16 else 4
    aligned = flat.data_ptr() % 16 == 0 and v % vec == 0 and (rows == 1 or row_stride % vec == 0)
    g2 = bf16 and aligned and rows * chunks >= HIST_G2_MIN_BLOCKS
    if g2:
        chunks = -(-v // (2 * CHUNK_COLS))
    pass_name, select_name = hist_kernel_names(bf16, aligned, g2, k, v, mode)
    runtime.launch(
        mod.get_function(pass_name), (chunks, rows), (HIST_THREADS,),
        (_ptr(flat), np.int64(row_stride), np.int32(v), np.int32(k), np.int32(chunks), _ptr(ws.hist),
         _ptr(ws.group_bin), _ptr(ws.chunk_cut), _ptr(ws.chunk_max), _ptr(ws.chunk_sum), _ptr(ws.row_range),
         _ptr(error_flag)),
    )
    args = (_ptr(flat), np.int64(row_stride), np.int32(v), np.int32(k), np.int32(chunks), _ptr(ws.hist),
            _ptr(ws.group_bin), _ptr(ws.chunk_cut), _ptr(ws.cands), np.int64(ws.row_cap), _ptr(ws.chunk_max),
            _ptr(ws.chunk_sum), _ptr(out_vals), _ptr(out_ids))
    if mode == 0:
        args += (_ptr(ws.row_range), _ptr(error_flag))
    else:
        args += (_ptr(out_lse), np.int64(id_offset), _ptr(ws.row_range), _ptr(error_flag))
    # a dependent launch: the select waits for the pass at entry (pdl_wait), its launch overlaps the pass's tail
    runtime.launch(mod.get_function(select_name), (rows,), (HIST_THREADS,), args, pdl=True)


def topk_logprobs(logits, k: int, *, workspace: TopKWorkspace | None = None, out=None, error_flag=None,
                  check: bool = False):
    """Per-row top-``K`` log-probabilities and token ids, ``K = min(k, V)``; twin of
    ``reference.topk_logprobs``.

    Args:
        logits: ``[..., V]`` bf16 or fp32 CUDA tensor (``[bs, L, V]`` draft logits), contiguous along V.
        k: requested K (the node budget), ``1 <= k <= state.MAX_BUDGET``.
        workspace: preallocated ``TopKWorkspace`` (else one is allocated).
        out: optional ``(logprobs float32, ids int64)`` flat buffers of at least ``rows*K`` elements.
        error_flag: ``int32 [1]`` CUDA tensor receiving error bits (NaN 1, +inf 2, all -inf row 4).
        check: sync and raise ``ValueError`` if the flag is set (the reference's error), for tests/debug.

    Returns:
        ``(logprobs [..., K] float32, ids [..., K] int64)`` on the logits' device, descending by logit,
        equal logits by ascending id; ``logprob = float32(float64(logit) - lse)`` with the float64 lse.
    """
    k = _check_k(k)
    _check_logits("logits", logits)
    lead, v = tuple(logits.shape[:-1]), logits.shape[-1]
    kout = min(k, v)
    rows = int(np.prod(lead)) if lead else 1
    vals = ids = None
    if out is not None:
        vals, ids = out[0].reshape(-1)[: rows * kout], out[1].reshape(-1)[: rows * kout]
    vals, ids, _, flag = _run_topk(logits, k, 0, 0, workspace, vals, ids, None, error_flag)
    if check:
        raise_on_flag(flag, "topk_logprobs")
    return vals.view(*lead, kout), ids.view(*lead, kout)


def shard_topk_partials(logits_shard, k: int, id_offset: int, *, workspace: TopKWorkspace | None = None,
                        error_flag=None, check: bool = False):
    """Tensor-parallel first half; twin of ``reference.shard_topk_partials``.

    Args:
        logits_shard: ``[..., V_shard]`` bf16/fp32 CUDA logits of this rank's vocabulary slice.
        k: requested K; the shard returns ``Ks = min(k, V_shard)`` candidates.
        id_offset: global token id of the shard's column 0 (``id_offset + V_shard < 2**32``).

    Returns:
        ``(top_logits [..., Ks] float32, ids [..., Ks] int64 global, lse [...] float64)``, sorted by
        (logit desc, id asc); ``lse`` is ``-inf`` for a row entirely ``-inf`` in this shard (legal).
    """
    k = _check_k(k)
    _check_logits("logits_shard", logits_shard)
    if isinstance(id_offset, bool) or not isinstance(id_offset, (int, np.integer)) or id_offset < 0:
        raise ValueError(f"id_offset must be an int >= 0, got {id_offset!r}")
    if int(id_offset) + logits_shard.shape[-1] > 2**32 - 1:
        raise ValueError(f"id_offset {id_offset} + V_shard exceeds the 32-bit token id range")
    lead, v = tuple(logits_shard.shape[:-1]), logits_shard.shape[-1]
    kout = min(k, v)
    vals, ids, lse, flag = _run_topk(logits_shard, k, int(id_offset), 1, workspace, None, None, None, error_flag)
    if check:
        raise_on_flag(flag, "shard_topk_partials")
    return vals.view(*lead, kout), ids.view(*lead, kout), lse.view(lead)


def merge_topk_partials(top_logits, ids, lse, k: int, *, error_flag=None, check: bool = False):
    """Tensor-parallel second half; twin of ``reference.merge_topk_partials``.

    Args:
        top_logits: ``[S, ..., Ks]`` float32 CUDA, shard s's candidates in any order.
        ids: ``[S, ..., Ks]`` int64 global token ids (``< 2**32``).
        lse: ``[S, ...]`` float64 shard logsumexps.
        k: requested K; the result has ``min(k, S*Ks)`` columns. ``S*Ks <= 8192``.

    Returns:
        ``(logprobs [..., K] float32, ids [..., K] int64)``: ids equal to the unsharded ``topk_logprobs``;
        the global lse is combined from the shards' in float64. Flag bit 4: a row -inf in every shard.
    """
    import torch

    k = _check_k(k)
    for name, t in (("top_logits", top_logits), ("ids", ids), ("lse", lse)):
        _require_cuda(name, t)
    if top_logits.dtype != torch.float32 or ids.dtype != torch.int64 or lse.dtype != torch.float64:
        raise TypeError(
            f"expected top_logits float32, ids int64, lse float64; got {top_logits.dtype}, {ids.dtype}, {lse.dtype}"
        )
    if top_logits.shape != ids.shape or top_logits.shape[:-1] != lse.shape or top_logits.ndim < 2:
        raise ValueError(
            f"shape mismatch: top_logits {tuple(top_logits.shape)}, ids {tuple(ids.shape)}, lse {tuple(lse.shape)}; "
            "expected [S, ..., Ks], [S, ..., Ks], [S, ...]"
        )
    s, ks = top_logits.shape[0], top_logits.shape[-1]
    lead = tuple(top_logits.shape[1:-1])
    rows = int(np.prod(lead)) if lead else 1
    n = s * ks
    if n > MAX_SHARD_CANDIDATES:
        raise ValueError(f"S*Ks = {n} candidates per row exceeds {MAX_SHARD_CANDIDATES}; lower k or the shard count")
    kout = min(k, n)
    p = 1
    while p < n:
        p <<= 1
    tv = top_logits.contiguous()
    ti = ids.contiguous()
    tl = lse.contiguous()
    dev = top_logits.device
    out_lp = torch.empty(rows * kout, dtype=torch.float32, device=dev)
    out_ids = torch.empty(rows * kout, dtype=torch.int64, device=dev)
    flag = new_error_flag(dev) if error_flag is None else error_flag
    if rows:
        fn = runtime.load_module(_KERNEL, _OPTIONS).get_function("topk_merge_shards")
        limits.check_launch(f"topk_merge_shards ({n} candidates per row)", MERGE_THREADS, p * 8, fn.shared_size_bytes,
                            limits.current(dev.index), fix="merge fewer shards or take fewer candidates per shard")
        fn.max_dynamic_shared_size_bytes = max(p * 8, 1)
        with runtime.current_stream():
            fn((rows,), (MERGE_THREADS,),
               (_ptr(tv), _ptr(ti), _ptr(tl), np.int32(s), np.int32(rows), np.int32(ks), np.int32(k), np.int32(p),
                _ptr(out_lp), _ptr(out_ids), _ptr(flag)),
               shared_mem=p * 8)
    if check:
        raise_on_flag(flag, "merge_topk_partials")
    return out_lp.view(*lead, kout), out_ids.view(*lead, kout)
