"""The round backend contract: what ``KDTreeWorker`` calls on a backend, and the results it gets back.

``RoundBackend`` is implemented by ``reference.backend.ReferenceBackend`` (numpy on host copies: CPU serving,
and the oracle) and ``gpu.backend.GpuBackend`` (the CUDA kernels); ``pipeline.select_backend`` picks one. Both
take torch tensors on the worker's device and return the dataclasses below, on that device, with the same
shapes and dtypes (``bs`` requests, ``N`` verify rows: ``B + 1`` for the whole tree, the round's width for a cut
one; ``L`` draft depths, ``P`` committed lengths). The kernels' launchers in ``sglang_kdtree.gpu`` return the
same dataclasses, so a result type is defined once per stage:

* ``Trees``: ``tokens``, ``depths``, ``parents`` ``[bs, N]`` int64; ``num_nodes`` ``[bs]`` int64; ``scores``
  ``[bs, N]`` float64 path scores; ``ranks`` ``[bs, N]`` int64 (GPU kernels only).
* ``TreeStep``: steps 2-3 of a round (trees cut to the width, their verify inputs, expected accept lengths per
  tier, draft logits).
* ``VerifyInputs``: ``input_ids``, ``positions`` ``[bs*N]`` int64; ``full_mask`` ``[sum(P)*N + N*N*bs]`` bool
  (SGLang's FULL_MASK); ``ancestor_bits`` ``[bs, N, ceil(N/32)]`` int32 (uint32 bit rows);
  ``retrieve_index``, ``retrieve_next_token``, ``retrieve_next_sibling`` ``[bs, N]`` int64.
* ``AcceptResult``: ``accepted`` ``[bs, L+1]`` int64 node indices (root first, -1 padded); ``accept_lens`` ``[bs]``
  int64 tau (bonus included); ``bonus`` ``[bs]`` int64; ``committed`` ``[bs, N]`` int64, the tau committed
  tokens then -1 (row stride N, SGLang's ``next_token_ids`` layout); ``errors`` ``[bs]`` int64 per-request fault
  bits (``gpu.errors.DEVICE_ERRORS``, 0 when valid); ``new_seq_lens`` ``[bs]`` int64 ``P + tau`` (GPU kernels
  only).
* ``CommitPlan``: ``src_slots``, ``dst_slots``, ``hidden_rows`` ``[bs, L+1]`` int64 (-1 padded); ``accept_lens``
  ``[bs]`` int64; ``errors``: the backend's ``commit_errors`` flag (``int32 [1]``).

A round commits at most ``min(N, L + 1)`` tokens per request: the columns of ``accepted`` and ``committed`` past
it are -1.

Each composition of steps is written once, over a ``state.RoundShape``: ``tree_verify`` (tree, cut, verify
inputs, expected accepts), ``topk_tree_verify`` (top-K first), ``eager_tree_step`` (the drafter's head GEMM
first; the GPU backend captures the same composition in a CUDA graph) and ``eager_accept_commit_greedy``.

Faults: no backend raises on bad values in one request. ``AcceptResult.errors`` marks requests, and
``tree_errors`` / ``commit_errors`` (``int32 [1]``) collect the batch's draft and commit faults; the worker turns
them into per-request fault words on the device (``round_faults.device_fault_words``) and ends the faulty
requests when SGLang reads the round's results (``round_faults.DeferredFaults``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_kdtree.gpu.errors import raise_on_device_error
from sglang_kdtree.state import RoundShape
from sglang_kdtree.round.widths import expected_accepts


@dataclass
class Trees:
    """A batch of best-first trees, padded to N rows (``reference.TreeBatch`` as torch tensors); ``scores``
    ``[bs, N]`` float64 path scores (0 root / padding), None where a caller built the batch without them;
    ``ranks`` ``[bs, N]`` int64 rank of each node within its depth's top-K (-1 root / padding), written by the GPU
    tree kernels (``gpu.tree.build_trees``), None elsewhere (the round never reads it)."""

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    scores: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class VerifyInputs:
    """What the target's tree-verify forward reads (``reference.VerifyInputs`` as torch tensors)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    full_mask: torch.Tensor
    ancestor_bits: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


@dataclass
class TreeStep:
    """Steps 2-3 of a round: the trees cut to the round's verify width, their verify inputs, every request's
    expected accept length at each tier of the round shape (``[bs, T]`` float32, ``widths.expected_accepts``; None
    without tiers) and the draft logits ``[bs*L, vocab]`` (None where the step started from log-probs)."""

    trees: Trees
    verify: VerifyInputs
    expected: torch.Tensor | None
    draft_logits: torch.Tensor | None = None


