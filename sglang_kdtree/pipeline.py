"""The DDTree round's tensor operations behind one backend object: the CPU reference or the GPU kernels.

``select_backend(device)`` is the single place that decides which implementation a worker runs:
``ReferenceBackend`` (``sglang_kdtree.reference``, numpy, exact oracle) on CPU, ``GpuBackend``
(``sglang_kdtree.gpu.*``, CuPy/NVRTC kernels, imported lazily so CPU installs never load CuPy) on CUDA.
Both take and return torch tensors on the worker's device with the same shapes and dtypes:

* ``topk(logits [bs, L, V], k)`` -> ``(logprobs [bs, L, K] float32, ids [bs, L, K] int64)``;
* ``shard_topk(logits_shard, k, id_offset)`` / ``merge_topk(vals [S,...], ids, lse, k)``: the
  tensor-parallel halves (``vocab_parallel_topk`` moves only ``S*K`` candidates + one lse per row);
* ``build(logprobs, ids, budget, roots [bs])`` -> a tree batch (``tokens/depths/parents [bs, N]``,
  ``num_nodes [bs]``);
* ``verify_inputs(trees, seq_lens [bs], seq_lens_sum)`` -> ``input_ids/positions [bs*N]``, ``full_mask``
  (SGLang FULL_MASK), ``ancestor_bits``, ``retrieve_*``;
* ``accept_greedy(trees, logits [bs, N, V], max_depth)`` / ``accept_sampled(..., temperatures, seeds,
  seq_lens, max_depth)`` -> ``accepted [bs, L+1]``, ``accept_lens [bs]`` (tau, bonus included),
  ``bonus [bs]``, ``committed [bs, L+1]``;
* ``commit_plan(accepted, accept_lens, verify_slots [bs, N])`` -> ``src_slots/dst_slots/hidden_rows``.

Semantics are those of ``reference`` (shared/notes/ddtree.md); the reference backend is the product on
CPU, not a stand-in, and the GPU kernels are tested bit-exact against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang_kdtree import reference


@dataclass
class TorchTrees:
    """A ``reference.TreeBatch`` as torch tensors (``tokens/depths/parents [bs, N]`` int64, ``num_nodes [bs]``)."""

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class TorchVerifyInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    full_mask: torch.Tensor
    ancestor_bits: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


@dataclass
class TorchAccept:
    accepted: torch.Tensor
    accept_lens: torch.Tensor
    bonus: torch.Tensor
    committed: torch.Tensor


@dataclass
class TorchCommitPlan:
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    hidden_rows: torch.Tensor
    accept_lens: torch.Tensor


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws the token at absolute ``position`` of a request seeded ``seed``."""
    return float(np.random.default_rng([int(seed) & 0xFFFFFFFFFFFF, int(position)]).random())


class _Uniforms:
    """Stands in for the ``numpy.random.Generator`` of ``reference.sample_node_tokens``: it hands out the
    prepared per-node uniforms (the reference keeps the one definition of the inverse-CDF draw)."""

    def __init__(self, uniforms: np.ndarray):
        self._uniforms = uniforms

    def random(self, shape):
        if tuple(shape) != self._uniforms.shape:
            raise ValueError(f"prepared uniforms have shape {self._uniforms.shape}, the draw wants {tuple(shape)}")
        return self._uniforms


def _sampling_inputs(temperatures, seeds, seq_lens):
    """Host copies of the per-request sampling inputs: (temperatures float, seeds int64, lengths int64)."""
    return (_np(temperatures.float()).reshape(-1), _np(seeds).reshape(-1).astype(np.int64),
            _np(seq_lens).reshape(-1).astype(np.int64))


def _tree_batch(trees) -> reference.TreeBatch:
    return reference.TreeBatch(tokens=_np(trees.tokens), depths=_np(trees.depths), parents=_np(trees.parents),
                               num_nodes=_np(trees.num_nodes))


