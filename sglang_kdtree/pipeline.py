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
* ``tree_step(rows [bs*L, D], lm_head weight, vocab, depth, budget, roots, seq_lens, seq_lens_sum)`` ->
  ``(trees, verify, draft logits)``: the head GEMM, ``topk``, ``build`` and ``verify_inputs`` in one call;
  ``accept_commit_greedy(trees, logits, depth, verify_slots, pool, hidden, width)`` -> ``(accept, plan,
  hidden rows)``: ``accept_greedy``, ``commit_plan``, ``commit_kv``, ``gather_hidden`` in one call (the GPU
  backend replays both from CUDA graphs, ``gpu.round_graphs``);
* ``verify_inputs(trees, seq_lens [bs], seq_lens_sum)`` -> ``input_ids/positions [bs*N]``, ``full_mask``
  (SGLang FULL_MASK), ``ancestor_bits``, ``retrieve_*``;
* ``accept_greedy(trees, logits [bs, N, V], max_depth)`` / ``accept_sampled(..., temperatures, seeds,
  seq_lens, max_depth, top_ks=None, top_ps=None, min_ps=None)`` -> ``accepted [bs, L+1]``, ``accept_lens [bs]``
  (tau, bonus included), ``bonus [bs]``, ``committed [bs, L+1]``;
* ``commit_plan(accepted, accept_lens, verify_slots [bs, N])`` -> ``src_slots/dst_slots/hidden_rows``;
* ``commit_kv(pool, plan)`` moves the accepted KV rows; ``gather_hidden(hidden, plan, width)`` -> the accepted
  rows' hidden states ``[bs, min(L+1, N), D]``;
* ``reserve(batch, budget, depth, vocab, mask_bytes)`` sizes the round's buffers (GPU; a no-op on CPU).

Faults: neither backend raises on bad values in one request. Accept results carry ``errors [bs]`` (int64,
``gpu.errors.DEVICE_ERRORS``), and ``tree_errors`` / ``commit_errors`` (``int32 [1]``) collect the draft and
commit faults of the batch; the worker reads them once per round and ends the faulty requests.

Semantics are those of ``reference`` (shared/notes/ddtree.md); the reference backend is the product on
CPU, not a stand-in, and the GPU kernels are tested bit-exact against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from sglang_kdtree import reference
from sglang_kdtree.gpu.verify import full_mask_numel

logger = logging.getLogger(__name__)

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
    #: ``[bs]`` int64 per-request fault bits (``gpu.errors.DEVICE_ERRORS``; 0 when valid), as on the GPU
    errors: torch.Tensor | None = None


@dataclass
class TorchCommitPlan:
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    hidden_rows: torch.Tensor
    accept_lens: torch.Tensor


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def _sampling_inputs(temperatures, seeds, seq_lens):
    """Host copies of the per-request sampling inputs: (temperatures float, seeds int64, lengths int64)."""
    return (_np(temperatures.float()).reshape(-1), _np(seeds).reshape(-1).astype(np.int64),
            _np(seq_lens).reshape(-1).astype(np.int64))


def _filters(top_ks, top_ps, bs: int, min_ps=None):
    """Per-request ``(top_k, top_p, min_p)`` host lists (``None`` where a filter is not given); float32
    values are kept exact (the GPU kernel reads the same float32 ``top_p`` / ``min_p``)."""
    ks = [None] * bs if top_ks is None else [int(k) for k in _np(top_ks).reshape(-1)]
    ps = [None] * bs if top_ps is None else [float(p) for p in _np(top_ps.float()).reshape(-1)]
    mps = [None] * bs if min_ps is None else [float(p) for p in _np(min_ps.float()).reshape(-1)]
    return ks, ps, mps


#: fault bits, shared with the kernels: draft log-probs (``gpu.topk.TOPK_ERRORS``) and target logits
#: (``gpu.errors.DEVICE_ERRORS``)
_DRAFT_NAN, _DRAFT_POSINF, _TARGET_NAN = 8, 16, 8


def _faulty_requests(x: np.ndarray) -> np.ndarray:
    """Per request (leading axis) the draft fault bits of ``x``: 8 for a NaN, 16 for a +inf anywhere."""
    flat = x.reshape(x.shape[0], -1)
    return np.where(np.isnan(flat).any(axis=1), _DRAFT_NAN, 0) | np.where(np.isposinf(flat).any(axis=1),
                                                                          _DRAFT_POSINF, 0)


