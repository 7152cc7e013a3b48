"""Steps 5-6: the accept walk (the target's argmax at T = 0, per-node samples at T > 0) and the KV commit of the
accepted path."""

from __future__ import annotations

import torch

from sglang_kdtree.round import seeded
from sglang_kdtree.round.begin import Round


def accept_and_commit(worker, rnd: Round, trees, logits, verify_slots, target_out):
    """Steps 5-6: accept, then the KV commit (the accepted path to the slots of positions P..P+tau-1, read
    all then write) and the accepted rows' hidden states ``[bs, C, D]`` for the drafter. Returns ``(accept
    result, commit plan, accepted hidden rows)``."""
    sampling = rnd.batch.sampling_info
    pool = worker.target_worker.model_runner.token_to_kv_pool
    hidden = target_out.logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("KDTREE verify requires target hidden states, but got None")
    width = rnd.width
    if sampling is None or sampling.is_all_greedy:
        # one call; a CUDA graph replay when the verify forward replayed SGLang's (fixed output addresses)
        out = worker.backend.accept_commit_greedy(trees, logits, worker.depths, verify_slots, pool, hidden, width,
                                                graph=worker._round_graphs and bool(target_out.can_run_cuda_graph))
        rnd.marks.mark("accept_commit_kv")
        return out
    seeds, _ = seeded.request_seeds(rnd.batch, worker.device)
    min_ps = seeded.per_request(sampling.min_ps if sampling.need_min_p_sampling else None)
    acc = worker.backend.accept_sampled(trees, logits, sampling.temperatures.view(-1), seeds.view(-1),
                                      rnd.prefix_lens, worker.depths, top_ks=seeded.per_request(sampling.top_ks),
                                      top_ps=seeded.per_request(sampling.top_ps), min_ps=min_ps)
    rnd.marks.mark("accept")
    commit = worker.backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
    worker.backend.commit_kv(pool, commit)
    rnd.marks.mark("commit")
    return acc, commit, worker.backend.gather_hidden(hidden, commit, width)