class ReferenceBackend:
    """``sglang_kdtree.reference`` on host copies of the tensors (CPU serving, and the oracle)."""

    name = "reference"

    def __init__(self, device):
        self.device = torch.device(device)

    def _t(self, a, dtype=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype=dtype)

    def topk(self, logits, k):
        lp, ids = reference.topk_logprobs(_np(logits.float()), k)
        return self._t(lp), self._t(ids)

    def shard_topk(self, logits_shard, k, id_offset):
        vals, ids, lse = reference.shard_topk_partials(_np(logits_shard.float()), k, id_offset)
        return self._t(vals), self._t(ids), self._t(lse)

    def merge_topk(self, vals, ids, lse, k):
        lp, out_ids = reference.merge_topk_partials(_np(vals), _np(ids), _np(lse), k)
        return self._t(lp), self._t(out_ids)

    def build(self, logprobs, ids, budget, roots) -> TorchTrees:
        tb = reference.build_trees(_np(logprobs), _np(ids), int(budget), _np(roots).astype(np.int64))
        return TorchTrees(self._t(tb.tokens), self._t(tb.depths), self._t(tb.parents), self._t(tb.num_nodes))

    def verify_inputs(self, trees, seq_lens, seq_lens_sum=None) -> TorchVerifyInputs:
        vi = reference.verify_inputs(_tree_batch(trees), _np(seq_lens).astype(np.int64))
        return TorchVerifyInputs(
            input_ids=self._t(vi.input_ids), positions=self._t(vi.positions), full_mask=self._t(vi.full_mask),
            ancestor_bits=self._t(vi.ancestor_bits.view(np.int32)), retrieve_index=self._t(vi.retrieve_index),
            retrieve_next_token=self._t(vi.retrieve_next_token),
            retrieve_next_sibling=self._t(vi.retrieve_next_sibling),
        )

    def _accept(self, res: reference.AcceptResult) -> TorchAccept:
        return TorchAccept(self._t(res.accepted), self._t(res.accept_lens), self._t(res.bonus),
                           self._t(res.committed))

    def accept_greedy(self, trees, logits, max_depth) -> TorchAccept:
        return self._accept(reference.accept_greedy(_tree_batch(trees), _np(logits.float()), max_depth))

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth) -> TorchAccept:
        """T > 0 walk: every node's token is drawn from ``softmax(logits / T)`` (``reference.sample_node_tokens``)
        with the uniform ``position_uniform(seed, P + depth + 1)`` of the position it generates, then the
        ``reference`` walk. Rows with ``temperatures[b] <= 0`` are greedy.

        Keying the uniform by (seed, absolute position) instead of by node number makes the output equal to
        autoregressive inverse-CDF sampling with the same uniforms: independent of the tree's shape (of the
        drafter, the budget, fp ties in the draft ranking) and of the batch, so a seeded request is
        reproducible; each emitted token is still an exact sample of the target's conditional.
        """
        tb = _tree_batch(trees)
        logits_np = _np(logits.float())
        temps, seeds_np, lens = _sampling_inputs(temperatures, seeds, seq_lens)
        parts = []
        for b in range(tb.tokens.shape[0]):
            one = reference.TreeBatch(tb.tokens[b : b + 1], tb.depths[b : b + 1], tb.parents[b : b + 1],
                                      tb.num_nodes[b : b + 1])
            if temps[b] <= 0:
                parts.append(reference.accept_greedy(one, logits_np[b : b + 1], max_depth))
                continue
            uniforms = np.array([[position_uniform(seeds_np[b], lens[b] + d + 1) for d in tb.depths[b]]])
            node_tokens = reference.sample_node_tokens(logits_np[b : b + 1], float(temps[b]), _Uniforms(uniforms))
            parts.append(reference.accept_greedy(one, node_tokens, max_depth))
        return TorchAccept(*(self._t(np.concatenate([getattr(p, f) for p in parts]))
                             for f in ("accepted", "accept_lens", "bonus", "committed")))

    def sample_tokens(self, logits, temperatures, seeds, seq_lens) -> torch.Tensor:
        """One token per row from ``softmax(logits / T)`` with the uniform of the position it generates,
        ``position_uniform(seed, seq_len)`` (the same key ``accept_sampled`` uses): ``[bs, V]`` -> ``[bs]``."""
        logits_np = _np(logits.float())
        temps, seeds_np, lens = _sampling_inputs(temperatures, seeds, seq_lens)
        out = np.empty(len(temps), dtype=np.int64)
        for b in range(len(temps)):
            u = np.array([[position_uniform(seeds_np[b], lens[b])]])
            out[b] = reference.sample_node_tokens(logits_np[b][None, None], float(temps[b]), _Uniforms(u))[0, 0]
        return self._t(out)

    def commit_plan(self, accepted, accept_lens, verify_slots) -> TorchCommitPlan:
        plan = reference.commit_plan(_np(accepted), _np(accept_lens), _np(verify_slots).astype(np.int64))
        return TorchCommitPlan(self._t(plan.src_slots), self._t(plan.dst_slots), self._t(plan.hidden_rows),
                               self._t(plan.accept_lens))


