"""``GpuBackend``: the ``contract.RoundBackend`` on the CUDA kernels of ``sglang_kdtree.gpu`` (CuPy / NVRTC).

Imported by ``pipeline.select_backend`` on a CUDA device only; the kernel modules load in ``GpuBackend()``.
The kernels' launchers return the contract's dataclasses themselves, so the worker reads one set of types on
either backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang_kdtree.contract import eager_accept_commit_greedy, eager_tree_step, move_kv_with_sglang
from sglang_kdtree.gpu.buffers import grown
from sglang_kdtree.gpu.round_graphs import AcceptCommitGraphs, TreeStepGraphs
from sglang_kdtree.gpu.verify import full_mask_numel

logger = logging.getLogger(__name__)


class GpuBackend:
    """The CUDA kernels of ``sglang_kdtree.gpu`` (no host sync on the hot path; errors via device flags).

    After ``reserve(batch, budget, depth, vocab, mask_bytes)`` the round's steps write into buffers the backend
    owns for the server's lifetime (``gpu.tree.TreeBuilder`` for top-K, tree and verify inputs, plus accept,
    commit-plan and hidden-row storage), grown only when a batch or context is larger than any before; the
    bf16 draft logits are read as they are. Calls outside a reservation (tests, other shapes) allocate.

    Device error bits accumulate in ``tree_errors`` (``gpu.topk.TOPK_ERRORS``: draft log-probs, trees),
    ``commit_errors`` (``gpu.errors.DEVICE_ERRORS``: commit plan, KV compaction, hidden gather) and each accept
    result's per-request ``errors``; the worker turns them into per-request fault words once per round
    (``round_faults.device_fault_words``).
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
        self._tree_graphs = TreeStepGraphs(self)
        self._commit_graphs = AcceptCommitGraphs(self)

    # -- buffers ----------------------------------------------------------------------------------------

    @property
    def builder(self):
        """The ``gpu.tree.TreeBuilder`` that ``reserve`` sized (None before it, or after ``round_faults``
        released it): the buffers the round graphs capture."""
        return self._builder

    def reserve(self, batch: int, budget: int, depth: int, vocab: int, mask_bytes: int = 0) -> None:
        """Make the round's buffers hold ``batch`` requests of ``budget`` nodes over ``depth`` draft depths of a
        ``vocab``-wide head, and a FULL_MASK of ``mask_bytes``; allocates only when something grows."""
        b = self._builder
        if b is not None and (b.max_budget, b.depth, b.vocab) != (int(budget), int(depth), int(vocab)):
            b = None
        if b is None or batch > b.max_batch:
            cap = grown(b.max_batch if b is not None else 0, max(int(batch), 1))
            masks = grown(b.verify.full_mask.numel() if b is not None else 0, int(mask_bytes))
            self._builder = self._tree.TreeBuilder(cap, int(budget), int(depth), int(vocab), self.device,
                                                   max_mask_bytes=masks)
            self._builder.error_flag = self.tree_errors
        elif mask_bytes > b.verify.full_mask.numel():
            b.verify = self._verify.alloc_verify_inputs(
                b.max_batch, b.max_budget + 1, grown(b.verify.full_mask.numel(), int(mask_bytes)), self.device)

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
            current = torch.empty(grown(held, numel), dtype=dtype, device=self.device)
            setattr(self, name, current)
        return current

    # -- the round's steps (contract.RoundBackend) ------------------------------------------------------------

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

    def build_verify(self, logprobs, ids, budget, roots, seq_lens, seq_lens_sum: int):
        """``build`` then ``verify_inputs`` into the reserved buffers, in one launch where a list tree kernel applies
        (``gpu.tree.build_trees_verify``); the two calls otherwise (outside the reservation)."""
        builder = self._reserved_for(logprobs.shape[0])
        width = int(budget) + 1
        if builder is None or budget > builder.max_budget or \
                builder.verify.full_mask.numel() < full_mask_numel(seq_lens_sum, width, logprobs.shape[0]):
            trees = self.build(logprobs, ids, budget, roots)
            return trees, self.verify_inputs(trees, seq_lens, seq_lens_sum=seq_lens_sum)
        trees, verify = self._tree.build_trees_verify(logprobs, ids, int(budget), roots.to(torch.int64),
                                                      seq_lens.to(torch.int64), seq_lens_sum=int(seq_lens_sum),
                                                      out=builder.trees, out_verify=builder.verify,
                                                      error_flag=self.tree_errors)
        return trees, verify

    def tree_step(self, rows, weight, shape, roots, seq_lens, seq_lens_sum: int, graph: bool = True, mark=None,
                  prep_mark=None):
        """The round's draft head -> top-K -> tree -> cut -> verify inputs (``contract.eager_tree_step``): ``rows``
        ``[bs*L, D]`` draft hidden rows (depths 1..L of each request), ``weight`` the target's ``[V', D]`` lm_head
        (``V' >= shape.vocab``, the head's dtype), ``roots`` ``[bs]``, ``seq_lens`` ``[bs]`` and their host sum;
        ``prep_mark()`` and ``mark()`` (optional) are called just before and just after the head GEMM is issued.
        Returns a ``contract.TreeStep``.

        Within a reservation and with ``graph`` on, the head GEMM runs eagerly into a static buffer and the
        other steps replay one CUDA graph per batch size and width (``gpu.round_graphs.TreeStepGraphs``); outside a
        reservation, or once a capture failed, everything runs eagerly."""
        if graph and self._reserved_for(roots.shape[0], shape.depths, shape.vocab) is not None:
            if seq_lens.dtype != torch.int64:
                seq_lens = seq_lens.to(torch.int64)
            out = self._tree_graphs.step(rows, weight, shape, roots, seq_lens, seq_lens_sum, mark, prep_mark)
            if out is not None:
                return out
        return eager_tree_step(self, rows, weight, shape, roots, seq_lens, seq_lens_sum, mark, prep_mark)

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

    def _accept_out(self, trees, max_depth, with_seq_lens: bool):
        """The accept result's views of the reused storage; ``new_seq_lens`` None where the walk is not given
        the committed lengths (it would not be written)."""
        bs, width = trees.tokens.shape
        storage = self._storage("_accept_storage", self._accept.accept_storage_numel(bs, width, max_depth))
        return self._accept.carve_accept_result(storage, bs, width, max_depth, with_seq_lens)

    def accept_greedy(self, trees, logits, max_depth):
        out = self._accept_out(trees, max_depth, with_seq_lens=False)
        return self._accept.accept_greedy(trees, logits, max_depth, out=out)

    def accept_sampled(self, trees, logits, temperatures, seeds, seq_lens, max_depth, top_ks=None, top_ps=None,
                       min_ps=None):
        return self._accept.accept_sampled(
            trees, logits, temperatures, seeds, seq_lens.to(torch.int64), max_depth, top_ks=top_ks, top_ps=top_ps,
            min_ps=min_ps, out=self._accept_out(trees, max_depth, with_seq_lens=True))

    def sample_tokens(self, logits, temperatures, seeds, seq_lens, top_ks=None, top_ps=None,
                      min_ps=None) -> torch.Tensor:
        # Rare (a seeded request's prefill token outside deterministic mode): the reference sampler on a
        # host copy keeps one definition of the seeded draw.
        from sglang_kdtree.reference.backend import ReferenceBackend

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
