"""Steps 1 and 7: the DFlash drafter's two touches of a round. It drafts the block ``[bonus, MASK...]`` before
the tree, and takes the accepted rows' target hidden states into its KV after the accept."""

from __future__ import annotations

import torch

from sglang_kdtree.round.begin import Round, gather_slots


def draft_block(worker, rnd: Round):
    """Run the DFlash drafter over ``[bonus, MASK...]``; returns the draft hidden states [bs, block, H]."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_utils import draft_tp_context
    from sglang.srt.lora.layers import unwrap_lora_layer

    batch, draft_input, prefix_lens = rnd.batch, rnd.draft_input, rnd.prefix_lens
    bs, block = rnd.bs, int(worker.block_size)
    block_ids = torch.full((bs, block), int(worker._mask_token_id), dtype=torch.int64, device=worker.device)
    block_ids[:, 0] = draft_input.bonus_tokens.to(torch.int64)
    positions = prefix_lens.to(torch.int64)[:, None] + torch.arange(block, device=worker.device)[None, :]
    cache_loc = gather_slots(worker, batch, prefix_lens, block)
    embed = unwrap_lora_layer(_resolve_dflash_embedding_module(worker.draft_model,
                                                               worker.target_worker.model_runner.model))
    if worker._full_embed_gpu is not None:
        embeds = torch.nn.functional.embedding(block_ids, worker._full_embed_gpu)
    else:
        embeds = embed(block_ids)
    if worker._noise_embed_scale != 1.0:
        embeds = embeds * worker._noise_embed_scale
    embeds = embeds.to(worker._draft_dtype)
    seq_lens_cpu = rnd.prefix_cpu + block
    plan = worker.target_worker.model_runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=seq_lens_cpu,
        write_virtual=cache_loc.reshape(-1), read_extent=block,
    )
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.reshape(-1),
        req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc.reshape(-1),
        seq_lens_sum=rnd.prefix_sum + bs * block, seq_lens_cpu=seq_lens_cpu, positions=positions.reshape(-1),
        input_embeds=embeds.reshape(-1, embeds.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=worker._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL,
        global_num_token_non_padded_cpu=bs * block, can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
    )
    plan.bind(forward_batch, worker.draft_model_runner.kv_index_translator)
    rnd.keep_alive.append(forward_batch)
    with torch.inference_mode(), draft_tp_context(worker.draft_parallel_layout):
        out = worker.draft_model_runner.forward(forward_batch)
    hidden = out.logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("KDTREE: the DFlash draft model returned no hidden states")
    return hidden.view(bs, block, -1)

def feed_drafter(worker, rnd: Round, accepted_hidden, kv_plan, accept_lens, logits_output) -> None:
    """Step 7: the drafter's features, the accepted rows' target hidden states, written into the draft KV at
    chain positions P..P+tau-1."""
    commit_width = accepted_hidden.shape[1]
    chain_positions = rnd.prefix_lens[:, None] + torch.arange(commit_width, device=worker.device)[None, :]
    draft_slots = worker._draft_write_ids(kv_plan).view(rnd.bs, rnd.width)[:, :commit_width]
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=accepted_hidden.reshape(-1, accepted_hidden.shape[-1]),
        cache_loc=draft_slots.reshape(-1).contiguous(), cache_loc_2d=draft_slots.contiguous(),
        positions=chain_positions.reshape(-1), commit_lens=accept_lens.to(torch.int32),
    )
    logits_output.hidden_states = None
    rnd.marks.mark("features")
