"""Step 8: what the round hands SGLang (``GenerationBatchResult``), and what it leaves behind: the committed
tokens' logprobs, the fault words, the width choice's statistics and the round log's record."""

from __future__ import annotations

import torch

from sglang_kdtree.contract import TreeStep
from sglang_kdtree.round import faults as round_faults
from sglang_kdtree.round import log as round_log
from sglang_kdtree.round.begin import Round
from sglang_kdtree.round.spec_logprobs import round_logprobs
from sglang_kdtree.server import host_times


def round_result(worker, rnd: Round, acc, commit, logits, target_out, step: TreeStep, new_seq_lens):
    """Step 8: the V2 result (token rows of the server's stride N, whatever width this round verified, whose
    first tau entries are committed), the logprobs of the committed tokens (``return_logprob`` batches), the
    round's faults, the width choice's statistics and the round log's record."""
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    logits_output = target_out.logits_output
    out_tokens = torch.nn.functional.pad(acc.committed.clamp_min(0), (0, worker.verify_width - rnd.width))
    if rnd.batch.return_logprob:
        # from the verify rows of the accepted nodes, over the C = min(width, L + 1) columns a round can commit
        cols = min(rnd.width, worker.geometry.block_size)
        round_logprobs(rnd.batch, logits_output, logits, acc.accepted[:, :cols], acc.committed[:, :cols])
    rnd.marks.mark("accept_commit")
    worker.chooser.record(rnd.width, rnd.bs, rnd.prefix_sum, rnd.started, step.expected, acc.accepted)
    fault_words = round_faults.device_fault_words(worker.backend, acc, commit, step.draft_logits)
    if worker._tp_fault_group is not None:
        fault_words = round_faults.union_over_ranks(fault_words, worker._tp_fault_group)
    if worker._round_log is not None:
        worker.chooser.settle(wait=True)  # the record names this round's width: diagnostics may wait
        round_log.write_round_record(worker._round_log, worker.backend, worker.device, acc, step.verify, step.trees,
                                     rnd.marks, target_out.can_run_cuda_graph, width=worker.chooser.last,
                                     tiers=worker.verify_tiers.stats())
    host_times.round_steps(rnd.marks)
    next_draft_input = make_draft_input_v2(bonus_tokens=acc.bonus.to(torch.int64), new_seq_lens=new_seq_lens)
    worker.deferred_faults.push(rnd.batch.reqs, fault_words)  # last: a retried round must not push twice
    return GenerationBatchResult(
        logits_output=logits_output,
        next_token_ids=out_tokens.reshape(-1),
        accept_lens=acc.accept_lens.to(torch.int32),
        can_run_cuda_graph=target_out.can_run_cuda_graph,
        next_draft_input=next_draft_input,
        speculative_num_draft_tokens=worker.verify_width,
        new_seq_lens=new_seq_lens,
        routed_experts_output=target_out.routed_experts_output,
        indexer_topk_output=target_out.indexer_topk_output,
        extra_keep_alive_refs=rnd.keep_alive,
    )
