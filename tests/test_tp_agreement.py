"""Under tensor parallelism every rank must end the same faulty requests and verify the same width: the fault
words are OR-ed over the ranks (``round_faults.union_over_ranks``) and the automatic width is rank 0's
(``width_choice.agreed_width``). Checked across three real gloo processes that start from different words and
widths, against the OR computed here with numpy."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_kdtree.round.faults import union_over_ranks
from sglang_kdtree.round.width_choice import agreed_width

WORLD = 3
WIDTHS = (32, 16, 64)  # each rank's own choice; rank 0's must win


def _words(rank: int) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    words = np.zeros((5, 3), dtype=np.int64)
    rows = rng.choice(5, size=2, replace=False)
    words[rows, rng.integers(0, 3, size=2)] = 1 << rng.integers(0, 20, size=2)  # faults only this rank saw
    return words


def _rank_main(rank: int, init_file: str, out_file: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        union = union_over_ranks(torch.from_numpy(_words(rank)))
        width = agreed_width(WIDTHS[rank], dist.group.WORLD)
        np.savez(f"{out_file}.{rank}.npz", union=union.numpy(), width=np.array(width))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_fault_words_and_width(tmp_path):
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    expected = np.bitwise_or.reduce(np.stack([_words(r) for r in range(WORLD)]), axis=0)
    assert expected.any() and not all((_words(r) == expected).all() for r in range(WORLD))  # the ranks did differ
    for r in range(WORLD):
        res = np.load(f"{out}.{r}.npz")
        np.testing.assert_array_equal(res["union"], expected)
        assert int(res["width"]) == WIDTHS[0]


def test_a_world_of_one_returns_its_own_words_and_width(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
    try:
        words = torch.from_numpy(_words(0))
        assert union_over_ranks(words) is words
        assert agreed_width(48, dist.group.WORLD) == 48
    finally:
        dist.destroy_process_group()
