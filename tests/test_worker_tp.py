"""Vocab-parallel top-K for the drafter under tensor parallelism, across two real gloo processes:
only the shards' K candidates and logsumexps travel, every rank gets the same result, and it equals the
unsharded ``reference.topk_logprobs`` (ids exactly, log-probs within float32 rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_kdtree import reference
from sglang_kdtree.round.pipeline import ReferenceBackend, vocab_parallel_topk

WORLD = 2


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7])  # exact ties across shards: lower id must win
    x[0, : vocab // 2] = -np.inf  # a row that is impossible on rank 0's whole shard
    return x


def _rank_main(rank: int, init_file: str, rows: int, vocab: int, k: int, seed: int, out_file: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        full = _logits(rows, vocab, seed)
        shard = vocab // WORLD
        local = torch.from_numpy(full[:, rank * shard : (rank + 1) * shard].copy())
        logprobs, ids = vocab_parallel_topk(local, k, rank * shard, ReferenceBackend("cpu"))
        np.savez(f"{out_file}.{rank}.npz", logprobs=logprobs.numpy(), ids=ids.numpy())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("rows", "vocab", "k"), [(7, 64, 16), (3, 40, 40), (5, 128, 1)])
def test_vocab_parallel_topk_across_two_gloo_ranks(tmp_path, rows, vocab, k):
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), rows, vocab, k, 11, out), nprocs=WORLD, join=True)
    results = [np.load(f"{out}.{r}.npz") for r in range(WORLD)]
    expected_lp, expected_ids = reference.topk_logprobs(_logits(rows, vocab, 11), k)
    for res in results:
        np.testing.assert_array_equal(res["ids"], expected_ids)
        np.testing.assert_allclose(res["logprobs"], expected_lp, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(results[0]["ids"], results[1]["ids"])
    np.testing.assert_array_equal(results[0]["logprobs"], results[1]["logprobs"])


def test_single_process_world_needs_no_communication():
    full = _logits(4, 32, 3)
    logprobs, ids = vocab_parallel_topk(torch.from_numpy(full), 8, 0, ReferenceBackend("cpu"))
    expected_lp, expected_ids = reference.topk_logprobs(full, 8)
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_allclose(logprobs.numpy(), expected_lp, rtol=0, atol=2e-6)


def test_a_faulty_row_in_one_shard_is_flagged_not_raised():
    """NaN / +inf in one row of one rank's shard (the per-request draft fault of a TP server): ``shard_topk`` sets
    the GPU top-K's fault bits in ``tree_errors`` instead of raising (which would stop the server), the other
    rows' merged result equals the unsharded reference exactly, and the faulty row's candidates are finite real
    ids: the shard's ``-inf`` padding past the vocabulary never becomes one."""
    from sglang_kdtree.gpu.errors import ERR_LOGITS_NAN, ERR_LOGITS_POSINF

    rows, shard, real, k = 4, 16, 13, 8  # each shard: 13 real columns, then 3 of padding
    full = _logits(rows, 2 * shard, 5)
    full[:, real:shard] = full[:, shard + real:] = -np.inf
    full[2, shard + 4] = np.nan
    full[3, 1] = np.inf
    backend = ReferenceBackend("cpu")
    parts = [backend.shard_topk(torch.from_numpy(full[:, r * shard:(r + 1) * shard].copy()), k, r * shard)
             for r in range(WORLD)]
    assert int(backend.tree_errors) == ERR_LOGITS_NAN | ERR_LOGITS_POSINF
    logprobs, ids = backend.merge_topk(*(torch.stack([p[i] for p in parts]) for i in range(3)), k)
    expected_lp, expected_ids = reference.topk_logprobs(full[:2], k)
    np.testing.assert_array_equal(ids[:2].numpy(), expected_ids)
    np.testing.assert_allclose(logprobs[:2].numpy(), expected_lp, rtol=0, atol=2e-6)
    assert np.isfinite(logprobs.numpy()).all()
    assert (ids.numpy() % shard < real).all()
