"""GPU commit (``sglang_kdtree/kernels/kv_compact.cu``, ``sglang_kdtree/kernels/gather_hidden.cu``): twins of
``reference.commit_plan``, ``reference.compact_kv`` and ``reference.gather_hidden`` over torch CUDA tensors, no host
sync.

Typical round: the worker calls ``pipeline.GpuBackend``'s ``commit_plan`` / ``commit_kv`` / ``gather_hidden``
(or its ``accept_commit_greedy`` step graph), which run ``plan = commit_plan(res.accepted, res.accept_lens,
verify_slots)`` with the verify rows' slots ``req_to_token[req, P : P + N]``, then ``compact_kv(table, plan)``
with ``table = kv_layer_table(pool.kv_buffer)`` (MLA) or ``kv_layer_table(pool.k_buffer + pool.v_buffer)``
(MHA) built once per pool, and ``gather_hidden(hidden, plan)`` for the drafter.

Data-dependent errors (slot out of range, invalid path, bad hidden row) set bits in an ``int32 [1]``
device flag (``sglang_kdtree.gpu.errors``) and the offending request is not written; shapes, dtypes and
devices are checked on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sglang_kdtree.contract import CommitPlan
from sglang_kdtree.gpu import limits, runtime
from sglang_kdtree.gpu.runtime import device_ptr as _ptr
from sglang_kdtree.gpu.runtime import require_cuda as _require_cuda
from sglang_kdtree.gpu.errors import new_error_flag
from sglang_kdtree.state import MAX_WIDTH as _MAX_ROWS  # rows per request: the verify width

__all__ = [
    "KVLayerTable",
    "kv_layer_table",
    "commit_plan",
    "compact_kv",
    "gather_hidden",
]

_PLAN_THREADS = 128
_COMPACT_THREADS = 256  # = COMPACT_THREADS in kv_compact.cu
#: compaction blocks resident per SM; SMs x this is a wave (several waves balance the tail), and small batches split
#: rows until a launch has at least one wave
_BLOCKS_PER_SM = 4
_GATHER_THREADS = 128


@dataclass(frozen=True)
class KVLayerTable:
    """Layer buffers of one KV pool as a device array of base pointers (one launch moves every layer).

    Build once per pool with ``kv_layer_table``; the buffers must outlive the table (SGLang's pools
    keep theirs for the server's lifetime).
    """

    layer_ptrs: object  # [layers] int64 CUDA tensor of base addresses
    num_layers: int
    num_slots: int
    row_bytes: int
    slot_stride_bytes: int
    unit_bytes: int  # widest of 16/4/2/1 dividing row, stride and every base address
    device: object
    buffers: tuple  # keeps the tensors alive and lets the table be checked against a pool


def kv_layer_table(buffers) -> KVLayerTable:
    """Pointer table of a pool's layer buffers.

    Args:
        buffers: a list of per-layer CUDA tensors of identical shape ``[slots, ...]``, dtype and device,
            each with a contiguous row (``[slots, 1, 576]`` MLA, ``[slots, heads, head_dim]`` MHA k or v;
            pass ``k_buffer + v_buffer`` for MHA), or one tensor ``[layers, slots, ...]``.
    """
    import torch

    if isinstance(buffers, torch.Tensor):
        if buffers.dim() < 2:
            raise ValueError(f"a single KV tensor must be [layers, slots, ...], got shape {tuple(buffers.shape)}")
        buffers = list(buffers.unbind(0)) if buffers.dim() >= 3 else [buffers]
    buffers = tuple(buffers)
    if not buffers:
        raise ValueError("kv_layer_table needs at least one layer buffer")
    first = buffers[0]
    for i, b in enumerate(buffers):
        _require_cuda(f"buffers[{i}]", b)
        if b.dim() < 2:
            raise ValueError(f"buffers[{i}] must be [slots, ...], got shape {tuple(b.shape)}")
        if tuple(b.shape) != tuple(first.shape) or b.dtype != first.dtype or b.device != first.device:
            raise ValueError(
                f"buffers[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}, expected {tuple(first.shape)} "
                f"{first.dtype} on {first.device} like buffers[0]"
            )
        if b.stride() != first.stride():
            raise ValueError(f"buffers[{i}] has strides {b.stride()}, expected {first.stride()}")
    row = first[0]
    if not row.is_contiguous():
        raise ValueError("each slot's row must be contiguous (the pools' [slots, ...] layout)")
    esize = first.element_size()
    row_bytes = row.numel() * esize
    stride_bytes = first.stride(0) * esize
    ptrs = [b.data_ptr() for b in buffers]
    unit = 16
    while unit > 1 and (row_bytes % unit or stride_bytes % unit or any(p % unit for p in ptrs)):
        unit //= 2
    if unit == 8:
        unit = 4  # no 8-byte kernel variant; 4 divides whatever 8 divides
    # built lazily inside the first round that moves KV: a pinned, asynchronous upload keeps that round free of a
    # host sync (torch's pinned-memory allocator keeps the host copy until the copy has run)
    host = torch.tensor(ptrs, dtype=torch.int64)
    table = host.pin_memory().to(first.device, non_blocking=True) if first.is_cuda else host.to(first.device)
    return KVLayerTable(
        layer_ptrs=table,
        num_layers=len(buffers),
        num_slots=int(first.shape[0]),
        row_bytes=row_bytes,
        slot_stride_bytes=stride_bytes,
        unit_bytes=unit,
        device=first.device,
        buffers=buffers,
    )


@functools.cache
def _kernel(module: str, name: str):
    return runtime.load_module(module).get_function(name)


def commit_plan(accepted, accept_lens, verify_slots, *, errors=None, storage=None) -> CommitPlan:
    """KV moves and hidden rows that commit the accepted paths; twin of ``reference.commit_plan``.

    Args:
        accepted: ``[bs, M]`` int64 accepted node indices (``AcceptResult.accepted``), -1 padded.
        accept_lens: ``[bs]`` int64 tau.
        verify_slots: ``[bs, N]`` int64 or int32 KV slot of node i during verify (= position P+i after).
        errors: optional ``int32 [1]`` flag to OR into (e.g. the accept result's); a new one otherwise.
        storage: optional int64 CUDA tensor of at least ``3 * bs * M`` elements that holds the plan's three
            ``[bs, M]`` arrays (reused across rounds by the worker); else they are allocated.

    An invalid path (tau outside [1, min(M, N)], not starting at 0, not strictly increasing, a node
    >= N) sets bit 64 and leaves that request's rows -1, which ``compact_kv`` and ``gather_hidden`` skip.
    """
    import torch

    for name, t in (("accepted", accepted), ("accept_lens", accept_lens), ("verify_slots", verify_slots)):
        _require_cuda(name, t)
    if accepted.dtype != torch.int64 or accept_lens.dtype != torch.int64:
        raise TypeError(f"accepted and accept_lens must be int64, got {accepted.dtype} and {accept_lens.dtype}")
    if verify_slots.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"verify_slots must be int64 or int32, got {verify_slots.dtype}")
    if accepted.dim() != 2 or verify_slots.dim() != 2:
        raise ValueError(f"accepted {tuple(accepted.shape)} and verify_slots {tuple(verify_slots.shape)} must be 2-D")
    bs, m = accepted.shape
    width = verify_slots.shape[1]
    if verify_slots.shape[0] != bs or tuple(accept_lens.shape) != (bs,):
        raise ValueError(
            f"batch mismatch: accepted {tuple(accepted.shape)}, accept_lens {tuple(accept_lens.shape)}, "
            f"verify_slots {tuple(verify_slots.shape)}"
        )
    if verify_slots.stride(1) != 1:
        verify_slots = verify_slots.contiguous()
    device = accepted.device
    errors = new_error_flag(device) if errors is None else errors
    if storage is None:
        storage = torch.empty(3 * bs * m, dtype=torch.int64, device=device)
    elif storage.dtype != torch.int64 or storage.device != device or storage.numel() < 3 * bs * m:
        raise ValueError(f"storage must be int64 on {device} with >= {3 * bs * m} elements, got {storage.dtype} "
                         f"{storage.numel()} on {storage.device}")
    src, dst, rows = storage[: 3 * bs * m].view(3, bs, m).unbind(0)
    plan = CommitPlan(src_slots=src, dst_slots=dst, hidden_rows=rows, accept_lens=accept_lens, errors=errors)
    if bs == 0 or m == 0:
        return plan
    name = "commit_plan_i64" if verify_slots.dtype == torch.int64 else "commit_plan_i32"
    with runtime.current_stream():
        _kernel("kv_compact.cu", name)(
            (bs,), (_PLAN_THREADS,),
            (_ptr(accepted.contiguous()), _ptr(accept_lens.contiguous()), _ptr(verify_slots),
             np.int64(verify_slots.stride(0)), np.int32(bs), np.int32(m), np.int32(width),
             _ptr(plan.src_slots), _ptr(plan.dst_slots), _ptr(plan.hidden_rows), _ptr(errors)),
        )
    return plan


def compact_kv(kv, plan, *, errors=None):
    """Apply a commit plan in place to every layer of a pool in one launch; twin of ``reference.compact_kv``.

    Args:
        kv: a ``KVLayerTable`` (build once per pool), or what ``kv_layer_table`` accepts.
        plan: ``CommitPlan`` (or any object with ``src_slots``, ``dst_slots`` ``[bs, M]`` int64 and
            ``accept_lens`` ``[bs]`` int64 CUDA tensors). Different requests' slots must be disjoint.
        errors: ``int32 [1]`` flag to OR into; default ``plan.errors`` if present, else a new one.

    Returns:
        the errors flag. Rows with ``src == dst`` are not touched; a request with a slot outside
        ``[0, slots)`` sets bit 128 and is not moved at all.
    """
    import torch

    table = kv if isinstance(kv, KVLayerTable) else kv_layer_table(kv)
    src, dst, lens = plan.src_slots, plan.dst_slots, plan.accept_lens
    for name, t in (("plan.src_slots", src), ("plan.dst_slots", dst), ("plan.accept_lens", lens)):
        _require_cuda(name, t)
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
        if t.device != table.device:
            raise ValueError(f"{name} is on {t.device}, the KV pool on {table.device}")
    if src.dim() != 2 or tuple(dst.shape) != tuple(src.shape) or tuple(lens.shape) != (src.shape[0],):
        raise ValueError(
            f"plan shapes disagree: src {tuple(src.shape)}, dst {tuple(dst.shape)}, accept_lens {tuple(lens.shape)}"
        )
    bs, m = src.shape
    if m > _MAX_ROWS:
        raise ValueError(f"plan has {m} columns, more than the kernel's {_MAX_ROWS} rows per request")
    if errors is None:
        errors = getattr(plan, "errors", None)
        if errors is None:
            errors = new_error_flag(table.device)
    if bs == 0 or m == 0:
        return errors
    unit = table.unit_bytes
    row_units = table.row_bytes // unit
    # large batches: several layers per block (the plan is read once per block); small batches: split the
    # rows by columns so layers x requests still fill the SMs
    wave = _BLOCKS_PER_SM * limits.current(table.device.index).sm_count
    layers_per_block = max(1, min(table.num_layers, table.num_layers * bs // (3 * wave)))
    groups = -(-table.num_layers // layers_per_block)
    blocks = groups * bs
    splits = max(1, min(-(-wave // blocks), row_units // 8 or 1))
    kernel = _kernel("kv_compact.cu", {16: "compact_kv_16B", 4: "compact_kv_4B", 2: "compact_kv_2B", 1: "compact_kv_1B"}[unit])
    with runtime.current_stream():
        kernel(
            (groups, bs, splits), (_COMPACT_THREADS,),
            (_ptr(table.layer_ptrs), np.int32(table.num_layers), np.int32(layers_per_block),
             np.int64(table.slot_stride_bytes // unit), np.int64(row_units),
             np.int64(table.num_slots), _ptr(src.contiguous()), _ptr(dst.contiguous()), _ptr(lens.contiguous()),
             np.int32(m), _ptr(errors)),
        )
    return errors


def gather_hidden(hidden, plan, *, errors=None, out=None):
    """The accepted rows of the verify hidden states, packed per request; twin of ``reference.gather_hidden``.

    Args:
        hidden: ``[bs*N, D]`` CUDA tensor (any dtype; rows contiguous).
        plan: ``CommitPlan`` (uses ``hidden_rows`` ``[bs, M]``).
        errors: ``int32 [1]`` flag to OR into (default ``plan.errors``).
        out: optional contiguous ``[bs, M, D]`` tensor of hidden's dtype to write into (else allocated).

    Returns:
        ``[bs, M, D]`` tensor of hidden's dtype: row j < tau of request b is ``hidden[b*N + accepted[b, j]]``
        (the accepted rows, not the first tau), zeros past tau.
    """
    import torch

    _require_cuda("hidden", hidden)
    rows = plan.hidden_rows
    _require_cuda("plan.hidden_rows", rows)
    if rows.dtype != torch.int64 or rows.dim() != 2:
        raise TypeError(f"plan.hidden_rows must be [bs, M] int64, got {tuple(rows.shape)} {rows.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [bs*N, D], got shape {tuple(hidden.shape)}")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if errors is None:
        errors = getattr(plan, "errors", None)
        if errors is None:
            errors = new_error_flag(hidden.device)
    bs, m = rows.shape
    d = hidden.shape[1]
    if out is None:
        out = torch.empty((bs, m, d), dtype=hidden.dtype, device=hidden.device)
    elif tuple(out.shape) != (bs, m, d) or out.dtype != hidden.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {hidden.dtype} [{bs}, {m}, {d}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if out.numel() == 0:
        return out
    esize = hidden.element_size()
    row_bytes, ld_bytes = d * esize, hidden.stride(0) * esize
    unit = 16
    while unit > 2 and (row_bytes % unit or ld_bytes % unit or hidden.data_ptr() % unit):
        unit //= 2
    if unit == 8:
        unit = 4
    if row_bytes % unit or ld_bytes % unit:
        raise ValueError(f"hidden rows of {row_bytes} bytes are not a multiple of 2 bytes")
    with runtime.current_stream():
        _kernel("gather_hidden.cu", {16: "gather_hidden_16B", 4: "gather_hidden_4B", 2: "gather_hidden_2B"}[unit])(
            (bs * m,), (_GATHER_THREADS,),
            (_ptr(hidden), np.int64(ld_bytes // unit), np.int64(hidden.shape[0]), np.int64(row_bytes // unit),
             _ptr(rows.contiguous()), _ptr(out), _ptr(errors)),
        )
    return out