@dataclass
class AcceptResult:
    """One round's accepted paths and committed tokens (shapes in the module docstring); ``new_seq_lens``
    ``[bs]`` int64 ``P + tau``, written by the GPU accept kernels when given the committed lengths
    (``gpu.accept``), None elsewhere (the worker adds ``accept_lens`` to its own lengths)."""

    accepted: torch.Tensor
    accept_lens: torch.Tensor
    bonus: torch.Tensor
    committed: torch.Tensor
    errors: torch.Tensor
    new_seq_lens: torch.Tensor | None = None

    def raise_on_error(self) -> None:
        """Sync and raise ``ValueError`` naming each fault if any request's ``errors`` bits are set (tests and
        debugging: the worker reads the bits without raising, ``round_faults.device_fault_words``)."""
        raise_on_device_error(self.errors, "accept")


@dataclass
class CommitPlan:
    """The KV moves and hidden rows that commit the accepted paths (``reference.CommitPlan`` as torch tensors)."""

    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    hidden_rows: torch.Tensor
    accept_lens: torch.Tensor
    errors: torch.Tensor


class RoundBackend(Protocol):
    """The round's tensor operations (steps 2-6 of ``sglang_kdtree.round.worker``); tensors on ``device``."""

    name: str  # "reference" or "gpu"
    device: torch.device
    tree_errors: torch.Tensor  # int32 [1]: draft log-prob / tree / verify-input faults of the batch
    commit_errors: torch.Tensor  # int32 [1]: commit plan / KV move / hidden gather faults of the batch

    def reserve(self, batch: int, budget: int, depth: int, vocab: int, mask_bytes: int = 0) -> None:
        """Size the round's buffers (grow-only; a no-op where nothing is preallocated)."""

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[bs, L, V]`` draft logits -> ``(logprobs [bs, L, K] float32, ids [bs, L, K] int64)``."""

    def shard_topk(self, logits_shard: torch.Tensor, k: int, id_offset: int):
        """A vocabulary shard's top-K partials ``(values, global ids, row logsumexp)``."""

    def merge_topk(self, vals: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int):
        """Merge ``[S, ...]`` shard partials into ``(logprobs, ids)`` (``pipeline.vocab_parallel_topk``)."""

    def build(self, logprobs: torch.Tensor, ids: torch.Tensor, budget: int, roots: torch.Tensor) -> Trees:
        """The best-first tree of ``budget`` nodes per request under ``roots`` ``[bs]``."""

    def verify_inputs(self, trees: Trees, seq_lens: torch.Tensor, seq_lens_sum: int | None = None) -> VerifyInputs:
        """The verify forward's inputs for ``trees`` after committed lengths ``seq_lens`` ``[bs]``."""

    def build_verify(self, logprobs, ids, budget: int, roots, seq_lens, seq_lens_sum: int):
        """``build`` then ``verify_inputs`` of the whole tree: ``(trees, verify)`` (one launch on the GPU)."""

    def tree_step(self, rows, weight, shape: RoundShape, roots, seq_lens, seq_lens_sum: int, graph: bool = True,
                  mark=None, prep_mark=None) -> TreeStep:
        """``eager_tree_step`` in one call (the GPU replays it from a CUDA graph). ``prep_mark()`` / ``mark()``
        (optional): called just before / just after the head GEMM is issued (the round log's ``tree_prep`` /
        ``draft_head``)."""

    def accept_greedy(self, trees: Trees, logits: torch.Tensor, max_depth: int) -> AcceptResult:
        """The walk along the target's argmax (``logits`` ``[bs, N, V]``)."""

    def accept_sampled(self, trees: Trees, logits, temperatures, seeds, seq_lens, max_depth: int, top_ks=None,
                       top_ps=None, min_ps=None) -> AcceptResult:
        """The walk along per-node samples of the target (seeded per request and position)."""

    def sample_tokens(self, logits, temperatures, seeds, seq_lens, top_ks=None, top_ps=None,
                      min_ps=None) -> torch.Tensor:
        """One seeded sample per row of ``[bs, V]`` logits (the prefill's redraw) -> ``[bs]`` int64."""

    def commit_plan(self, accepted, accept_lens, verify_slots) -> CommitPlan:
        """The KV moves and hidden rows that put the accepted paths at positions ``P..P+tau-1``."""

    def commit_kv(self, pool, plan: CommitPlan) -> None:
        """Apply ``plan`` to every layer of SGLang's KV ``pool``."""

    def gather_hidden(self, hidden: torch.Tensor, plan: CommitPlan, width: int) -> torch.Tensor:
        """``[bs, min(L+1, N), D]`` hidden states of the accepted rows (rows past tau: unspecified)."""

    def accept_commit_greedy(self, trees: Trees, logits, depth: int, verify_slots, pool, hidden, width: int,
                             graph: bool = False) -> tuple[AcceptResult, CommitPlan, torch.Tensor]:
        """``accept_greedy`` -> ``commit_plan`` -> ``commit_kv`` -> ``gather_hidden`` in one call
        (``eager_accept_commit_greedy``)."""


