"""GPU commit (sglang_kdtree/kernels/kv_compact.cu, sglang_kdtree/kernels/gather_hidden.cu) against
reference.commit_plan, reference.compact_kv and reference.gather_hidden: byte-exact, on random accepted paths and slot
layouts, the aliasing case accepted = [0, 2, 3], in-place paths, MLA and MHA pool layouts, unaligned rows, and
out-of-range slots (flagged, nothing written). Outputs come from a poisoned allocator."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_poison
from sglang_kdtree import reference as ref

pytestmark = pytest.mark.gpu


def _torch():
    import torch

    return torch


def poison_allocator():
    """Fill freed cache blocks (both of the allocator's pools) with garbage so torch.empty outputs start poisoned."""
    cuda_poison.poison_allocator(0x5A)


def random_paths(rng, bs, width, max_len):
    """accepted [bs, M] (strictly increasing from 0, -1 padded) and tau; includes in-place and [0,2,3]."""
    m = max_len
    accepted = np.full((bs, m), -1, dtype=np.int64)
    tau = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        t = int(rng.integers(1, min(m, width) + 1))
        kind = (b + 2) % 4  # request 0 gets a random path (single-request cases move rows)
        if kind == 0:
            path = np.arange(t)  # already in place
        elif kind == 1 and width >= 4 and m >= 3:
            path, t = np.array([0, 2, 3]), 3  # destination of row 1 is the source of row 2
        else:
            path = np.concatenate([[0], np.sort(rng.choice(np.arange(1, width), size=t - 1, replace=False))])
        accepted[b, :t] = path
        tau[b] = t
    return accepted, tau


def random_verify_slots(rng, bs, width, num_slots):
    slots = rng.permutation(num_slots)[: bs * width].reshape(bs, width)
    return slots.astype(np.int64)


def cuda(a):
    torch = _torch()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def test_commit_plan_matches_reference():
    torch = _torch()
    from sglang_kdtree.gpu.compact import commit_plan

    rng = np.random.default_rng(1)
    for bs, width, m in ((1, 1, 1), (7, 17, 16), (64, 257, 16), (3, 1025, 1025)):
        accepted, tau = random_paths(rng, bs, width, m)
        slots = random_verify_slots(rng, bs, width, bs * width + 100)
        expect = ref.commit_plan(accepted, tau, slots)
        for dtype in (torch.int64, torch.int32):
            poison_allocator()
            plan = commit_plan(cuda(accepted), cuda(tau), cuda(slots).to(dtype))
            np.testing.assert_array_equal(plan.src_slots.cpu().numpy(), expect.src_slots)
            np.testing.assert_array_equal(plan.dst_slots.cpu().numpy(), expect.dst_slots)
            np.testing.assert_array_equal(plan.hidden_rows.cpu().numpy(), expect.hidden_rows)
            assert int(plan.errors.item()) == 0


def test_commit_plan_flags_invalid_paths():
    from sglang_kdtree.gpu.compact import commit_plan

    accepted = np.array([[0, 2, 1, -1], [1, 2, -1, -1], [0, 5, -1, -1], [0, 1, 2, 3]], dtype=np.int64)
    tau = np.array([3, 2, 2, 5], dtype=np.int64)  # not increasing, not from 0, node >= N, tau > M
    slots = np.arange(4 * 4, dtype=np.int64).reshape(4, 4)
    for b in range(4):
        plan = commit_plan(cuda(accepted[b : b + 1]), cuda(tau[b : b + 1]), cuda(slots[b : b + 1]))
        assert int(plan.errors.item()) == 64
        assert (plan.src_slots.cpu().numpy() == -1).all()


def test_invalid_paths_in_a_batch_end_only_their_own_rows():
    """Four invalid paths beside two valid ones (one a real move, one the root alone), into poisoned storage:
    the bad requests' rows are all -1 and flagged, the good ones equal the reference's."""
    torch = _torch()
    from sglang_kdtree.gpu.compact import commit_plan

    accepted = np.array([[0, 2, 1, -1], [1, 2, -1, -1], [0, 5, -1, -1], [0, 1, 2, 3], [0, 1, 3, -1],
                         [0, -1, -1, -1]], dtype=np.int64)
    tau = np.array([3, 2, 2, 5, 3, 1], dtype=np.int64)
    bs, m = accepted.shape
    slots = (np.arange(bs * 4, dtype=np.int64).reshape(bs, 4) * 3 + 100)
    storage = torch.full((3 * bs * m,), 0x5A5A5A5A5A5A5A5A, dtype=torch.int64, device="cuda")
    plan = commit_plan(cuda(accepted), cuda(tau), cuda(slots), storage=storage)
    assert int(plan.errors.item()) == 64
    fixed_acc, fixed_tau = accepted.copy(), tau.copy()  # the bad requests replaced by root-only paths
    fixed_acc[:4] = [0, -1, -1, -1]
    fixed_tau[:4] = 1
    expect = ref.commit_plan(fixed_acc, fixed_tau, slots)
    for name in ("src_slots", "dst_slots", "hidden_rows"):
        got = getattr(plan, name).cpu().numpy()
        assert (got[:4] == -1).all(), name
        np.testing.assert_array_equal(got[4:], getattr(expect, name)[4:], err_msg=name)
    assert getattr(expect, "src_slots")[4, 2] != getattr(expect, "dst_slots")[4, 2]  # request 4 really moves


def _check_compact(kv_layers_np, plan_np, table_arg, torch_layers, errors_expected=0):
    """Apply ours on the GPU tensors and the reference on a numpy copy, compare bytes."""
    from sglang_kdtree.contract import CommitPlan
    from sglang_kdtree.gpu.compact import compact_kv

    expect = kv_layers_np.copy()
    if errors_expected == 0:
        ref.compact_kv(expect, plan_np)
    plan = CommitPlan(
        src_slots=cuda(plan_np.src_slots), dst_slots=cuda(plan_np.dst_slots), hidden_rows=cuda(plan_np.hidden_rows),
        accept_lens=cuda(plan_np.accept_lens), errors=_torch().zeros(1, dtype=_torch().int32, device="cuda"),
    )
    errors = compact_kv(table_arg, plan)
    assert int(errors.item()) == errors_expected
    got = np.stack([t.cpu().numpy() for t in torch_layers]).reshape(expect.shape)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("bs,layers,width", [(1, 61, 65), (13, 5, 65), (128, 3, 65), (64, 61, 17)])
def test_mla_pool_byte_exact(bs, layers, width):
    """SGLang MLA layout: one [slots, 1, 576] bf16 buffer per layer, random bits (NaN patterns too).
    (1, 61): column splits; (64, 61): several layers per block."""
    torch = _torch()
    from sglang_kdtree.gpu.compact import kv_layer_table

    rng = np.random.default_rng(bs)
    m = 16
    num_slots = bs * width + 37
    bufs_np = rng.integers(-(1 << 15), 1 << 15, size=(layers, num_slots, 1, 576), dtype=np.int16)
    bufs = [torch.from_numpy(bufs_np[i]).cuda().view(torch.bfloat16) for i in range(layers)]
    accepted, tau = random_paths(rng, bs, width, m)
    plan = ref.commit_plan(accepted, tau, random_verify_slots(rng, bs, width, num_slots))
    table = kv_layer_table(bufs)
    assert table.unit_bytes == 16 and table.row_bytes == 1152
    views = [b.view(torch.int16) for b in bufs]
    _check_compact(bufs_np.reshape(layers, num_slots, 576), plan, table, views)


def test_mha_pool_k_and_v_in_one_launch():
    torch = _torch()
    from sglang_kdtree.gpu.compact import kv_layer_table

    rng = np.random.default_rng(2)
    layers, num_slots, heads, hd = 4, 3000, 8, 128
    bs, width, m = 9, 257, 16
    k = [torch.randn(num_slots, heads, hd, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(num_slots, heads, hd, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    before = np.stack([t.view(torch.int16).cpu().numpy() for t in k + v]).reshape(2 * layers, num_slots, -1)
    accepted, tau = random_paths(rng, bs, width, m)
    plan = ref.commit_plan(accepted, tau, random_verify_slots(rng, bs, width, num_slots))
    _check_compact(before, plan, kv_layer_table(k + v), [t.view(torch.int16) for t in k + v])


@pytest.mark.parametrize("dtype_name,dim,unit", [("float32", 3, 4), ("float16", 3, 2), ("uint8", 5, 1), ("float16", 8, 16)])
def test_unaligned_rows_single_tensor(dtype_name, dim, unit):
    torch = _torch()
    from sglang_kdtree.gpu.compact import kv_layer_table

    rng = np.random.default_rng(dim)
    layers, num_slots, bs, width, m = 3, 500, 6, 33, 8
    dtype = getattr(torch, dtype_name)
    kv = torch.randint(0, 250, (layers, num_slots, dim), device="cuda").to(dtype)
    accepted, tau = random_paths(rng, bs, width, m)
    plan = ref.commit_plan(accepted, tau, random_verify_slots(rng, bs, width, num_slots))
    table = kv_layer_table(kv)
    assert table.unit_bytes == unit
    _check_compact(kv.cpu().numpy(), plan, table, list(kv.unbind(0)))


def test_the_layer_table_is_built_without_a_host_sync():
    """It is built lazily inside a decode round, which on the overlap scheduler must not wait for the device:
    torch's sync detector raises on any synchronising call; the table's pointers are checked on the device."""
    torch = _torch()
    from sglang_kdtree.gpu.compact import kv_layer_table

    bufs = [torch.zeros(64, 1, 576, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = kv_layer_table(bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert table.layer_ptrs.tolist() == [b.data_ptr() for b in bufs]


def test_out_of_range_slot_is_flagged_and_not_written():
    torch = _torch()
    from sglang_kdtree.gpu.compact import kv_layer_table

    layers, num_slots = 3, 64
    kv = torch.randint(-1000, 1000, (layers, num_slots, 576), device="cuda", dtype=torch.int16)
    before = kv.cpu().numpy()
    plan = ref.CommitPlan(
        src_slots=np.array([[10, 12, 13], [20, 21, 22]]), dst_slots=np.array([[10, 11, num_slots], [20, 21, 22]]),
        hidden_rows=np.array([[0, 2, 3], [4, 5, 6]]), accept_lens=np.array([3, 3]),
    )
    # _check_compact with errors expected compares against the untouched pool
    _check_compact(before, plan, kv_layer_table(kv), list(kv.unbind(0)), errors_expected=128)
    plan2 = ref.CommitPlan(src_slots=np.array([[-5, 3]]), dst_slots=np.array([[1, 2]]),
                           hidden_rows=np.array([[0, 1]]), accept_lens=np.array([2]))
    _check_compact(before, plan2, kv_layer_table(kv), list(kv.unbind(0)), errors_expected=128)


def test_gpu_plan_then_compact_end_to_end():
    """accept -> GPU plan -> compact, against the reference chain."""
    torch = _torch()
    from sglang_kdtree.gpu.compact import commit_plan, compact_kv

    rng = np.random.default_rng(9)
    bs, width, m, layers = 12, 17, 16, 2
    num_slots = 8000
    # distinct slots inside every verify window (the allocator's guarantee)
    perm = rng.permutation(num_slots)[: bs * width].reshape(bs, width).astype(np.int32)
    slots = cuda(perm).to(torch.int64)
    accepted, tau = random_paths(rng, bs, width, m)
    plan = commit_plan(cuda(accepted), cuda(tau), slots)
    kv = torch.randint(-30000, 30000, (layers, num_slots, 576), device="cuda", dtype=torch.int16)
    expect = kv.cpu().numpy()
    ref.compact_kv(expect, ref.commit_plan(accepted, tau, perm.astype(np.int64)))
    compact_kv(kv, plan)
    assert int(plan.errors.item()) == 0
    np.testing.assert_array_equal(kv.cpu().numpy(), expect)


@pytest.mark.parametrize("dtype_name,d", [("bfloat16", 7168), ("float32", 1000), ("float16", 3)])
def test_gather_hidden_out_zeroes_bad_and_padding_rows_and_flags_bad_ones(dtype_name, d):
    """Into a caller's NaN-poisoned ``out`` (the backend always passes one): a valid row is copied, a padding
    row (-1) is zeroed silently, and a row index past the verify rows or below -1 is zeroed and flagged."""
    torch = _torch()
    from sglang_kdtree.gpu.compact import gather_hidden
    from sglang_kdtree.gpu.errors import ERR_BAD_HIDDEN_ROW

    bs, width = 2, 9
    dtype = getattr(torch, dtype_name)
    hidden = torch.randn(bs * width, d, device="cuda").to(dtype)
    plan = type("Plan", (), {})()  # what gather_hidden reads of a commit plan
    plan.hidden_rows = torch.tensor([[0, 4, -1, -1], [width + 3, -1, -1, -1]], dtype=torch.int64, device="cuda")
    plan.errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((bs, 4, d), float("nan"), dtype=dtype, device="cuda")
    assert gather_hidden(hidden, plan, out=out) is out
    assert int(plan.errors.item()) == 0
    assert torch.equal(out[0, 0], hidden[0]) and torch.equal(out[0, 1], hidden[4])
    assert torch.equal(out[1, 0], hidden[width + 3])  # request 1's rows start at width
    assert torch.equal(out[0, 2:], torch.zeros_like(out[0, 2:])) and torch.equal(out[1, 1:], torch.zeros_like(out[1, 1:]))
    for bad in (bs * width, -2):
        plan.hidden_rows[1, 0] = bad
        out.fill_(float("nan"))
        gather_hidden(hidden, plan, out=out)
        assert int(plan.errors.item()) == ERR_BAD_HIDDEN_ROW
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.equal(out[0, 1], hidden[4])
        plan.errors.zero_()


@pytest.mark.parametrize("dtype_name,d", [("bfloat16", 7168), ("float32", 1000), ("float16", 3)])
def test_gather_hidden_matches_reference(dtype_name, d):
    torch = _torch()
    from sglang_kdtree.gpu.compact import commit_plan, gather_hidden

    rng = np.random.default_rng(d)
    bs, width, m = 10, 65, 16
    hidden = torch.randn(bs * width, d, device="cuda").to(getattr(torch, dtype_name))
    accepted, tau = random_paths(rng, bs, width, m)
    slots = random_verify_slots(rng, bs, width, bs * width)
    plan_np = ref.commit_plan(accepted, tau, slots)
    poison_allocator()
    out = gather_hidden(hidden, commit_plan(cuda(accepted), cuda(tau), cuda(slots)))
    h = hidden.view(torch.int16 if hidden.element_size() == 2 else torch.int32).cpu().numpy()
    expect = ref.gather_hidden(h, plan_np)
    got = out.view(torch.int16 if hidden.element_size() == 2 else torch.int32).cpu().numpy()
    np.testing.assert_array_equal(got, expect)
    # the accepted rows, not the first tau rows: a path that skips nodes must differ from rows 0..tau-1
    b = next(i for i in range(bs) if accepted[i, tau[i] - 1] != tau[i] - 1)
    assert not np.array_equal(got[b, : tau[b]], h[b * width : b * width + tau[b]])
