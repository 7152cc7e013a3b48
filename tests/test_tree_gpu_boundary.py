"""Boundary validation of the GPU tree-construction launchers; runs without a GPU (errors are raised
before any kernel or CUDA call)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_kdtree.contract import Trees  # noqa: E402
from sglang_kdtree.gpu import topk, tree, verify  # noqa: E402


def test_topk_rejects_bad_k_and_inputs():
    x = torch.zeros(2, 10)
    with pytest.raises(TypeError, match="k must be an int"):
        topk.topk_logprobs(x, 1.5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk.topk_logprobs(x, 0)
    with pytest.raises(ValueError, match="exceeds the GPU top-K limit"):
        topk.topk_logprobs(x, 2000)
    with pytest.raises(TypeError, match="torch CUDA tensor"):
        topk.topk_logprobs(np.zeros((2, 10), dtype=np.float32), 4)
    with pytest.raises(ValueError, match="move it to the GPU"):
        topk.topk_logprobs(x, 4)


def test_tree_rejects_bad_budget_and_types():
    lp = torch.zeros(1, 2, 3)
    with pytest.raises(TypeError, match="budget must be an int"):
        tree.build_trees(lp, lp.long(), 2.0, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds MAX_BUDGET"):
        tree.build_trees(lp, lp.long(), 5000, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="move it to the GPU"):
        tree.build_trees(lp, lp.long(), 4, torch.zeros(1, dtype=torch.int64))


def test_verify_rejects_cpu_trees():
    z = torch.zeros(2, 5, dtype=torch.int64)
    t = Trees(z, z, z, torch.zeros(2, dtype=torch.int64), scores=z.double(), ranks=z)
    with pytest.raises(ValueError, match="move it to the GPU"):
        verify.verify_inputs(t, torch.zeros(2, dtype=torch.int64), seq_lens_sum=0)


def test_error_bits_are_documented():
    assert set(topk.TOPK_ERRORS) == {1 << b for b in range(10, 18)}  # the tree-construction bits of gpu.errors
