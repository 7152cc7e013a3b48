"""Boundary validation of the GPU accept/commit launchers, without a GPU: bad dtypes, shapes and
devices are refused on the host with errors that name the argument (no kernel is compiled or run)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_kdtree.contract import CommitPlan  # noqa: E402
from sglang_kdtree.gpu import accept, compact  # noqa: E402
from sglang_kdtree.gpu.errors import describe_device_error  # noqa: E402


class Trees:
    def __init__(self, bs=2, width=5, dtype=torch.int64):
        self.tokens = torch.zeros((bs, width), dtype=dtype)
        self.parents = torch.full((bs, width), -1, dtype=torch.int64)
        self.num_nodes = torch.zeros(bs, dtype=torch.int64)


def test_accept_rejects_bad_trees():
    ids = torch.zeros((2, 5), dtype=torch.int64)
    with pytest.raises(TypeError, match="trees.tokens must have dtype"):
        accept.accept_greedy(Trees(dtype=torch.int32), ids)
    t = Trees()
    t.parents = torch.zeros((2, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="trees shapes disagree"):
        accept.accept_greedy(t, ids)
    with pytest.raises(TypeError, match="missing .tokens"):
        accept.accept_greedy(object(), ids)
    with pytest.raises(ValueError, match=r"verify width N = 1026"):
        accept.accept_greedy(Trees(width=1026), ids)


def test_accept_refuses_cpu_tensors_with_a_pointer_to_the_reference():
    with pytest.raises(ValueError, match="reference.accept_greedy"):
        accept.accept_greedy(Trees(), torch.zeros((2, 5), dtype=torch.int64))
    with pytest.raises(ValueError, match="reference.accept_sampled"):
        accept.accept_sampled(Trees(), torch.zeros((10, 8)), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                              torch.zeros(2, dtype=torch.int64))


def test_max_depth_and_seq_lens_checks():
    # the checks after the device check are exercised through the helpers directly
    assert accept._check_max_depth(None, 5) == 4
    assert accept._check_max_depth(15, 5) == 15  # the draft depth may exceed N - 1 (small budgets)
    with pytest.raises(ValueError, match="max_depth = -1 must be >= 0"):
        accept._check_max_depth(-1, 5)
    with pytest.raises(TypeError, match="max_depth must be an int"):
        accept._check_max_depth(2.0, 5)
    with pytest.raises(ValueError, match="seq_lens is required"):
        accept._check_seq_lens(None, 2, torch.device("cpu"), required=True)
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\)"):
        accept._check_seq_lens(torch.zeros(3, dtype=torch.int64), 2, torch.device("cpu"), required=False)


def test_logits_shape_dtype_and_vocab_checks():
    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match="target_logits must have dtype"):
        accept._check_logits(torch.zeros((10, 8), dtype=torch.float16), 2, 5, cpu)
    with pytest.raises(ValueError, match=r"expected \[bs\*N = 10, V\]"):
        accept._check_logits(torch.zeros((9, 8)), 2, 5, cpu)
    with pytest.raises(ValueError, match=r"expected \[2, 5, V\]"):
        accept._check_logits(torch.zeros((2, 4, 8)), 2, 5, cpu)
    t, vocab, ld = accept._check_logits(torch.zeros((2, 5, 8)), 2, 5, cpu)
    assert (tuple(t.shape), vocab, ld) == ((10, 8), 8, 8)
    wide = torch.zeros((10, 12))[:, :8]
    assert accept._check_logits(wide, 2, 5, cpu)[2] == 12  # strided rows are read in place


def test_commit_functions_refuse_cpu_tensors():
    a = torch.zeros((2, 3), dtype=torch.int64)
    with pytest.raises(ValueError, match="accepted is on cpu"):
        compact.commit_plan(a, torch.ones(2, dtype=torch.int64), a)
    with pytest.raises(ValueError, match=r"buffers\[0\] is on cpu"):
        compact.kv_layer_table([torch.zeros((4, 576), dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one layer"):
        compact.kv_layer_table([])
    with pytest.raises(ValueError, match="hidden is on cpu"):
        compact.gather_hidden(torch.zeros((6, 4)), CommitPlan(a, a, a, a[:, 0], None))


def test_error_bits_are_described():
    msgs = describe_device_error(4 | 128)
    assert any("max_depth" in m for m in msgs) and any("slot" in m for m in msgs)
    assert describe_device_error(0) == []
    assert "unknown" in describe_device_error(1 << 20)[0]
