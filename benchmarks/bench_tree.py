"""pytest-benchmark cases for GPU tree construction (needs a GPU; skipped otherwise). The full stage table
with the CPU path and SGLang's kernel is ``python -m sglang_kdtree.cli.bench_gpu``."""

import pytest

from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_unavailable_reason() is not None, reason="needs a GPU")]


@pytest.fixture(scope="module", params=[(8, 64), (32, 64), (64, 512)], ids=lambda p: f"bs{p[0]}-B{p[1]}")
def setup(request):
    import torch

    from sglang_kdtree.cli.bench_gpu import peaked_logits
    from sglang_kdtree.gpu.tree import TreeBuilder

    bs, budget = request.param
    logits = peaked_logits(bs, 15, 163840, seed=bs)
    seq = torch.full((bs,), 512, dtype=torch.int64, device="cuda")
    width = budget + 1
    b = TreeBuilder(bs, budget, 15, 163840, "cuda", max_mask_bytes=512 * bs * width + width * width * bs)
    roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    b.round(logits, budget, roots, seq, 512 * bs)
    torch.cuda.synchronize()
    return b, logits, budget, roots, seq


def _sync(fn):
    import torch

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def test_topk(benchmark, setup):
    b, logits, budget, _, _ = setup
    benchmark(_sync(lambda: b.topk(logits, budget)))


def test_round_end_to_end(benchmark, setup):
    b, logits, budget, roots, seq = setup
    benchmark(_sync(lambda: b.round(logits, budget, roots, seq, int(seq.shape[0]) * 512)))
