"""Step 4: the target's verify forward of the round's tree rows, on the attention backend and verify graphs of
the round's width (``verify_tiers``)."""

from __future__ import annotations

from sglang_kdtree.round import log as round_log
from sglang_kdtree.round.begin import Round, gather_slots
from sglang_kdtree.round.verify_input import tree_verify_batch


def verify(worker, rnd: Round, trees, verify):
    """Step 4: the target's TARGET_VERIFY forward of the N tree rows per request. Returns ``(verify slots
    [bs, N], the KV plan, SGLang's forward output, verify logits [bs, N, V])``."""
    width = rnd.width
    verify_slots = gather_slots(worker, rnd.batch, rnd.prefix_lens, width)
    with worker.verify_tiers.use(width):  # the target's attention backend and verify graphs of this width
        verify_fb, kv_plan = tree_verify_batch(worker.target_worker, rnd.batch, verify, verify_slots,
                                               rnd.prefix_lens, rnd.prefix_cpu, rnd.prefix_sum, width)
        rnd.keep_alive.append(verify_fb)
        rnd.marks.mark("prepare")
        target_out = worker.target_worker.forward_batch_generation(batch=None, forward_batch=verify_fb,
                                                                 is_verify=True, skip_attn_backend_init=True)
    worker.verify_tiers.count(width, target_out.can_run_cuda_graph)
    logits = target_out.logits_output.next_token_logits[:, : worker.vocab_size].reshape(rnd.bs, width, -1)
    for b in (rnd.faults or {}).get("target_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
        logits[b, 0, 0] = float("nan")
    rnd.marks.mark("verify")
    if worker._dump_prefix is not None and worker._dumped < round_log.DUMP_ROUNDS:
        round_log.dump_verify(worker._dump_prefix, worker._dumped, verify, trees, logits, target_out.can_run_cuda_graph)
        worker._dumped += 1
    return verify_slots, kv_plan, target_out, logits
