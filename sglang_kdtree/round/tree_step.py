"""Steps 2-3: per-depth top-K of the target head on the draft rows, then the best-first tree cut to the round's
width and its verify input. On one rank both are one backend call (``tree_step``); under tensor parallelism or
test fault injection they run one by one (``draft_topk``, then ``contract.tree_verify``)."""

from __future__ import annotations

import torch

from sglang_kdtree.contract import TreeStep, draft_head, tree_verify
from sglang_kdtree.round import faults as round_faults
from sglang_kdtree.round.begin import Round
from sglang_kdtree.round.pipeline import vocab_parallel_topk


def topk_and_tree(worker, rnd: Round, draft_hidden) -> TreeStep:
    """Steps 2-3: per-depth top-K of the target head on the draft rows, the tree at the full budget, cut to
    the round's width, its verify inputs (``contract.tree_verify``)."""
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.runtime_context import get_parallel

    if worker._test_faults_path is not None:  # with the file, the steps run one by one (and read it)
        rnd.faults = round_faults.read_test_faults(worker._test_faults_path, rnd.batch)
    roots = rnd.draft_input.bonus_tokens
    if roots.dtype != torch.int64:
        roots = roots.to(torch.int64)
    marks = rnd.marks
    # The round log's "tree_prep": this step's host work before the drafter's head GEMM, "draft_head" (and its
    # static inputs' copy when that goes first); in a host-paced round the GPU waits for it. It also holds the
    # head rows' view (and their cast, when the draft's hidden dtype is not the head's): counted as bookkeeping,
    # not as the drafter's.
    if rnd.faults is None and get_parallel().tp_size == 1:
        # one call: head GEMM (the draft's last step), then top-K -> tree -> verify inputs (on the GPU
        # one CUDA graph replay after the eager GEMM; gpu/round_graphs.py orders the GEMM and the step's host
        # work by the stream's state)
        lm_head = unwrap_lora_layer(worker.target_worker.model_runner.model.lm_head)
        rows = draft_hidden[:, 1:, :].reshape(-1, draft_hidden.shape[-1]).to(lm_head.weight.dtype)
        step = worker.backend.tree_step(rows, lm_head.weight, rnd.shape, roots, rnd.prefix_lens, rnd.prefix_sum,
                                      graph=worker._round_graphs, mark=lambda: marks.mark("draft_head"),
                                      prep_mark=lambda: marks.mark("tree_prep"))
        marks.mark("tree_step")
        return step
    marks.mark("tree_prep")
    # tensor parallel (vocab-parallel top-K) or test fault injection: step by step
    logprobs, ids, draft_logits = draft_topk(worker, draft_hidden, rnd.faults, marks)
    marks.mark("topk")
    step = tree_verify(worker.backend, logprobs, ids, rnd.shape, roots, rnd.prefix_lens, rnd.prefix_sum)
    step.draft_logits = draft_logits
    marks.mark("build")
    return step

def draft_topk(worker, draft_hidden, faults=None, marks=None):
    """Per-depth top-K log-probs of the target head on draft rows 1..L; vocab-parallel under TP. ``marks``
    (a ``round_log.RoundMarks``) gets ``draft_head`` after the head GEMM."""
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.runtime_context import get_parallel

    lm_head = unwrap_lora_layer(worker.target_worker.model_runner.model.lm_head)
    bs, _, hidden_size = draft_hidden.shape
    rows = draft_hidden[:, 1:, :].reshape(-1, hidden_size).to(lm_head.weight.dtype)
    # the head's own dtype (bf16 in serving): both backends read it as it is, no fp32 copy
    local = draft_head(rows, lm_head.weight, lm_head.weight.shape[0])
    if marks is not None:
        marks.mark("draft_head")
    for b in (faults or {}).get("draft_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
        local[b * worker.depths, 0] = float("nan")
    shard = getattr(lm_head, "shard_indices", None)
    tp = get_parallel().tp_size
    k = worker.geometry.shape().k
    if tp == 1:
        logprobs, ids = worker.backend.topk(local[:, : worker.vocab_size].unflatten(0, (bs, worker.depths)), k)
    else:
        # Columns past the shard's real vocabulary are padding: never candidates.
        start = int(shard.org_vocab_start_index) if shard is not None else 0
        real = int(shard.num_org_elements) if shard is not None else local.shape[1]
        local = local.clone()
        local[:, real:] = float("-inf")
        logprobs, ids = vocab_parallel_topk(local, k, start, worker.backend,
                                            group=get_parallel().tp_group.device_group)
    return logprobs.view(bs, worker.depths, -1), ids.view(bs, worker.depths, -1), local