class GpuBackend:
    """The CUDA kernels of ``sglang_kdtree.gpu`` (no host sync on the hot path; errors via device flags)."""

    name = "gpu"

    def __init__(self, device):
        from sglang_kdtree.gpu import accept, compact, topk, tree, verify

        self.device = torch.device(device)
        self._topk, self._tree, self._verify, self._accept, self._compact = topk, tree, verify, accept, compact

    def topk(self, logits, k):
        return self._topk.topk_logprobs(logits.contiguous(), k)

    def shard_topk(self, logits_shard, k, id_offset):
        return self._topk.shard_topk_partials(logits_shard.contiguous(), k, id_offset)

    def merge_topk(self, vals, ids, lse, k):
        return self._topk.merge_topk_partials(vals, ids, lse, k)

    def build(self, logprobs, ids, budget, roots):
        return self._tree.build_trees(logprobs, ids, int(budget), roots.to(torch.int64))

    def verify_inputs(self, trees, seq_lens, seq_lens_sum=None):
        return self._verify.verify_inputs(trees, seq_lens.to(torch.int64), seq_lens_sum=seq_lens_sum)

    def accept_greedy(self, trees, logits, max_depth):
        return self._accept.accept_greedy(trees, logits, max_depth)

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth):
        return self._accept.accept_sampled(trees, logits, temperatures, seeds, seq_lens.to(torch.int64), max_depth)

    def sample_tokens(self, logits, temperatures, seeds, seq_lens) -> torch.Tensor:
        # Rare (a seeded request's prefill token outside deterministic mode): the reference sampler on a
        # host copy keeps one definition of the seeded draw.
        return ReferenceBackend(self.device).sample_tokens(logits, temperatures, seeds, seq_lens)

    def commit_plan(self, accepted, accept_lens, verify_slots):
        return self._compact.commit_plan(accepted, accept_lens, verify_slots)


def select_backend(device) -> ReferenceBackend | GpuBackend:
    """The one decision point: GPU kernels on a CUDA device, the reference everywhere else."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return GpuBackend(dev)
    return ReferenceBackend(dev)


def vocab_parallel_topk(local_logits: torch.Tensor, k: int, id_offset: int, backend, group=None):
    """Top-K log-probs over a vocabulary split across tensor-parallel ranks, without gathering it.

    Args:
        local_logits: ``[rows, V_local]`` this rank's logits (its slice of the vocabulary, starting at global
            id ``id_offset``); every rank must hold the same number of columns.
        k: requested K; group: a ``torch.distributed`` process group (``None``: the default group; a world of
            one skips communication).

    Each rank computes its top-``K`` raw logits, global ids and its row logsumexp
    (``reference.shard_topk_partials``); one ``all_gather`` moves ``world * rows * (2K + 1)`` numbers, and
    every rank merges identically (``reference.merge_topk_partials``), so all ranks build the same trees.
    Returns ``(logprobs [rows, K], ids [rows, K])``.
    """
    import torch.distributed as dist

    vals, ids, lse = backend.shard_topk(local_logits, k, id_offset)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return backend.merge_topk(vals[None], ids[None], lse[None], k)
    gathered_vals = [torch.empty_like(vals) for _ in range(world)]
    gathered_ids = [torch.empty_like(ids) for _ in range(world)]
    gathered_lse = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(gathered_vals, vals.contiguous(), group=group)
    dist.all_gather(gathered_ids, ids.contiguous(), group=group)
    dist.all_gather(gathered_lse, lse.contiguous(), group=group)
    return backend.merge_topk(torch.stack(gathered_vals), torch.stack(gathered_ids), torch.stack(gathered_lse), k)
