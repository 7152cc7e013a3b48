"""``ReferenceBackend``: the ``contract.RoundBackend`` on ``sglang_kdtree.reference`` (numpy on host copies).

It serves CPU servers and is the oracle the GPU backend is tested against. Every call converts its torch inputs
to numpy once and its results to torch once: the grouped calls (``tree_step``: top-K -> tree -> verify
inputs; ``accept_commit_greedy``: accept -> commit plan) chain the numpy steps in between. Results have the
GPU backend's shapes (``contract``): ``committed`` is widened from the reference's ``[bs, L+1]`` to ``[bs, N]``.

Faults: a request whose draft logits hold NaN / +inf, or whose target logits hold NaN, is computed on neutral
stand-in values and marked (``tree_errors``, ``AcceptResult.errors``), as the GPU kernels do; nothing raises.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_kdtree import reference
from sglang_kdtree.contract import (AcceptResult, CommitPlan, Trees, VerifyInputs, eager_tree_step,
                                    move_kv_with_sglang)
from sglang_kdtree.gpu.errors import ERR_LOGITS_NAN, ERR_LOGITS_POSINF, ERR_TARGET_NAN

#: fault bits, shared with the kernels (``gpu.errors.DEVICE_ERRORS``): the draft logits (the bits the GPU top-K
#: sets for the same fault) and the target logits
_DRAFT_NAN, _DRAFT_POSINF, _TARGET_NAN = ERR_LOGITS_NAN, ERR_LOGITS_POSINF, ERR_TARGET_NAN


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


def _faulty_requests(x: np.ndarray) -> np.ndarray:
    """Per request (leading axis) the draft fault bits of ``x``: ``_DRAFT_NAN`` for a NaN, ``_DRAFT_POSINF`` for a
    +inf anywhere."""
    flat = x.reshape(x.shape[0], -1)
    return np.where(np.isnan(flat).any(axis=1), _DRAFT_NAN, 0) | np.where(np.isposinf(flat).any(axis=1),
                                                                          _DRAFT_POSINF, 0)


def _tree_batch(trees) -> reference.TreeBatch:
    return reference.TreeBatch(tokens=_np(trees.tokens), depths=_np(trees.depths), parents=_np(trees.parents),
                               num_nodes=_np(trees.num_nodes),
                               scores=None if trees.scores is None else _np(trees.scores))


def _screen_target(logits) -> tuple[np.ndarray, np.ndarray]:
    """Host copy of the target logits with NaN requests neutralised, and the per-request fault bits."""
    x = _np(logits.float())
    bad = np.where(np.isnan(x.reshape(x.shape[0], -1)).any(axis=1), _TARGET_NAN, 0).astype(np.int64)
    if bad.any():
        x = x.copy()
        x[bad != 0] = 0.0
    return x, bad


def _widened(committed: np.ndarray, width: int) -> np.ndarray:
    """``[bs, L+1]`` committed tokens as the contract's ``[bs, N]`` (-1 padded; tau <= min(L+1, N))."""
    out = np.full((committed.shape[0], width), -1, dtype=np.int64)
    cols = min(committed.shape[1], width)
    out[:, :cols] = committed[:, :cols]
    return out


