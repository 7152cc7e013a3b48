"""What the GPU top-K, tree and verify-input tests share: the kernel modules, the exact comparisons against
the numpy reference (``sglang_kdtree.reference``), random sorted draft rows, and the poison values written
into output buffers first (an unwritten byte then fails the comparison)."""

import numpy as np
import torch

from sglang_kdtree import reference as ref


def gpu_modules():
    from sglang_kdtree.gpu import topk, tree, verify

    return topk, tree, verify


def _lse64(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def check_topk(logits_np, k, gpu_lp, gpu_ids):
    lp, ids = ref.topk_logprobs(logits_np, k)
    np.testing.assert_array_equal(gpu_ids.cpu().numpy(), ids)
    lse = _lse64(logits_np.reshape(-1, logits_np.shape[-1]).astype(np.float32)).reshape(logits_np.shape[:-1])
    tol = 2e-6 * np.maximum(1.0, np.abs(lse))[..., None]
    got = gpu_lp.cpu().numpy()
    fin = np.isfinite(lp)
    assert np.array_equal(np.isfinite(got), fin)
    assert np.all(np.abs(got[fin].astype(np.float64) - lp[fin]) <= np.broadcast_to(tol, lp.shape)[fin])


def sorted_rows(rng, bs, depth, k, tie_heavy):
    if tie_heavy:
        lp = -(rng.integers(0, 6, size=(bs, depth, k)) / 8.0)
    else:
        lp = -np.abs(rng.normal(0, 2, size=(bs, depth, k)))
    lp = -np.sort(-lp, axis=-1).astype(np.float32)
    if rng.random() < 0.3 and k > 1:
        cut = rng.integers(1, k + 1)
        lp[:, rng.integers(0, depth), cut:] = -np.inf
    ids = rng.integers(0, 100000, size=(bs, depth, k)).astype(np.int64)
    return lp, ids


def compare_trees(got, want, scores_want=None):
    for f in ("tokens", "depths", "parents", "num_nodes"):
        np.testing.assert_array_equal(getattr(got, f).cpu().numpy(), getattr(want, f), err_msg=f)


def poisoned_build(tree, lp, ids, budget, roots):
    out = tree._alloc_tree(lp.shape[0], max(budget, 0) + 1, "cuda")
    for t in (out.tokens, out.depths, out.parents, out.ranks, out.num_nodes):
        t.fill_(12345)  # poison
    out.scores.fill_(-7.25)
    return tree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget,
                            torch.from_numpy(roots).cuda(), out=out, check=True)


def compare_full(got, lp, ids, budget, roots):
    """Every output of every request against reference.build_tree: tokens, depths, parents, ranks, scores
    (bytes), num_nodes, and the padding rows."""
    compare_trees(got, ref.build_trees(lp, ids, budget, roots))
    ranks, scores = got.ranks.cpu().numpy(), got.scores.cpu().numpy()
    for b in range(lp.shape[0]):
        t = ref.build_tree(lp[b], ids[b], budget)
        n = t.num_nodes
        np.testing.assert_array_equal(ranks[b, 1: n + 1], t.ranks)
        assert scores[b, 1: n + 1].tobytes() == t.scores.tobytes()
        assert ranks[b, 0] == -1 and (ranks[b, n + 1:] == -1).all()
        assert scores[b, 0] == 0.0 and (scores[b, n + 1:] == 0.0).all()


VERIFY_POISON = -7  # no id, position, link or retrieve index the kernel writes is negative but -1


MASK_POISON = 0x5A  # a FULL_MASK byte the kernel writes is 0 or 1


def poison_verify_out(out):
    """Every verify-input buffer filled with a value the kernel never writes (bool bytes as raw 0x5A)."""
    for t in out.__dict__.values():
        if t.dtype == torch.bool:
            t.view(torch.uint8).fill_(MASK_POISON)
        else:
            t.fill_(VERIFY_POISON)
