"""Tree-verify attention for absorbed MLA: the CuPy launcher of two kernels. Their float64 torch twin
``mla_tree_verify_reference`` (same positional signature, same results up to bf16 rounding) and the random inputs of
the tests and benchmarks live in ``sglang_kdtree.gpu.mla_reference``.

Kernels (``kernel=`` / ``$SGLANG_KDTREE_MLA_KERNEL``: ``auto``, ``wgmma``, ``mma`` or ``mma_compact``):

* ``wgmma`` (``sglang_kdtree/kernels/mla_tree_verify_wgmma.cu``): Hopper warpgroup MMA (sm_90a), 64 keys per stage; the
  default where wgmma runs (compute capability 9.0);
* ``mma`` (``sglang_kdtree/kernels/mla_tree_verify.cu``): mma.sync m16n8k16, 64 rows x 32-key stages, 155,648 B of shared
  memory per block; the default on other GPUs that allow it (sm_100);
* ``mma_compact`` (``sglang_kdtree/kernels/mla_tree_verify_compact.cu``): mma.sync, 48 rows x 16-key stages, the
  pair of warps of a row group splitting the score depth, 99,584 B; the default where ``mma`` does not fit (sm_120:
  101,376 B per block). All share the split-K merge kernel; each has its launch counter.

``auto`` decides from ``sglang_kdtree.gpu.limits.current()``, so ``KDTREE_DEVICE_PROFILE=sm_120`` runs ``mma_compact`` on
an H200 too; every launch is checked against those limits first (``limits.check_launch``).

Semantics: request ``b`` verifies ``N`` tree nodes. Query row ``(b*N + i, h)`` is the absorbed query
``[q_nope (512) | q_rope (64)]``; keys are 576-wide rows of SGLang's MLA pool (latent ``c_kv`` then ``k_rope``)
and values are their first 512 columns. Row ``(i, h)`` attends to every prefix key of ``b`` and, among the
``N`` tree keys (node ``j`` stored at slot ``tree_slots[b*N + j]``), exactly those with bit ``j % 32`` of word
``j // 32`` set in ``ancestor_bits[b, i]`` (ancestors-or-self; the layout of
``sglang_kdtree.reference.verify_inputs().ancestor_bits``). Scores are ``sm_scale * q.k``; the LSE is the
natural log of the sum of ``exp(score)`` over the visible keys.

Key addressing (page size 1, or larger: SGLang's ``req_to_token`` / ``kv_indices`` hold token slots
``page * page_size + offset`` in either case, so a pool viewed as ``[slots, 576]`` is addressed the same way):

* ``mla_tree_verify``: CSR, as SGLang's triton backend builds it: request ``b``'s prefix slots are
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
* ``mla_tree_verify_paged``: ``req_to_token`` rows, as the fa3 backend keeps them: prefix slots
  ``req_to_token[req_pool_indices[b], :prefix_lens[b]]``.

Validation happens once at the boundary (shapes, dtypes, devices, alignment) without a device sync; values
(slot ranges, NaN) are not checked: a slot outside the pool is a caller bug the kernel cannot detect cheaply.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from sglang_kdtree.gpu import limits, runtime

__all__ = [
    "KV_LORA_RANK",
    "QK_ROPE_DIM",
    "QK_HEAD_DIM",
    "mla_tree_verify",
    "mla_tree_verify_paged",
    "choose_num_splits",
    "planned_num_splits",
    "launch_count",
    "launch_counts",
    "prepare",
    "kernel_option",
    "resolve_kernel",
    "choose_kernel",
    "KernelShape",
    "SHAPES",
]

KV_LORA_RANK = 512
QK_ROPE_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_DIM

_KEY_UNIT = 32  # the split-K cost model counts key work in 32-key units, whatever the kernel's stage
_LDS = QK_HEAD_DIM + 8  # the mma kernel's shared-memory row pitch (LDS in mla_tree_verify.cu)
MMA_SOURCE = "mla_tree_verify.cu"
MERGE_SOURCE = "mla_tree_verify_merge.cu"  # the split-K merge every kernel's partial states go through
WGMMA_SOURCE = "mla_tree_verify_wgmma.cu"
WGMMA_ARCH = runtime.ARCH_SPECIFIC[WGMMA_SOURCE]


@dataclass(frozen=True)
class KernelShape:
    """A tree-verify kernel: its source and entry-point prefix (``<entry>i64`` / ``<entry>i32``), query rows per
    CTA, keys per pipeline stage, threads and dynamic shared memory (``ROW_TILE`` / ``KEY_TILE`` / ``THREADS`` and
    the layout of its ``.cu`` file)."""

    source: str
    entry: str
    row_tile: int
    key_tile: int
    threads: int
    smem_bytes: int


#: every kernel's shape and shared memory. wgmma: Q, two key tiles and P as 64 x 576 / 64 x 64 bf16 tiles, two rows of
#: float row factors, 1 KiB of slack to align the tiles to the 128-byte swizzle's 1 KiB. mma: Q tile, two key stages
#: and the P tile (bf16, padded pitches), four float rows of maxima and sums. mma_compact: Q tile, two key stages, and
#: 32 bytes of partial scores per thread.
SHAPES = {
    "wgmma": KernelShape(WGMMA_SOURCE, "mla_tree_verify_wgmma_", 64, 64, 256,
                         3 * 64 * QK_HEAD_DIM * 2 + 64 * 64 * 2 + 2 * 4 * 64 + 1024),
    "mma": KernelShape(MMA_SOURCE, "mla_tree_verify_", 64, 32, 256,
                       2 * (64 * _LDS + 2 * 32 * _LDS + 64 * (32 + 8)) + 4 * 4 * 64),
    "mma_compact": KernelShape("mla_tree_verify_compact.cu", "mla_tree_verify_compact_", 48, 16, 192,
                               2 * (48 * _LDS + 2 * 16 * _LDS) + 192 * 32),
}
KERNEL_ENV = "SGLANG_KDTREE_MLA_KERNEL"
KERNELS = tuple(SHAPES)
_MAX_SPLITS = 32
_MIN_KEYS_PER_SPLIT = 256  # below this the merge pass costs more than the extra parallelism gains
_GRAPH_MEAN_PREFIX = 4096  # context the split factor is planned for when the launch is captured in a CUDA graph


@functools.cache
def _kernels(kernel: str, device_index: int):
    """``kernel``'s two entry points (``i64``, ``i32``), the merge, and ``asked`` (the most shared memory a launch asks
    for), compiled once per process and checked against the device's limits (``limits.LaunchDoesNotFit`` names what
    does not fit)."""
    shape = SHAPES[kernel]
    if shape.source in runtime.ARCH_SPECIFIC:
        module = runtime.load_module_arch(shape.source, runtime.ARCH_SPECIFIC[shape.source])
    else:
        module = runtime.load_module(shape.source)
    fns = {name: module.get_function(shape.entry + name) for name in ("i64", "i32")}
    lim = limits.current(device_index)
    for name, fn in fns.items():
        limits.check_launch(f"mla_tree_verify ({kernel}, {name})", shape.threads, shape.smem_bytes,
                            fn.shared_size_bytes, lim, fn.num_regs,
                            fix=f"unset {KERNEL_ENV} (auto picks a kernel that fits)")
        fn.max_dynamic_shared_size_bytes = shape.smem_bytes  # above 48 KiB: the per-kernel opt-in
    fns["asked"] = shape.smem_bytes + max(fn.shared_size_bytes for fn in fns.values())
    fns["merge"] = runtime.load_module(MERGE_SOURCE).get_function("mla_tree_verify_merge")
    return fns


def kernel_option(kernel=None) -> str:
    """``auto`` or a name of ``KERNELS``: ``kernel`` or, when None, ``$SGLANG_KDTREE_MLA_KERNEL`` (default ``auto``),
    normalised; any other value is an error naming the variable (the plugin checks it when it registers)."""
    import os

    if kernel is None:
        kernel = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if kernel not in ("auto",) + KERNELS:
        raise ValueError(f"kdtree: MLA tree-verify kernel {kernel!r} (argument kernel= or {KERNEL_ENV}) is not one "
                         f"of auto|{'|'.join(KERNELS)}; unset {KERNEL_ENV} or pick one")
    return kernel


def choose_kernel(kernel, lim: limits.DeviceLimits) -> str:
    """The kernel a GPU with limits ``lim`` runs for ``kernel`` (``auto`` or a name; ``None`` reads the variable):
    ``auto`` takes wgmma where it runs, else mma where its shared memory fits, else mma_compact. Naming a kernel the
    GPU cannot run is an error naming the limit and the fix."""
    kernel = kernel_option(kernel)
    if kernel == "auto":
        if lim.wgmma:
            return "wgmma"
        return "mma" if SHAPES["mma"].smem_bytes <= lim.smem_per_block else "mma_compact"
    if kernel == "wgmma" and not lim.wgmma:
        raise ValueError(f"the wgmma MLA kernel needs compute capability 9.0 (sm_90a); this GPU is "
                         f"{lim.arch_name} ({lim.source}): use {KERNEL_ENV}=auto")
    if SHAPES[kernel].smem_bytes > lim.smem_per_block:
        raise ValueError(f"the {kernel} MLA kernel needs {SHAPES[kernel].smem_bytes:,} B of shared memory per block; "
                         f"{lim.arch_name} ({lim.source}) allows {lim.smem_per_block:,} B: use {KERNEL_ENV}=auto")
    return kernel


def resolve_kernel(kernel, device_index: int) -> str:
    """``choose_kernel`` for the limits of device ``device_index`` (or ``$KDTREE_DEVICE_PROFILE``'s)."""
    return choose_kernel(kernel, limits.current(device_index))


_counters: dict[tuple[int, str], torch.Tensor] = {}


def _launch_counter(device_index: int, kernel: str) -> torch.Tensor:
    """``uint64 [1]`` (stored as int64) count of ``kernel``'s tree-verify launches on a device (one counter per
    kernel, so the count also says which ran); every launch adds one on the device, so a launch recorded in a
    CUDA graph counts at each replay. Created by ``prepare`` (or the first launch), never inside a capture."""
    key = (device_index, kernel)
    if key not in _counters:
        _counters[key] = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", device_index))
    return _counters[key]


def prepare(device) -> None:
    """Compile the kernels (the merge's module, and the wgmma kernel where it is the one chosen) and create
    ``device``'s launch counter: call before a CUDA graph that will record the kernel is captured (neither a
    compile nor a fresh counter may happen inside a capture)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    kernel = resolve_kernel(None, index)
    _kernels(kernel, index)
    _launch_counter(index, kernel)


def launch_counts(device=None) -> dict[str, int]:
    """``{kernel: launches}`` of the fused tree-verify kernels on ``device`` (eagerly or in graph replays) in this
    process, for each kernel prepared or launched there; syncs. The worker's round log records it, which is how a
    CUDA server shows the kernel ran, and which one."""
    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    return {k: int(t.item()) for (i, k), t in sorted(_counters.items()) if i == index}


def launch_count(device=None) -> int:
    """All fused tree-verify launches on ``device`` in this process, both kernels together; syncs."""
    return sum(launch_counts(device).values())


def choose_num_splits(batch: int, rows_per_request: int, mean_keys: float, num_sms: int,
                      key_tile: int = 32, row_tile: int = 64) -> int:
    """Split-K factor: minimise (waves of CTAs) x (key tiles per CTA + fixed cost), with a merge penalty.

    One CTA per SM fits (its shared memory), so a wave is ``num_sms`` CTAs; small batches with long contexts
    split the keys so every SM has work, large batches keep one split (no partial-state traffic). ``key_tile`` /
    ``row_tile``: the kernel's keys per stage and rows per CTA (``SHAPES``); costs are counted in 32-key units.
    """
    ctas = batch * math.ceil(rows_per_request / row_tile)
    best, best_cost = 1, None
    for s in range(1, _MAX_SPLITS + 1):
        per = math.ceil(mean_keys / s / key_tile) * key_tile
        if s > 1 and per < _MIN_KEYS_PER_SPLIT:
            break
        waves = math.ceil(ctas * s / num_sms)
        cost = waves * (per / _KEY_UNIT + 2) + (6 if s > 1 else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def planned_num_splits(batch: int, rows_per_request: int, mean_prefix: float, width: int, num_sms: int,
                       kernel: str, capturing: bool = False) -> int:
    """The split-K factor a launch picks when none is given: ``choose_num_splits`` for ``mean_prefix`` prefix keys
    plus the ``width`` tree keys, in the ``kernel``'s key stages. ``capturing`` (the launch is being captured in a
    CUDA graph): a captured graph replays one split factor for every context, and SGLang's graph buffers
    (kv_indices, req_to_token) are sized for the longest, so the factor is planned for at most
    ``_GRAPH_MEAN_PREFIX`` prefix keys (any split factor is exact; this only bounds the partial-state scratch the
    graph keeps)."""
    if capturing:
        mean_prefix = min(mean_prefix, _GRAPH_MEAN_PREFIX)
    shape = SHAPES[kernel]
    return choose_num_splits(batch, rows_per_request, mean_prefix + width, num_sms, shape.key_tile, shape.row_tile)


def _require(cond: bool, exc, msg: str) -> None:
    if not cond:
        raise exc(msg)


def _check_common(q, kv_buffer, tree_slots, ancestor_bits, sm_scale, batch: int):
    _require(isinstance(q, torch.Tensor) and q.is_cuda, TypeError, "q must be a CUDA torch tensor")
    _require(q.dtype == torch.bfloat16, TypeError, f"q must be bfloat16, got {q.dtype}")
    _require(
        q.dim() == 3 and q.shape[2] == QK_HEAD_DIM,
        ValueError,
        f"q must be [bs*N, H, {QK_HEAD_DIM}] (q_nope | q_rope), got {tuple(q.shape)}",
    )
    _require(batch >= 1, ValueError, f"the batch must hold at least one request, got {batch}")
    tokens, heads = q.shape[0], q.shape[1]
    _require(
        tokens % batch == 0 and tokens > 0,
        ValueError,
        f"q has {tokens} rows, not a positive multiple of the batch size {batch} (expected bs*N rows)",
    )
    width = tokens // batch
    _require(heads >= 1, ValueError, "q has no heads")
    _require(kv_buffer.is_cuda and kv_buffer.device == q.device, ValueError, "kv_buffer must be on q's device")
    _require(kv_buffer.dtype == torch.bfloat16, TypeError, f"kv_buffer must be bfloat16, got {kv_buffer.dtype}")
    kv2 = kv_buffer.reshape(kv_buffer.shape[0], -1) if kv_buffer.dim() == 3 and kv_buffer.shape[1] == 1 else kv_buffer
    _require(
        kv2.dim() == 2 and kv2.shape[1] == QK_HEAD_DIM and kv2.stride(1) == 1,
        ValueError,
        f"kv_buffer must be [slots, {QK_HEAD_DIM}] or [slots, 1, {QK_HEAD_DIM}] with contiguous rows, got "
        f"shape {tuple(kv_buffer.shape)} strides {kv_buffer.stride()}",
    )
    _require(
        kv2.stride(0) % 8 == 0 and kv2.data_ptr() % 16 == 0,
        ValueError,
        "kv_buffer rows must start on 16-byte boundaries (row stride a multiple of 8 elements)",
    )
    _require(
        tree_slots.is_cuda and tree_slots.dim() == 1 and tree_slots.shape[0] == tokens,
        ValueError,
        f"tree_slots must be a 1-D CUDA tensor of bs*N = {tokens} slots, got {tuple(tree_slots.shape)}",
    )
    _require(
        tree_slots.dtype in (torch.int32, torch.int64),
        TypeError,
        f"tree_slots must be int32 or int64, got {tree_slots.dtype}",
    )
    words = (width + 31) // 32
    _require(
        ancestor_bits.is_cuda and tuple(ancestor_bits.shape) == (batch, width, words),
        ValueError,
        f"ancestor_bits must be [bs, N, ceil(N/32)] = {(batch, width, words)} on the GPU, got "
        f"{tuple(ancestor_bits.shape)}",
    )
    _require(
        ancestor_bits.dtype in (torch.int32, torch.uint32),
        TypeError,
        f"ancestor_bits must be uint32 (or int32 with the same bits), got {ancestor_bits.dtype}",
    )
    _require(
        isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0,
        ValueError,
        f"sm_scale must be a finite float > 0, got {sm_scale!r}",
    )
    return tokens, heads, width, words, kv2


def _prepare_out(out, lse, tokens, heads, device):
    if out is None:
        out = torch.empty((tokens, heads, KV_LORA_RANK), dtype=torch.bfloat16, device=device)
    _require(
        out.dtype == torch.bfloat16 and tuple(out.shape) == (tokens, heads, KV_LORA_RANK) and out.is_contiguous(),
        ValueError,
        f"out must be a contiguous bf16 [{tokens}, {heads}, {KV_LORA_RANK}] tensor, got {out.dtype} "
        f"{tuple(out.shape)}",
    )
    if lse is None:
        lse = torch.empty((tokens, heads), dtype=torch.float32, device=device)
    _require(
        lse.dtype == torch.float32 and tuple(lse.shape) == (tokens, heads) and lse.is_contiguous(),
        ValueError,
        f"lse must be a contiguous float32 [{tokens}, {heads}] tensor, got {lse.dtype} {tuple(lse.shape)}",
    )
    return out, lse


def _launch(q, kv2, kv_start, kv_end, kv_indices, tree_slots, ancestor_bits, sm_scale, out, lse, num_splits,
            mean_prefix, width, heads, words, kernel=None):
    import numpy as np

    device_index = q.device.index or 0
    kernel = resolve_kernel(kernel, device_index)
    batch = kv_start.shape[0]
    rows = q.shape[0] * heads
    rows_per_request = width * heads
    if num_splits is None:
        num_splits = planned_num_splits(batch, rows_per_request, mean_prefix, width,
                                        limits.current(device_index).sm_count, kernel,
                                        torch.cuda.is_current_stream_capturing())
    _require(
        isinstance(num_splits, int) and 1 <= num_splits <= 4096,
        ValueError,
        f"num_splits must be an int in [1, 4096], got {num_splits!r}",
    )
    q = q.contiguous()
    tree_slots = tree_slots.to(torch.int64)
    if num_splits > 1:
        part_o = torch.empty((num_splits, rows, KV_LORA_RANK), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_splits, rows, 2), dtype=torch.float32, device=q.device)
        part_o_ptr, part_ml_ptr = part_o.data_ptr(), part_ml.data_ptr()
    else:
        part_o_ptr = part_ml_ptr = 0
    fns = _kernels(kernel, device_index)
    shape = SHAPES[kernel]
    fn = fns["i32" if kv_indices.dtype == torch.int32 else "i64"]
    limits.record_launch("mla_verify", kernel, fns["asked"])
    grid = (math.ceil(rows_per_request / shape.row_tile), num_splits, batch)
    # Raw device pointers (np.uint64) instead of CuPy arrays: CuPy has no bfloat16 dtype, and the kernel
    # only needs addresses. Every tensor referenced here stays alive in this frame until the launch is queued.
    ptr = np.uint64
    args = (
        ptr(q.data_ptr()), ptr(kv2.data_ptr()), np.int64(kv2.stride(0)),
        ptr(kv_start.data_ptr()), ptr(kv_end.data_ptr()), ptr(kv_indices.data_ptr()),
        ptr(tree_slots.data_ptr()), ptr(ancestor_bits.data_ptr()),
        np.int32(width), np.int32(heads), np.int32(words), np.int32(num_splits),
        np.float32(sm_scale * math.log2(math.e)),
        ptr(out.data_ptr()), ptr(lse.data_ptr()), ptr(part_o_ptr), ptr(part_ml_ptr), np.int64(rows),
        ptr(_launch_counter(device_index, kernel).data_ptr()),
    )
    with runtime.current_stream():
        fn(grid, (shape.threads,), args, shared_mem=shape.smem_bytes)
        if num_splits > 1:
            fns["merge"](
                (rows,), (128,),
                (ptr(part_o_ptr), ptr(part_ml_ptr), np.int32(num_splits), np.int64(rows),
                 ptr(out.data_ptr()), ptr(lse.data_ptr())),
            )
    return out, lse


def mla_tree_verify(q, kv_buffer, kv_indptr, kv_indices, tree_slots, ancestor_bits, sm_scale, *, out=None,
                    lse=None, num_splits=None, kernel=None):
    """Tree-verify absorbed-MLA attention on the GPU (bf16 tensor cores, fp32 softmax).

    Args:
        q: ``[bs*N, H, 576]`` bf16 CUDA, ``q_nope | q_rope`` per (node, head), request-major.
        kv_buffer: ``[slots, 576]`` or ``[slots, 1, 576]`` bf16 CUDA, one layer of SGLang's MLA pool.
        kv_indptr: ``[bs+1]`` int32/int64 CUDA, CSR offsets into ``kv_indices`` (prefix keys only).
        kv_indices: ``[>= kv_indptr[-1]]`` int64 (or int32) CUDA, prefix token slots.
        tree_slots: ``[bs*N]`` int32/int64 CUDA, slot of tree node j of request b at ``b*N + j``
            (SGLang's ``out_cache_loc`` during TARGET_VERIFY).
        ancestor_bits: ``[bs, N, ceil(N/32)]`` uint32 (or int32) CUDA ancestor-or-self rows.
        sm_scale: softmax scale (float > 0).
        out: optional ``[bs*N, H, 512]`` bf16 output buffer (written fully).
        lse: optional ``[bs*N, H]`` float32 LSE buffer (natural log).
        num_splits: split-K factor over the keys; default from ``choose_num_splits``.
        kernel: ``"auto"`` or a name of ``KERNELS`` (module docstring); default ``$SGLANG_KDTREE_MLA_KERNEL``.

    Returns:
        ``(out [bs*N, H, 512] bf16, lse [bs*N, H] float32)``.
    """
    _require(
        isinstance(kv_indptr, torch.Tensor) and kv_indptr.is_cuda and kv_indptr.dim() == 1,
        ValueError,
        "kv_indptr must be a 1-D CUDA tensor of bs+1 offsets",
    )
    batch = kv_indptr.shape[0] - 1
    tokens, heads, width, words, kv2 = _check_common(q, kv_buffer, tree_slots, ancestor_bits, sm_scale, batch)
    _require(
        kv_indices.is_cuda and kv_indices.dim() == 1 and kv_indices.dtype in (torch.int32, torch.int64),
        TypeError,
        f"kv_indices must be a 1-D int32/int64 CUDA tensor, got {kv_indices.dtype} {tuple(kv_indices.shape)}",
    )
    out, lse = _prepare_out(out, lse, tokens, heads, q.device)
    indptr = kv_indptr.to(torch.int64)
    # kv_indices' length is host-known (no sync); SGLang sizes it to the batch's prefix total.
    mean_prefix = kv_indices.shape[0] / batch
    return _launch(q, kv2, indptr[:-1], indptr[1:], kv_indices.contiguous(), tree_slots, ancestor_bits, sm_scale,
                   out, lse, num_splits, mean_prefix, width, heads, words, kernel)


def mla_tree_verify_paged(q, kv_buffer, req_to_token, req_pool_indices, prefix_lens, tree_slots, ancestor_bits,
                          sm_scale, *, out=None, lse=None, num_splits=None, max_prefix_len=None, kernel=None):
    """``mla_tree_verify`` with the prefix addressed through ``req_to_token`` rows (the fa3 backend's view).

    Args:
        req_to_token: ``[pool_rows, max_context]`` int32 CUDA token-slot table (contiguous rows).
        req_pool_indices: ``[bs]`` int CUDA, the table row of each request.
        prefix_lens: ``[bs]`` int CUDA, committed prefix length P of each request (the tree is not in it).
        max_prefix_len: optional host-side bound on P, only used to pick the split-K factor.
        Other arguments and the result: as ``mla_tree_verify``.
    """
    batch = req_pool_indices.shape[0]
    tokens, heads, width, words, kv2 = _check_common(q, kv_buffer, tree_slots, ancestor_bits, sm_scale, batch)
    _require(
        req_to_token.is_cuda and req_to_token.dim() == 2 and req_to_token.stride(1) == 1
        and req_to_token.dtype in (torch.int32, torch.int64),
        TypeError,
        f"req_to_token must be a 2-D int32/int64 CUDA table with contiguous rows, got {req_to_token.dtype} "
        f"{tuple(req_to_token.shape)}",
    )
    _require(
        prefix_lens.shape == (batch,),
        ValueError,
        f"prefix_lens must be [bs] = [{batch}], got {tuple(prefix_lens.shape)}",
    )
    out, lse = _prepare_out(out, lse, tokens, heads, q.device)
    kv_start = req_pool_indices.to(torch.int64) * req_to_token.stride(0)
    kv_end = kv_start + prefix_lens.to(torch.int64)
    mean_prefix = req_to_token.shape[1] if max_prefix_len is None else max_prefix_len
    return _launch(q, kv2, kv_start, kv_end, req_to_token, tree_slots, ancestor_bits, sm_scale, out, lse,
                   num_splits, mean_prefix, width, heads, words, kernel)