def _tree_batch(trees) -> reference.TreeBatch:
    return reference.TreeBatch(tokens=_np(trees.tokens), depths=_np(trees.depths), parents=_np(trees.parents),
                               num_nodes=_np(trees.num_nodes))


class ReferenceBackend:
    """``sglang_kdtree.reference`` on host copies of the tensors (CPU serving, and the oracle)."""

    name = "reference"

    def __init__(self, device):
        self.device = torch.device(device)
        # the GPU backend's flags, so the worker reads one contract: a request whose inputs are faulty is
        # computed on neutral stand-in values, marked, and ended by the worker; the batch goes on
        self.tree_errors = torch.zeros(1, dtype=torch.int32)
        self.commit_errors = torch.zeros(1, dtype=torch.int32)

    def _t(self, a, dtype=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype=dtype)

    def tree_step(self, rows, weight, vocab: int, depth: int, budget: int, roots, seq_lens, seq_lens_sum: int,
                  graph: bool = True, mark=None):
        """Draft head -> top-K -> tree -> verify inputs (``GpuBackend.tree_step``'s contract; eager here)."""
        return eager_tree_step(self, rows, weight, vocab, depth, budget, roots, seq_lens, seq_lens_sum, mark)

    def accept_commit_greedy(self, trees, logits, depth: int, verify_slots, pool, hidden, width: int,
                             graph: bool = False):
        """Greedy accept -> commit plan -> KV commit -> accepted hidden rows (the GPU contract; eager here)."""
        return eager_accept_commit_greedy(self, trees, logits, depth, verify_slots, pool, hidden, width)

    def topk(self, logits, k):
        """As ``reference.topk_logprobs``; a request whose draft logits hold NaN / +inf gets NaN log-probs (its
        fault mark, see ``build``) and sets its bits in ``tree_errors`` instead of raising."""
        x = _np(logits.float())
        bad = _faulty_requests(x) if x.ndim > 1 else np.zeros(0, dtype=np.int64)
        if bad.any():
            x = x.copy()
            x[bad != 0] = 0.0
            self.tree_errors |= int(np.bitwise_or.reduce(bad))
        lp, ids = reference.topk_logprobs(x, k)
        if bad.any():
            lp[bad != 0] = np.nan
        return self._t(lp), self._t(ids)

    def shard_topk(self, logits_shard, k, id_offset):
        vals, ids, lse = reference.shard_topk_partials(_np(logits_shard.float()), k, id_offset)
        return self._t(vals), self._t(ids), self._t(lse)

    def merge_topk(self, vals, ids, lse, k):
        lp, out_ids = reference.merge_topk_partials(_np(vals), _np(ids), _np(lse), k)
        return self._t(lp), self._t(out_ids)

    def build(self, logprobs, ids, budget, roots) -> TorchTrees:
        lp = _np(logprobs)
        marked = np.isnan(lp.reshape(lp.shape[0], -1)).any(axis=1) if lp.ndim > 1 else np.zeros(0, dtype=bool)
        if marked.any():  # requests marked by topk: a tree from flat log-probs keeps the batch's shapes
            lp = lp.copy()
            lp[marked] = 0.0
        tb = reference.build_trees(lp, _np(ids), int(budget), _np(roots).astype(np.int64))
        return TorchTrees(self._t(tb.tokens), self._t(tb.depths), self._t(tb.parents), self._t(tb.num_nodes))

    def verify_inputs(self, trees, seq_lens, seq_lens_sum=None) -> TorchVerifyInputs:
        vi = reference.verify_inputs(_tree_batch(trees), _np(seq_lens).astype(np.int64))
        return TorchVerifyInputs(
            input_ids=self._t(vi.input_ids), positions=self._t(vi.positions), full_mask=self._t(vi.full_mask),
            ancestor_bits=self._t(vi.ancestor_bits.view(np.int32)), retrieve_index=self._t(vi.retrieve_index),
            retrieve_next_token=self._t(vi.retrieve_next_token),
            retrieve_next_sibling=self._t(vi.retrieve_next_sibling),
        )

    @staticmethod
    def _screen_target(logits) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of the target logits with NaN requests neutralised, and the per-request fault bits."""
        x = _np(logits.float())
        bad = np.where(np.isnan(x.reshape(x.shape[0], -1)).any(axis=1), _TARGET_NAN, 0).astype(np.int64)
        if bad.any():
            x = x.copy()
            x[bad != 0] = 0.0
        return x, bad

    def _accept(self, res: reference.AcceptResult, errors: np.ndarray) -> TorchAccept:
        return TorchAccept(self._t(res.accepted), self._t(res.accept_lens), self._t(res.bonus),
                           self._t(res.committed), self._t(errors))

    def accept_greedy(self, trees, logits, max_depth) -> TorchAccept:
        x, bad = self._screen_target(logits)
        return self._accept(reference.accept_greedy(_tree_batch(trees), x, max_depth), bad)

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth, top_ks=None,
                       top_ps=None, min_ps=None) -> TorchAccept:
        """T > 0 walk: every node's token is drawn from ``softmax(logits / T)`` filtered by the request's
        ``top_ks`` / ``top_ps`` / ``min_ps`` as SGLang's sampler does (``reference.sample_node_tokens``), with the
        uniform ``reference.position_uniform(seed, P + depth + 1)`` of the position it generates, then the
        ``reference`` walk. Rows with ``temperatures[b] <= 0`` or ``top_ks[b] == 1`` (SGLang's encoding of a
        greedy request in a sampled batch) are greedy.

        Keying the uniform by (seed, absolute position) instead of by node number makes the output equal to
        autoregressive inverse-CDF sampling with the same uniforms: independent of the tree's shape (of the
        drafter, the budget, fp ties in the draft ranking) and of the batch, so a seeded request is
        reproducible; each emitted token is still an exact sample of the target's conditional.
        """
        tb = _tree_batch(trees)
        logits_np, bad = self._screen_target(logits)
        temps, seeds_np, lens = _sampling_inputs(temperatures, seeds, seq_lens)
        ks, ps, mps = _filters(top_ks, top_ps, tb.tokens.shape[0], min_ps)
        parts = []
        for b in range(tb.tokens.shape[0]):
            one = reference.TreeBatch(tb.tokens[b : b + 1], tb.depths[b : b + 1], tb.parents[b : b + 1],
                                      tb.num_nodes[b : b + 1])
            if temps[b] <= 0 or ks[b] == 1:
                parts.append(reference.accept_greedy(one, logits_np[b : b + 1], max_depth))
                continue
            uniforms = reference.PositionUniforms(seeds_np[b], lens[b] + tb.depths[b : b + 1] + 1)
            node_tokens = reference.sample_node_tokens(logits_np[b : b + 1], float(temps[b]), uniforms,
                                                       top_k=ks[b], top_p=ps[b], min_p=mps[b])
            parts.append(reference.accept_greedy(one, node_tokens, max_depth))
        return TorchAccept(*(self._t(np.concatenate([getattr(p, f) for p in parts]))
                             for f in ("accepted", "accept_lens", "bonus", "committed")), errors=self._t(bad))

    def sample_tokens(self, logits, temperatures, seeds, seq_lens, top_ks=None, top_ps=None,
                      min_ps=None) -> torch.Tensor:
        """One token per row from ``softmax(logits / T)`` (filtered like ``accept_sampled``) with the uniform of
        the position it generates, ``reference.position_uniform(seed, seq_len)`` (the same key ``accept_sampled``
        uses): ``[bs, V]`` -> ``[bs]``."""
        logits_np = _np(logits.float())
        temps, seeds_np, lens = _sampling_inputs(temperatures, seeds, seq_lens)
        ks, ps, mps = _filters(top_ks, top_ps, len(temps), min_ps)
        out = np.empty(len(temps), dtype=np.int64)
        for b in range(len(temps)):
            u = reference.PositionUniforms(seeds_np[b], [[lens[b]]])
            out[b] = reference.sample_node_tokens(logits_np[b][None, None], float(temps[b]), u,
                                                  top_k=ks[b], top_p=ps[b], min_p=mps[b])[0, 0]
        return self._t(out)

    def commit_plan(self, accepted, accept_lens, verify_slots) -> TorchCommitPlan:
        plan = reference.commit_plan(_np(accepted), _np(accept_lens), _np(verify_slots).astype(np.int64))
        return TorchCommitPlan(self._t(plan.src_slots), self._t(plan.dst_slots), self._t(plan.hidden_rows),
                               self._t(plan.accept_lens))

    def reserve(self, batch, budget, depth, vocab, mask_bytes=0) -> None:
        """Nothing to preallocate: the reference works on host copies."""

    def commit_kv(self, pool, plan) -> None:
        move_kv_with_sglang(pool, plan)

    def gather_hidden(self, hidden, plan, width: int):
        """``[bs, M', D]`` hidden rows of the accepted path, ``M' = min(M, width)``; rows past tau are unspecified
        (the drafter's KV write takes the first tau)."""
        rows = plan.hidden_rows[:, : min(plan.hidden_rows.shape[1], width)]
        return hidden[torch.where(rows >= 0, rows, torch.zeros_like(rows)).reshape(-1)].view(*rows.shape, -1)


def bookkeeping_round(backend, draft_logits, budget: int, depth: int, roots, seq_lens, seq_lens_sum: int,
                      target_logits, verify_slots, hidden, temperatures=None, seeds=None):
    """The backend steps of one round in the worker's order, one by one (as the worker runs them under tensor
    parallelism or for a sampled batch), without the model forwards between them (the startup rehearsal and
    the bench CLI run it on synthetic inputs; on one rank the worker groups steps 2-4 in ``tree_step`` and a
    greedy batch's accept, commit and hidden gather in ``accept_commit_greedy``): reserve -> top-K -> tree ->
    verify inputs -> accept (greedy; sampled when ``temperatures`` / ``seeds`` are given) -> commit plan ->
    accepted hidden rows (no KV move: there is no pool). Returns ``(trees, verify, accept, plan, hidden_rows)``."""
    bs, _, vocab = draft_logits.shape
    width = int(budget) + 1
    backend.reserve(bs, budget, depth, vocab, full_mask_numel(seq_lens_sum, width, bs))
    logprobs, ids = backend.topk(draft_logits, min(budget, vocab))
    trees = backend.build(logprobs, ids, budget, roots)
    verify = backend.verify_inputs(trees, seq_lens, seq_lens_sum=seq_lens_sum)
    if temperatures is None:
        acc = backend.accept_greedy(trees, target_logits, depth)
    else:
        acc = backend.accept_sampled(trees, target_logits, temperatures, seeds, seq_lens, depth)
    plan = backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
    return trees, verify, acc, plan, backend.gather_hidden(hidden, plan, width)


def eager_tree_step(backend, rows, weight, vocab: int, depth: int, budget: int, roots, seq_lens, seq_lens_sum: int,
                    mark=None):
    """``tree_step`` as four calls: the head GEMM ``rows @ weight.T`` cut to ``vocab`` columns (then ``mark()``,
    if given: the drafter's head ends there), ``topk`` with ``K = min(budget, vocab)``, ``build``,
    ``verify_inputs``. Returns ``(trees, verify, draft logits [bs*L, vocab])``."""
    logits = torch.matmul(rows, weight.t())[:, :vocab]  # the GEMM the GPU backend's graph path also runs
    if mark is not None:
        mark()
    logprobs, ids = backend.topk(logits.unflatten(0, (roots.shape[0], depth)), min(int(budget), int(vocab)))
    trees = backend.build(logprobs, ids, budget, roots)
    return trees, backend.verify_inputs(trees, seq_lens, seq_lens_sum=int(seq_lens_sum)), logits


def eager_accept_commit_greedy(backend, trees, logits, depth: int, verify_slots, pool, hidden, width: int):
    """``accept_commit_greedy`` as four calls: ``accept_greedy``, ``commit_plan``, ``commit_kv``,
    ``gather_hidden``. Returns ``(accept result, commit plan, accepted hidden rows)``."""
    acc = backend.accept_greedy(trees, logits, depth)
    plan = backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
    backend.commit_kv(pool, plan)
    return acc, plan, backend.gather_hidden(hidden, plan, width)


def move_kv_with_sglang(pool, plan) -> None:
    """Apply a commit plan with the pool's own ``move_kv_cache`` (only the rows whose slot changes; one host
    sync to know whether any does)."""
    valid = plan.src_slots >= 0
    moving = valid & (plan.src_slots != plan.dst_slots)
    if bool(moving.any()):
        pool.move_kv_cache(plan.dst_slots[moving], plan.src_slots[moving])


def _grown(current: int, needed: int) -> int:
    """Capacity after a grow-only resize: ``needed`` if it fits, else at least double (amortised, no per-round
    reallocation once the largest batch and context have been seen)."""
    return current if needed <= current else max(int(needed), 2 * int(current))


class GpuBackend:
    """The CUDA kernels of ``sglang_kdtree.gpu`` (no host sync on the hot path; errors via device flags).

    After ``reserve(batch, budget, depth, vocab, mask_bytes)`` the round's steps write into buffers the backend
    owns for the server's lifetime (``gpu.tree.TreeBuilder`` for top-K, tree and verify inputs, plus accept,
    commit-plan and hidden-row storage), grown only when a batch or context is larger than any before; the
    bf16 draft logits are read as they are. Calls outside a reservation (tests, other shapes) allocate.

    Device error bits accumulate in ``tree_errors`` (``gpu.topk.TOPK_ERRORS``: draft log-probs, trees),
    ``commit_errors`` (``gpu.errors.DEVICE_ERRORS``: commit plan, KV compaction, hidden gather) and each accept
    result's per-request ``errors``; the worker reads them once per round (``KDTreeWorker._round_faults``).
    """

    name = "gpu"

    def __init__(self, device):
        from sglang_kdtree.gpu import accept, compact, errors, topk, tree, verify

        self.device = torch.device(device)
        self._topk, self._tree, self._verify, self._accept, self._compact = topk, tree, verify, accept, compact
        self._builder = None  # gpu.tree.TreeBuilder sized by reserve()
        self._accept_storage = torch.empty(0, dtype=torch.int64, device=self.device)
        self._plan_storage = torch.empty(0, dtype=torch.int64, device=self.device)
        self._hidden_storage = torch.empty(0, dtype=torch.bfloat16, device=self.device)
        self.tree_errors = topk.new_error_flag(self.device)
        self.commit_errors = errors.new_error_flag(self.device)
        self._kv_tables = {}
        from sglang_kdtree.gpu.round_graphs import AcceptCommitGraphs, TreeStepGraphs

        self._tree_graphs = TreeStepGraphs(self)
        self._commit_graphs = AcceptCommitGraphs(self)

    # -- buffers ----------------------------------------------------------------------------------------

    def reserve(self, batch: int, budget: int, depth: int, vocab: int, mask_bytes: int = 0) -> None:
        """Make the round's buffers hold ``batch`` requests of ``budget`` nodes over ``depth`` draft depths of a
        ``vocab``-wide head, and a FULL_MASK of ``mask_bytes``; allocates only when something grows."""
        b = self._builder
        if b is not None and (b.max_budget, b.depth, b.vocab) != (int(budget), int(depth), int(vocab)):
            b = None
        if b is None or batch > b.max_batch:
            cap = _grown(b.max_batch if b is not None else 0, max(int(batch), 1))
            masks = _grown(b.verify.full_mask.numel() if b is not None else 0, int(mask_bytes))
            self._builder = self._tree.TreeBuilder(cap, int(budget), int(depth), int(vocab), self.device,
                                                   max_mask_bytes=masks)
            self._builder.error_flag = self.tree_errors
        elif mask_bytes > b.verify.full_mask.numel():
            b.verify = self._verify.alloc_verify_inputs(
                b.max_batch, b.max_budget + 1, _grown(b.verify.full_mask.numel(), int(mask_bytes)), self.device)

    def _reserved_for(self, bs: int, depth: int | None = None, vocab: int | None = None):
        b = self._builder
        if b is None or bs > b.max_batch or (depth is not None and depth != b.depth) or (
                vocab is not None and vocab != b.vocab):
            return None
        return b

    def _storage(self, name: str, numel: int, dtype=torch.int64) -> torch.Tensor:
        """The backend's grow-only buffer ``name`` holding at least ``numel`` elements of ``dtype``."""
        current = getattr(self, name)
        if current.numel() < numel or current.dtype != dtype:
            held = current.numel() if current.dtype == dtype else 0
            current = torch.empty(_grown(held, numel), dtype=dtype, device=self.device)
            setattr(self, name, current)
        return current

    # -- the round's steps (same contract as ReferenceBackend) ------------------------------------------------

    def topk(self, logits, k):
        bs, depth, vocab = logits.shape
        builder = self._reserved_for(bs, depth, vocab)
        if builder is not None and k <= builder.topk_workspace.max_k:
            return self._topk.topk_logprobs(logits, k, workspace=builder.topk_workspace,
                                            out=(builder.logprobs, builder.token_ids), error_flag=self.tree_errors)
        return self._topk.topk_logprobs(logits.contiguous(), k, error_flag=self.tree_errors)

    def shard_topk(self, logits_shard, k, id_offset):
        return self._topk.shard_topk_partials(logits_shard.contiguous(), k, id_offset, error_flag=self.tree_errors)

    def merge_topk(self, vals, ids, lse, k):
        return self._topk.merge_topk_partials(vals, ids, lse, k, error_flag=self.tree_errors)

    def build(self, logprobs, ids, budget, roots):
        builder = self._reserved_for(logprobs.shape[0])
        out = builder.trees if builder is not None and budget <= builder.max_budget else None
        return self._tree.build_trees(logprobs, ids, int(budget), roots.to(torch.int64), out=out,
                                      error_flag=self.tree_errors)

    def tree_step(self, rows, weight, vocab: int, depth: int, budget: int, roots, seq_lens, seq_lens_sum: int,
                  graph: bool = True, mark=None):
        """The round's draft head -> top-K -> tree -> verify inputs in one call: ``rows`` ``[bs*L, D]`` draft
        hidden rows (depths 1..L of each request), ``weight`` the target's ``[V', D]`` lm_head (``V' >= vocab``,
        the head's dtype), ``roots`` ``[bs]``, ``seq_lens`` ``[bs]`` and their host sum; ``mark()`` (optional)
        is called once the head GEMM is issued. Returns ``(trees, verify, draft logits [bs*L, vocab] view)``.

        Within a reservation and with ``graph`` on, the head GEMM runs eagerly into a static buffer and the
        other steps replay one CUDA graph per batch size (``gpu.round_graphs.TreeStepGraphs``); outside a
        reservation, or once a capture failed, everything runs eagerly."""
        if graph and self._reserved_for(roots.shape[0], depth, vocab) is not None:
            out = self._tree_graphs.step(rows, weight, vocab, depth, budget, roots, seq_lens.to(torch.int64),
                                         seq_lens_sum, mark)
            if out is not None:
                return out
        return eager_tree_step(self, rows, weight, vocab, depth, budget, roots, seq_lens, seq_lens_sum, mark)

    def accept_commit_greedy(self, trees, logits, depth: int, verify_slots, pool, hidden, width: int,
                             graph: bool = False):
        """Greedy accept -> commit plan -> KV commit -> accepted hidden rows; ``(accept result, plan, hidden
        rows)``. With ``graph`` (the caller's promise that ``logits`` and ``hidden`` are a replayed verify
        graph's outputs, at fixed addresses) and a compactable pool, replayed from a CUDA graph per key
        (``gpu.round_graphs.AcceptCommitGraphs``); else eagerly."""
        if graph and self._reserved_for(trees.tokens.shape[0]) is not None and self._kv_table(pool) is not None:
            out = self._commit_graphs.step(trees, logits, depth, verify_slots, pool, hidden, width)
            if out is not None:
                return out
        return eager_accept_commit_greedy(self, trees, logits, depth, verify_slots, pool, hidden, width)

    def size_accept_commit(self, trees, depth: int, hidden, width: int) -> None:
        """Grow the accept, commit-plan and hidden-row storages for this round before a graph capture."""
        bs, tree_width = trees.tokens.shape
        m = min(depth + 1, width)
        self._storage("_accept_storage", self._accept.accept_storage_numel(bs, tree_width, depth))
        self._storage("_plan_storage", 3 * bs * (depth + 1))
        self._storage("_hidden_storage", bs * m * hidden.shape[-1], hidden.dtype)

    def storage_addresses(self) -> tuple:
        return tuple((t.data_ptr(), t.numel()) for t in (self._accept_storage, self._plan_storage,
                                                         self._hidden_storage))

    def verify_inputs(self, trees, seq_lens, seq_lens_sum=None):
        builder = self._reserved_for(trees.tokens.shape[0])
        width = trees.tokens.shape[1]
        out = None
        if builder is not None and seq_lens_sum is not None and width <= builder.max_budget + 1 and \
                builder.verify.full_mask.numel() >= full_mask_numel(seq_lens_sum, width, trees.tokens.shape[0]):
            out = builder.verify
        return self._verify.verify_inputs(trees, seq_lens.to(torch.int64), seq_lens_sum=seq_lens_sum, out=out,
                                          error_flag=self.tree_errors)

    def _accept_out(self, trees, max_depth):
        bs, width = trees.tokens.shape
        storage = self._storage("_accept_storage", self._accept.accept_storage_numel(bs, width, max_depth))
        return self._accept.carve_accept_result(storage, bs, width, max_depth)

    def accept_greedy(self, trees, logits, max_depth):
        return self._accept.accept_greedy(trees, logits, max_depth, out=self._accept_out(trees, max_depth))

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth, top_ks=None, top_ps=None,
                       min_ps=None):
        return self._accept.accept_sampled(trees, logits, temperatures, seeds, seq_lens.to(torch.int64), max_depth,
                                           top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
                                           out=self._accept_out(trees, max_depth))

    def sample_tokens(self, logits, temperatures, seeds, seq_lens, top_ks=None, top_ps=None,
                      min_ps=None) -> torch.Tensor:
        # Rare (a seeded request's prefill token outside deterministic mode): the reference sampler on a
        # host copy keeps one definition of the seeded draw.
        return ReferenceBackend(self.device).sample_tokens(logits, temperatures, seeds, seq_lens, top_ks, top_ps,
                                                           min_ps)

    def commit_plan(self, accepted, accept_lens, verify_slots):
        storage = self._storage("_plan_storage", 3 * accepted.numel())
        return self._compact.commit_plan(accepted, accept_lens, verify_slots, errors=self.commit_errors,
                                         storage=storage)

    def commit_kv(self, pool, plan) -> None:
        """Move the accepted rows' KV in every layer with one ``compact_kv`` launch (no host sync) when the pool
        is a plain MHA or MLA pool; any other pool goes through SGLang's ``move_kv_cache``."""
        table = self._kv_table(pool)
        if table is None:
            move_kv_with_sglang(pool, plan)
            return
        self._compact.compact_kv(table, plan, errors=self.commit_errors)

    def _kv_table(self, pool):
        key = id(pool)
        if key not in self._kv_tables:
            self._kv_tables[key] = (pool, _compactable_layers(pool, self._compact))
        return self._kv_tables[key][1]

    def gather_hidden(self, hidden, plan, width: int):
        """As ``ReferenceBackend.gather_hidden`` (here rows past tau are zeros), into reused storage."""
        bs, m = plan.hidden_rows.shape
        rows = plan.hidden_rows[:, : min(m, width)].contiguous()
        d = hidden.shape[-1]
        out = self._storage("_hidden_storage", rows.numel() * d, hidden.dtype)[: rows.numel() * d]
        return self._compact.gather_hidden(hidden, _PlanRows(rows), errors=self.commit_errors,
                                           out=out.view(bs, rows.shape[1], d))


@dataclass
class _PlanRows:
    """The part of a commit plan ``gather_hidden`` reads (its ``hidden_rows`` cut to the verify width)."""

    hidden_rows: torch.Tensor


def _compactable_layers(pool, compact):
    """A ``KVLayerTable`` over ``pool``'s layer buffers when ``compact_kv`` can move its rows exactly: SGLang's
    plain ``MHATokenToKVPool`` / ``MLATokenToKVPool`` (no quantisation scales, no paged head-major layout);
    None otherwise (the caller then uses the pool's own ``move_kv_cache``)."""
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    except ImportError:  # pragma: no cover - SGLang is a dependency
        return None
    if getattr(pool, "page_size", 1) != 1 or getattr(pool, "use_hnd", False):
        return None
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "layer_num", 1) == 0:
        return None
    try:
        if type(pool) is MLATokenToKVPool:
            return compact.kv_layer_table(list(pool.kv_buffer))
        if type(pool) is MHATokenToKVPool:
            return compact.kv_layer_table(list(pool.k_buffer) + list(pool.v_buffer))
    except (TypeError, ValueError) as exc:  # an unusual layout: SGLang's move keeps working
        logger.info("KDTREE: KV pool %s keeps SGLang's move_kv_cache (%s)", type(pool).__name__, exc)
    return None


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
