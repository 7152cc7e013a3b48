"""The host side of the MLA tree-verify kernels' tests and benchmarks: ``mla_tree_verify_reference``, the float64
torch twin of ``sglang_kdtree.gpu.mla_attention.mla_tree_verify`` (same positional signature, same results up to bf16
rounding), the ancestor-bit rows it reads, and random inputs for both.

The semantics (query rows, keys, ancestor bits, scores and LSE) are the ones ``mla_attention``'s docstring states.
"""

from __future__ import annotations

import math

import torch

from sglang_kdtree.gpu.mla_attention import KV_LORA_RANK, QK_HEAD_DIM

__all__ = [
    "mla_tree_verify_reference",
    "ancestor_bits_from_parents",
    "synthetic_inputs",
]


def mla_tree_verify_reference(q, kv_buffer, kv_indptr, kv_indices, tree_slots, ancestor_bits, sm_scale):
    """float64 torch twin of ``mla_tree_verify`` (same arguments; runs on any device, syncs freely).

    Returns:
        ``(out [bs*N, H, 512] float64, lse [bs*N, H] float64)``.
    """
    batch = kv_indptr.shape[0] - 1
    tokens, heads, _ = q.shape
    width = tokens // batch
    kv = kv_buffer.reshape(kv_buffer.shape[0], QK_HEAD_DIM)
    indptr = kv_indptr.to(torch.int64).tolist()
    bits = ancestor_bits.to(torch.int64) & 0xFFFFFFFF
    cols = torch.arange(width, device=q.device)
    out = torch.empty((tokens, heads, KV_LORA_RANK), dtype=torch.float64, device=q.device)
    lse = torch.empty((tokens, heads), dtype=torch.float64, device=q.device)
    for b in range(batch):
        slots = torch.cat([kv_indices[indptr[b]: indptr[b + 1]].to(torch.int64),
                           tree_slots[b * width:(b + 1) * width].to(torch.int64)])
        keys = kv[slots].to(torch.float64)                      # [L, 576]
        qb = q[b * width:(b + 1) * width].to(torch.float64)     # [N, H, 576]
        scores = torch.einsum("nhd,ld->nhl", qb, keys) * sm_scale
        tree_visible = ((bits[b][:, cols // 32] >> (cols % 32)) & 1).bool()  # [N(query), N(key)]
        visible = torch.cat([torch.ones((width, slots.shape[0] - width), dtype=torch.bool, device=q.device),
                             tree_visible], dim=1)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse[..., None])
        out[b * width:(b + 1) * width] = torch.einsum("nhl,lv->nhv", probs, keys[:, :KV_LORA_RANK])
        lse[b * width:(b + 1) * width] = row_lse
    return out, lse


def ancestor_bits_from_parents(parents):
    """``[bs, N, ceil(N/32)]`` uint32 ancestor-or-self rows from ``[bs, N]`` parent indices (-1: none).

    The layout of ``sglang_kdtree.reference.verify_inputs().ancestor_bits`` without its dense FULL_MASK
    (which is ``sum(seq_lens) * N`` bytes: too large for benchmark-sized contexts).
    """
    import numpy as np

    parents = np.asarray(parents, dtype=np.int64)
    batch, width = parents.shape
    anc = np.zeros((batch, width, width), dtype=bool)
    rows = np.arange(batch)
    for i in range(width):
        anc[:, i, i] = True
        p = parents[:, i]
        has = p >= 0
        anc[rows[has], i] |= anc[rows[has], p[has]]
    bits = np.zeros((batch, width, (width + 31) // 32), dtype=np.uint32)
    for j in range(width):
        bits[:, :, j // 32] |= anc[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    return bits


def synthetic_inputs(batch, width, heads, prefix_lens, *, seed=0, device="cuda", chain=False, num_nodes=None,
                     q_std=1.0, spare_slots=16):
    """Random inputs for tests and benchmarks: a shuffled MLA pool, CSR prefix indices, random trees.

    Returns a dict with ``q, kv_buffer, kv_indptr (int32), kv_indices (int64), tree_slots (int64),
    ancestor_bits (uint32), parents (numpy), sm_scale`` and ``spare`` (unused pool slots, for poisoning).
    Trees: node i > 0 gets a uniformly random parent < i (``chain``: parent i-1); rows past ``num_nodes[b]``
    are padding (parent -1: they see the prefix and themselves only, as in ``reference.verify_inputs``).
    """
    import numpy as np

    prefix_lens = [int(p) for p in prefix_lens]
    assert len(prefix_lens) == batch
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    total_prefix = sum(prefix_lens)
    pool = total_prefix + batch * width + spare_slots
    perm = torch.randperm(pool, generator=gen, device=device)
    kv_buffer = torch.randn((pool, QK_HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
    q = (torch.randn((batch * width, heads, QK_HEAD_DIM), generator=gen, device=device) * q_std).to(torch.bfloat16)
    indptr = np.zeros(batch + 1, dtype=np.int64)
    indptr[1:] = np.cumsum(prefix_lens)
    parents = np.full((batch, width), -1, dtype=np.int64)
    for b in range(batch):
        n = width - 1 if num_nodes is None else int(num_nodes[b])
        for i in range(1, n + 1):
            parents[b, i] = i - 1 if chain else int(rng.integers(0, i))
    return {
        "q": q,
        "kv_buffer": kv_buffer,
        "kv_indptr": torch.from_numpy(indptr.astype(np.int32)).to(device),
        "kv_indices": perm[:total_prefix].to(torch.int64),
        "tree_slots": perm[total_prefix: total_prefix + batch * width].to(torch.int64),
        "ancestor_bits": torch.from_numpy(ancestor_bits_from_parents(parents)).to(device),
        "parents": parents,
        "sm_scale": 1.0 / math.sqrt(192.0),  # DeepSeek-V3's (qk_nope 128 + rope 64) ** -0.5
        "spare": perm[total_prefix + batch * width:],
    }