def cut_trees(trees: Trees, width: int) -> Trees:
    """The first ``width`` rows of every tree (``reference.cut_trees`` on torch tensors: the budget-``width - 1``
    trees), contiguous."""
    if width == trees.width:
        return trees
    cut = lambda t: None if t is None else t[:, :width].contiguous()  # noqa: E731
    return Trees(cut(trees.tokens), cut(trees.depths), cut(trees.parents), trees.num_nodes.clamp(max=width - 1),
                 cut(trees.scores))


def tree_verify(backend: RoundBackend, logprobs, ids, shape: RoundShape, roots, seq_lens,
                seq_lens_sum: int) -> TreeStep:
    """The tree of ``shape.budget`` nodes from per-depth log-probs, cut to ``shape.width`` rows, its verify inputs
    and the expected accept length at each tier (from the whole tree: a cut's prefix sum). Every path of the round
    builds its tree here."""
    if not shape.is_cut:
        trees, verify = backend.build_verify(logprobs, ids, shape.budget, roots, seq_lens, int(seq_lens_sum))
        full = trees
    else:
        full = backend.build(logprobs, ids, shape.budget, roots)
        trees = cut_trees(full, shape.width)
        verify = backend.verify_inputs(trees, seq_lens, seq_lens_sum=int(seq_lens_sum))
    expected = expected_accepts(full.scores, full.num_nodes, shape.tiers) if shape.tiers else None
    return TreeStep(trees, verify, expected)


def topk_tree_verify(backend: RoundBackend, logits, shape: RoundShape, roots, seq_lens, seq_lens_sum: int) -> TreeStep:
    """``[bs*L, vocab]`` draft logits -> per-depth top-K (``K = shape.k``) -> ``tree_verify``."""
    logprobs, ids = backend.topk(logits.unflatten(0, (roots.shape[0], shape.depths)), shape.k)
    step = tree_verify(backend, logprobs, ids, shape, roots, seq_lens, seq_lens_sum)
    step.draft_logits = logits
    return step


def draft_head(rows, weight, vocab: int, out=None):
    """The drafter's head: ``rows @ weight.T`` (the target's lm_head, in its own dtype) cut to ``vocab`` columns;
    ``out`` (optional) a static ``[rows, weight rows]`` buffer it is written into."""
    if out is None:
        return torch.matmul(rows, weight.t())[:, :vocab]
    torch.matmul(rows, weight.t(), out=out)
    return out[:, :vocab]


def eager_tree_step(backend: RoundBackend, rows, weight, shape: RoundShape, roots, seq_lens, seq_lens_sum: int,
                    mark=None, prep_mark=None) -> TreeStep:
    """``tree_step`` as calls: ``prep_mark()``, the head GEMM (``draft_head``), ``mark()``, then
    ``topk_tree_verify``."""
    if prep_mark is not None:
        prep_mark()
    logits = draft_head(rows, weight, shape.vocab)
    if mark is not None:
        mark()
    return topk_tree_verify(backend, logits, shape, roots, seq_lens, seq_lens_sum)


def eager_accept_commit_greedy(backend: RoundBackend, trees, logits, depth: int, verify_slots, pool, hidden,
                               width: int):
    """``accept_commit_greedy`` as four calls: ``accept_greedy``, ``commit_plan``, ``commit_kv``,
    ``gather_hidden``. Returns ``(accept result, commit plan, accepted hidden rows)``."""
    acc = backend.accept_greedy(trees, logits, depth)
    plan = backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
    backend.commit_kv(pool, plan)
    return acc, plan, backend.gather_hidden(hidden, plan, width)


def move_kv_with_sglang(pool, plan) -> None:
    """Apply a commit plan with the pool's own ``move_kv_cache``, in one fixed-shape call (every plan row) so the
    host never waits to learn which rows move: a row that keeps its slot copies it onto itself, and a padding row
    (``dst_slots`` -1) copies SGLang's padding slot 0 onto itself; neither changes a byte. No such self-copy
    touches a slot that a moving row reads or writes: an accepted path strictly increases from node 0, so a row
    that keeps its slot has only such rows before it, and every moving row reads a node past it."""
    dst = plan.dst_slots.clamp_min(0)
    src = torch.where((plan.src_slots >= 0) & (plan.src_slots != plan.dst_slots), plan.src_slots, dst)
    pool.move_kv_cache(dst.reshape(-1), src.reshape(-1))