class ReferenceBackend:
    """``sglang_kdtree.reference`` on host copies of the tensors (CPU serving, and the oracle)."""

    name = "reference"

    def __init__(self, device):
        self.device = torch.device(device)
        # the GPU backend's flags, so the worker reads one contract: a request whose inputs are faulty is
        # computed on neutral stand-in values, marked, and ended by the worker; the batch goes on
        self.tree_errors = torch.zeros(1, dtype=torch.int32)
        self.commit_errors = torch.zeros(1, dtype=torch.int32)

    # -- numpy <-> torch, once each way per call ---------------------------------------------------------

    def _t(self, a, dtype=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype=dtype)

    def _trees(self, tb: reference.TreeBatch) -> Trees:
        return Trees(self._t(tb.tokens), self._t(tb.depths), self._t(tb.parents), self._t(tb.num_nodes),
                     None if tb.scores is None else self._t(tb.scores))

    def _verify(self, vi: reference.VerifyInputs) -> VerifyInputs:
        return VerifyInputs(
            input_ids=self._t(vi.input_ids), positions=self._t(vi.positions), full_mask=self._t(vi.full_mask),
            ancestor_bits=self._t(vi.ancestor_bits.view(np.int32)), retrieve_index=self._t(vi.retrieve_index),
            retrieve_next_token=self._t(vi.retrieve_next_token),
            retrieve_next_sibling=self._t(vi.retrieve_next_sibling),
        )

    def _accept(self, res: reference.AcceptResult, errors: np.ndarray, width: int) -> AcceptResult:
        return AcceptResult(self._t(res.accepted), self._t(res.accept_lens), self._t(res.bonus),
                            self._t(_widened(res.committed, width)), self._t(errors))

    def _plan(self, plan: reference.CommitPlan) -> CommitPlan:
        return CommitPlan(self._t(plan.src_slots), self._t(plan.dst_slots), self._t(plan.hidden_rows),
                          self._t(plan.accept_lens), self.commit_errors)

    # -- numpy steps ----------------------------------------------------------------------------------------

    def _topk_np(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """As ``reference.topk_logprobs``; a request whose draft logits hold NaN / +inf gets NaN log-probs (its
        fault mark, see ``_build_np``) and sets its bits in ``tree_errors`` instead of raising."""
        bad = _faulty_requests(x) if x.ndim > 1 else np.zeros(0, dtype=np.int64)
        if bad.any():
            x = x.copy()
            x[bad != 0] = 0.0
            self.tree_errors |= int(np.bitwise_or.reduce(bad))
        lp, ids = reference.topk_logprobs(x, k)
        if bad.any():
            lp[bad != 0] = np.nan
        return lp, ids

    @staticmethod
    def _build_np(lp: np.ndarray, ids: np.ndarray, budget: int, roots: np.ndarray) -> reference.TreeBatch:
        marked = np.isnan(lp.reshape(lp.shape[0], -1)).any(axis=1) if lp.ndim > 1 else np.zeros(0, dtype=bool)
        if marked.any():  # requests marked by topk: a tree from flat log-probs keeps the batch's shapes
            lp = lp.copy()
            lp[marked] = 0.0
        return reference.build_trees(lp, ids, int(budget), roots.astype(np.int64))

    # -- the contract -----------------------------------------------------------------------------------------

    def reserve(self, batch, budget, depth, vocab, mask_bytes=0) -> None:
        """Nothing to preallocate: the reference works on host copies."""

    def topk(self, logits, k):
        lp, ids = self._topk_np(_np(logits.float()), k)
        return self._t(lp), self._t(ids)

    def shard_topk(self, logits_shard, k, id_offset):
        """As ``reference.shard_topk_partials``; a row holding NaN / +inf sets its bits in ``tree_errors`` and is
        computed with its finite values and NaN / +inf replaced by 0 (the worker traces the flag back to the
        request through the draft logits). Its ``-inf`` columns stay ``-inf``: they include the shard's padding
        past the vocabulary, which must never become a candidate token."""
        x = _np(logits_shard.float())
        flat = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)
        bad = _faulty_requests(flat)
        if bad.any():
            flat = flat.copy()
            rows = flat[bad != 0]
            flat[bad != 0] = np.where(np.isneginf(rows), -np.inf, 0.0)
            self.tree_errors |= int(np.bitwise_or.reduce(bad))
            x = flat.reshape(x.shape)
        vals, ids, lse = reference.shard_topk_partials(x, k, id_offset)
        return self._t(vals), self._t(ids), self._t(lse)

    def merge_topk(self, vals, ids, lse, k):
        lp, out_ids = reference.merge_topk_partials(_np(vals), _np(ids), _np(lse), k)
        return self._t(lp), self._t(out_ids)

    def build(self, logprobs, ids, budget, roots) -> Trees:
        return self._trees(self._build_np(_np(logprobs), _np(ids), budget, _np(roots)))

    def verify_inputs(self, trees, seq_lens, seq_lens_sum=None) -> VerifyInputs:
        return self._verify(reference.verify_inputs(_tree_batch(trees), _np(seq_lens).astype(np.int64)))

    def build_verify(self, logprobs, ids, budget, roots, seq_lens, seq_lens_sum: int):
        trees = self.build(logprobs, ids, budget, roots)
        return trees, self.verify_inputs(trees, seq_lens, seq_lens_sum=seq_lens_sum)

    def tree_step(self, rows, weight, shape, roots, seq_lens, seq_lens_sum: int, graph: bool = True, mark=None,
                  prep_mark=None):
        """``contract.eager_tree_step`` (no graphs on the host)."""
        return eager_tree_step(self, rows, weight, shape, roots, seq_lens, seq_lens_sum, mark, prep_mark)

    def accept_greedy(self, trees, logits, max_depth) -> AcceptResult:
        x, bad = _screen_target(logits)
        return self._accept(reference.accept_greedy(_tree_batch(trees), x, max_depth), bad, trees.tokens.shape[1])

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth, top_ks=None,
                       top_ps=None, min_ps=None) -> AcceptResult:
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
        logits_np, bad = _screen_target(logits)
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
        joined = reference.AcceptResult(*(np.concatenate([getattr(p, f) for p in parts])
                                          for f in ("accepted", "accept_lens", "bonus", "committed")))
        return self._accept(joined, bad, trees.tokens.shape[1])

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

    def commit_plan(self, accepted, accept_lens, verify_slots) -> CommitPlan:
        return self._plan(reference.commit_plan(_np(accepted), _np(accept_lens), _np(verify_slots).astype(np.int64)))

    def commit_kv(self, pool, plan) -> None:
        move_kv_with_sglang(pool, plan)

    def gather_hidden(self, hidden, plan, width: int):
        """``[bs, M', D]`` hidden rows of the accepted path, ``M' = min(M, width)``; rows past tau are unspecified
        (the drafter's KV write takes the first tau)."""
        rows = plan.hidden_rows[:, : min(plan.hidden_rows.shape[1], width)]
        return hidden[torch.where(rows >= 0, rows, torch.zeros_like(rows)).reshape(-1)].view(*rows.shape, -1)

    def accept_commit_greedy(self, trees, logits, depth: int, verify_slots, pool, hidden, width: int,
                             graph: bool = False):
        """Greedy accept -> commit plan -> KV commit -> accepted hidden rows (the GPU contract): the accept and
        the plan on one host copy of the trees and logits, one conversion of their results."""
        x, bad = _screen_target(logits)
        res = reference.accept_greedy(_tree_batch(trees), x, depth)
        plan = self._plan(reference.commit_plan(res.accepted, res.accept_lens, _np(verify_slots).astype(np.int64)))
        self.commit_kv(pool, plan)
        return self._accept(res, bad, trees.tokens.shape[1]), plan, self.gather_hidden(hidden, plan, width)
