"""Capture and warm up the target's KDTREE verify with the tree mask, not DFLASH's chain.

SGLang symbols wrapped (``HookType.AROUND``, SGLang 0.5.23):

* ``sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info``: the
  verify ``SpecInput`` a CUDA graph is captured with. KDTREE reports ``is_dflash_family()`` (to get the
  DFlash drafter machinery), so the target graph would be captured as a DFLASH chain: ``custom_mask=None``
  for flashinfer / fa3 / triton, and a graph captured without a mask either raises when replayed with one
  (flashinfer) or silently ignores it (a chain verify of a tree: wrong tokens).
* ``sglang.srt.speculative.spec_info.create_dummy_verify_input``: the dummy verify input of warmup /
  autotune runs, with the same DFLASH ``custom_mask=None`` default (``_propagate_patch`` also fixes
  ``base_runner``'s ``from ... import`` binding).

Under KDTREE, for the *target* runner, both return a ``KDTreeVerifyInput`` of width
``speculative_num_draft_tokens`` (N = budget + 1) with the runner's ``custom_mask`` buffer and ``topk=2``
(tree mode), the way SGLang does for EAGLE / NGRAM. The draft runner keeps DFLASH's block input (its
block is bidirectional and needs no mask). Other algorithms are untouched.

* ``sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch``: stages a
  batch into the captured graph's static buffers before each replay. The captured verify input also carries
  ``ancestor_bits``, a view of one static ``int32`` buffer per target runner (``max_bs * N * ceil(N/32)``
  words, allocated before capture), so the fused MLA kernel (``sglang_kdtree/patches/mla_tree_verify.py``) is recorded
  in the graph instead of SGLang's path; after SGLang's own staging, the hook copies the round's ancestor rows
  into that buffer. Rows of padded requests keep stale bits: their slots and lengths are SGLang's padding,
  and their outputs are discarded.
"""

from __future__ import annotations

from sglang_kdtree import state

GRAPH_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
DUMMY_TARGET = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
LOAD_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch"
TARGETS = (GRAPH_TARGET, DUMMY_TARGET, LOAD_TARGET)

#: attribute of a target graph runner holding its static ancestor-bits buffer
_STATIC_BITS = "_kdtree_ancestor_bits"


def _is_kdtree(spec_algorithm) -> bool:
    return state.is_kdtree(spec_algorithm)


def tree_verify_input(custom_mask, width: int, ancestor_bits=None):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_kdtree.round.verify_input import KDTreeVerifyInput

    spec_info = KDTreeVerifyInput(draft_token=None, positions=None, draft_token_num=int(width), topk=2,
                                  custom_mask=custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL)
    spec_info.ancestor_bits = ancestor_bits
    return spec_info


def _words(width: int) -> int:
    return (int(width) + 31) // 32


def static_ancestor_bits(graph_runner, bs: int):
    """``[bs, N, ceil(N/32)]`` view of the runner's static ancestor-bits buffer (created on first use, before
    any graph is captured: ``get_spec_info`` runs while a batch size's inputs are prepared)."""
    import torch

    width = int(graph_runner.captured_req_width)
    words = _words(width)
    buf = getattr(graph_runner, _STATIC_BITS, None)
    if buf is None:
        device = graph_runner.buffers.custom_mask.device
        buf = torch.zeros(int(graph_runner.max_bs) * width * words, dtype=torch.int32, device=device)
        setattr(graph_runner, _STATIC_BITS, buf)
        if device.type == "cuda":
            # compile the kernel and create its launch counter now: neither may happen inside a capture
            from sglang_kdtree.gpu import mla_attention

            mla_attention.prepare(device)
    return buf[: bs * width * words].view(bs, width, words)


def get_spec_info(original, self, num_tokens, *args, **kwargs):
    runner = self.model_runner
    if not _is_kdtree(runner.spec_algorithm) or runner.is_draft_worker:
        return original(self, num_tokens, *args, **kwargs)
    width = int(self.captured_req_width)
    bits = static_ancestor_bits(self, int(num_tokens) // width)
    return tree_verify_input(self.buffers.custom_mask, width, ancestor_bits=bits)


def load_batch(original, self, forward_batch, *args, **kwargs):
    result = original(self, forward_batch, *args, **kwargs)
    buf = getattr(self, _STATIC_BITS, None)
    bits = getattr(getattr(forward_batch, "spec_info", None), "ancestor_bits", None)
    if buf is not None and bits is not None and bits.data_ptr() != buf.data_ptr():
        flat = bits.reshape(-1)
        if flat.numel() > buf.numel():
            raise RuntimeError(f"KDTREE: {flat.numel()} ancestor words exceed the graph's static buffer "
                               f"({buf.numel()}); the batch should not have been routed to this graph")
        buf[: flat.numel()].copy_(flat)
    return result


def create_dummy_verify_input(original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker,
                              *args, **kwargs):
    if not _is_kdtree(spec_algorithm) or is_draft_worker:
        return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)
    from sglang.srt.runtime_context import get_spec

    return tree_verify_input(custom_mask, get_spec().speculative_num_draft_tokens)


def register() -> None:
    """Register the three AROUND hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GRAPH_TARGET, get_spec_info, HookType.AROUND)
    HookRegistry.register(DUMMY_TARGET, create_dummy_verify_input, HookType.AROUND)
    HookRegistry.register(LOAD_TARGET, load_batch, HookType.AROUND)
