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
"""

from __future__ import annotations

ALGORITHM_NAME = "KDTREE"
GRAPH_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
DUMMY_TARGET = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
TARGETS = (GRAPH_TARGET, DUMMY_TARGET)


def _is_kdtree(spec_algorithm) -> bool:
    return getattr(spec_algorithm, "name", None) == ALGORITHM_NAME


def tree_verify_input(custom_mask, width: int):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_kdtree.worker import KDTreeVerifyInput

    return KDTreeVerifyInput(draft_token=None, positions=None, draft_token_num=int(width), topk=2,
                             custom_mask=custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL)


def get_spec_info(original, self, num_tokens, *args, **kwargs):
    runner = self.model_runner
    if not _is_kdtree(runner.spec_algorithm) or runner.is_draft_worker:
        return original(self, num_tokens, *args, **kwargs)
    return tree_verify_input(self.buffers.custom_mask, self.captured_req_width)


def create_dummy_verify_input(original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker,
                              *args, **kwargs):
    if not _is_kdtree(spec_algorithm) or is_draft_worker:
        return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)
    from sglang.srt.runtime_context import get_spec

    return tree_verify_input(custom_mask, get_spec().speculative_num_draft_tokens)


def register() -> None:
    """Register both AROUND hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GRAPH_TARGET, get_spec_info, HookType.AROUND)
    HookRegistry.register(DUMMY_TARGET, create_dummy_verify_input, HookType.AROUND)
