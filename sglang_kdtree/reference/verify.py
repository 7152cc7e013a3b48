"""Step 3, twin of ``gpu/verify.py``: what the target's tree-verify forward reads (input ids, positions, SGLang's
FULL_MASK, bit-packed ancestor rows, the retrieve links of ``verify_tree_greedy``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_kdtree.reference._validate import _require_int
from sglang_kdtree.reference.tree import TreeBatch, _check_tree_batch


@dataclass(frozen=True)
class VerifyInputs:
    """What the target's tree-verify forward reads, for a batch of ``bs`` requests of width N.

    Attributes:
        input_ids: ``[bs*N]`` int64, ``[root, node_1..node_{N-1}]`` per request.
        positions: ``[bs*N]`` int64, ``seq_len + depth`` (padding rows: ``seq_len``).
        full_mask: ``[sum(seq_lens)*N + N*N*bs]`` bool, SGLang's FULL_MASK: per request an
            ``N x (seq_len + N)`` row-major allow-mask (prefix all True, then ancestor-or-self).
        ancestor_bits: ``[bs, N, ceil(N/32)]`` uint32; bit ``j % 32`` of word ``j // 32`` in row i is set
            iff node j is an ancestor of node i or i itself.
        retrieve_index: ``[bs, N]`` int64, the global row ``b*N + i`` of node i.
        retrieve_next_token: ``[bs, N]`` int64, first child of node i (lowest node index), -1 if none.
        retrieve_next_sibling: ``[bs, N]`` int64, next sibling of node i (next higher node index with the
            same parent), -1 if none.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    full_mask: np.ndarray
    ancestor_bits: np.ndarray
    retrieve_index: np.ndarray
    retrieve_next_token: np.ndarray
    retrieve_next_sibling: np.ndarray



def ancestor_matrix(trees: TreeBatch) -> np.ndarray:
    """The tree-visibility matrix: ``[bs, N, N]`` bool, ``[b, i, j]`` iff node j is an ancestor of node i or i
    itself. Padding rows see only themselves."""
    _check_tree_batch(trees)
    bs, width = trees.tokens.shape
    anc = np.zeros((bs, width, width), dtype=bool)
    idx = np.arange(width)
    anc[:, idx, idx] = True
    for b in range(bs):
        for i in range(1, int(trees.num_nodes[b]) + 1):  # parents[i] < i: the parent's row is complete
            anc[b, i] |= anc[b, int(trees.parents[b, i])]
    return anc


def verify_inputs(trees: TreeBatch, seq_lens) -> VerifyInputs:
    """Verify inputs for a batch of trees.

    Args:
        trees: ``TreeBatch`` of width N.
        seq_lens: ``[bs]`` int64 committed lengths P (the root sits at position P).
    """
    _check_tree_batch(trees)
    seq_lens = np.asarray(seq_lens)
    _require_int("seq_lens", seq_lens)
    bs, width = trees.tokens.shape
    if seq_lens.shape != (bs,):
        raise ValueError(f"seq_lens has shape {seq_lens.shape}, expected {(bs,)}")
    if (seq_lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")
    words = (width + 31) // 32
    anc = ancestor_matrix(trees)
    next_token = np.full((bs, width), -1, dtype=np.int64)
    next_sibling = np.full((bs, width), -1, dtype=np.int64)
    for b in range(bs):
        n = int(trees.num_nodes[b])
        last_child = np.full(width, -1, dtype=np.int64)
        for i in range(1, n + 1):
            p = int(trees.parents[b, i])
            if last_child[p] < 0:
                next_token[b, p] = i
            else:
                next_sibling[b, last_child[p]] = i
            last_child[p] = i
    blocks = [np.concatenate([np.ones((width, int(seq_lens[b])), bool), anc[b]], axis=1).ravel() for b in range(bs)]
    full_mask = np.concatenate(blocks) if blocks else np.zeros(0, dtype=bool)
    bits = np.zeros((bs, width, words), dtype=np.uint32)
    for j in range(width):
        bits[:, :, j // 32] |= anc[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    return VerifyInputs(
        input_ids=trees.tokens.reshape(-1).copy(),
        positions=(seq_lens[:, None].astype(np.int64) + trees.depths).reshape(-1),
        full_mask=full_mask,
        ancestor_bits=bits,
        retrieve_index=(np.arange(bs, dtype=np.int64)[:, None] * width + np.arange(width)[None, :]),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
    )


def ancestor_bits_to_bool(bits, width: int) -> np.ndarray:
    """Unpack ``[..., N, ceil(N/32)]`` uint32 ancestor rows into a ``[..., N, N]`` bool mask."""
    bits = np.asarray(bits, dtype=np.uint32)
    cols = np.arange(width)
    return ((bits[..., cols // 32] >> (cols % 32).astype(np.uint32)) & 1).astype(bool)
