"""DDTree semantics, in one place: the CPU (numpy) reference every GPU kernel is checked against.

One decoding round of DDTree (see ``shared/notes/ddtree.md``, the contract):

1. ``topk_logprobs``: per draft depth, the top ``K = min(budget, V)`` tokens of the drafter's logits and
   their log-probabilities ``logit - logsumexp(row)``; equal logits: lower token id first.
2. ``build_tree`` / ``build_trees``: the exact best-first tree of ``min(budget, reachable)`` nodes,
   float64 scores with incremental sibling arithmetic, ties to the lexicographically smaller rank tuple,
   nodes numbered in pop order, node 0 = the root (the bonus token of the previous round). ``cut_trees``: the
   first ``n`` rows of a budget-``B`` tree, which are exactly its budget-``n - 1`` tree (the verify width's cut).
3. ``verify_inputs``: what the target's tree-verify forward consumes: input ids ``[root, nodes]``,
   positions ``P + depth``, SGLang's FULL_MASK for a batch, bit-packed ancestor rows, and the
   first-child / next-sibling / retrieve-index links of SGLang's ``verify_tree_greedy``.
4. ``accept_greedy`` / ``accept_sampled``: the walk down the tree along the target's own choices.
5. ``commit_plan`` / ``compact_kv``: the KV moves that put the accepted path at slots for positions
   ``P .. P+tau-1`` and the hidden rows the drafter reads next round.

Conventions shared with the GPU path (``sglang_kdtree.gpu``), which has the same signatures:

* A batch of trees is padded to a fixed verify width ``N = budget + 1`` rows per request. Rows past a
  request's ``num_nodes`` are *padding*: token 0, depth 0, parent -1, not linked into the tree, their mask
  row sees only themselves (and the prefix), so they are inert in attention and can never be accepted.
* ``-inf`` log-probs mean "impossible token" (e.g. a vocabulary entry masked to ``-inf``): such a
  candidate never becomes a node. A depth whose every log-prob is ``-inf`` ends the tree there.
  NaN and ``+inf`` are errors (``ValueError``), as are unsorted rows.
* All errors are ``ValueError`` (bad values / shapes) or ``TypeError`` (bad dtypes) naming the argument,
  the offending value and what is expected.

One module per step, each the twin of the same-named launcher module in ``sglang_kdtree/gpu/``: ``topk`` (1),
``tree`` (2), ``verify`` (3), ``accept`` (4), ``compact`` (5); ``sampling`` holds the target's sampling at a node
(SGLang's filters, the inverse-CDF draw) and the seeded-sampling rule ``position_uniform``. Every public name
is importable from here; ``MAX_BUDGET`` is ``sglang_kdtree.state``'s.
"""

from __future__ import annotations

from sglang_kdtree.reference.accept import AcceptResult, accept_greedy, accept_sampled
from sglang_kdtree.reference.compact import CommitPlan, commit_plan, compact_kv, gather_hidden
from sglang_kdtree.reference.sampling import (
    PositionUniforms,
    filter_top_k_top_p,
    position_uniform,
    sample_node_tokens,
    sampling_weights,
)
from sglang_kdtree.reference.topk import merge_topk_partials, shard_topk_partials, topk_logprobs
from sglang_kdtree.reference.tree import Tree, TreeBatch, build_tree, build_trees, cut_trees
from sglang_kdtree.reference.verify import VerifyInputs, ancestor_bits_to_bool, ancestor_matrix, verify_inputs
from sglang_kdtree.state import MAX_BUDGET

__all__ = [
    "MAX_BUDGET",
    "Tree",
    "TreeBatch",
    "VerifyInputs",
    "AcceptResult",
    "CommitPlan",
    "PositionUniforms",
    "topk_logprobs",
    "shard_topk_partials",
    "merge_topk_partials",
    "build_tree",
    "build_trees",
    "cut_trees",
    "ancestor_matrix",
    "verify_inputs",
    "ancestor_bits_to_bool",
    "accept_greedy",
    "filter_top_k_top_p",
    "sampling_weights",
    "sample_node_tokens",
    "position_uniform",
    "accept_sampled",
    "commit_plan",
    "compact_kv",
    "gather_hidden",
]
