"""The KDTREE speculative algorithm as SGLang sees it: capability flags and server-args handling.

SGLang 0.5.23 resolves ``--speculative-algorithm kdtree`` to the ``KDTreeSpec`` instance registered by
``sglang_kdtree.plugin.register``. This module decides, at startup, which settings DDTree can honour:

* **Verify widths**: ``--speculative-num-draft-tokens N`` pins the verify width, ``N = B + 1`` (the root plus B
  tree nodes), ``1 <= B <= MAX_BUDGET``. Unset: the widths of ``SGLANG_KDTREE_VERIFY_WIDTHS`` (default
  ``widths.DEFAULT_WIDTHS``), chosen per round (``width_choice``); the tree is built at the largest
  (``resolve_widths``).
* **Draft block**: ``--speculative-dflash-block-size`` (optional; else the DFlash drafter's config) gives
  ``L = block_size - 1`` draft depths, ``MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE`` (2..32).
* **Attention backend** for the target's tree verify must honour a tree mask: ``fa3`` or ``triton`` (MHA and
  MLA) or ``flashinfer`` (MHA only: on an MLA model it becomes ``flashinfer_mla``) on CUDA; ``torch_native`` / ``intel_amx`` on CPU. ``flashmla``, ``trtllm_mla``,
  ``flashinfer_mla``, ``cutedsl_mla`` and ``trtllm_mha`` plan causal attention and would silently verify a
  chain: refused. ``fa3`` where SGLang's fa3 backend would assert after the weight load (an MLA target off
  compute capability 9.x, an MHA target off 8.x / 9.x): refused, judged for the GPU of ``device_limits()``.
* ``--page-size 1`` only (the tree's KV rows are compacted slot by slot).
* Overlap scheduling: see ``SUPPORTS_OVERLAP``.

Every refusal is a ``ValueError`` raised during argument resolution, naming the flag, the value and the fix; a
launch with several problems gets one ``ValueError`` listing all of them, a ``KDTREE: ...`` line each.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_kdtree.state import (DEFAULT_BUDGET, DEFAULT_VERIFY_WIDTH, MAX_BLOCK_SIZE, MAX_BUDGET, MAX_WIDTH,
                                 MIN_BLOCK_SIZE)
from sglang_kdtree.round.width_choice import POLICIES, POLICY_ENV
from sglang_kdtree.round.widths import WIDTHS_ENV, parse_widths

if TYPE_CHECKING:
    from sglang_kdtree.gpu.limits import DeviceLimits

logger = logging.getLogger(__name__)

#: Backends whose TARGET_VERIFY honours a tree mask, per device type.
TREE_MASK_BACKENDS = {
    "cuda": ("fa3", "triton", "flashinfer"),
    "cpu": ("torch_native", "intel_amx"),
}
#: Backends known to plan causal-only verify (they would verify a chain and silently lose the tree).
CAUSAL_ONLY_BACKENDS = ("flashmla", "trtllm_mla", "flashinfer_mla", "cutedsl_mla", "trtllm_mha")

#: What the plugin writes into SGLang's EAGLE fields: one drafter forward per round, and a top-k above 1, which
#: only switches fa3 / triton into tree-mask mode (a user value other than these is refused, not overridden).
KDTREE_NUM_STEPS = 1
KDTREE_EAGLE_TOPK = 2

#: (ServerArgs field, flag, the value that means "off", why KDTREE refuses any other): speculative options that
#: SGLang accepts for a DFLASH-family algorithm but the KDTREE round would silently not apply.
_UNSERVED_SPEC_FLAGS = (
    ("speculative_accept_threshold_single", "--speculative-accept-threshold-single", 1.0,
     "the tree accept samples each node exactly from the target's filtered distribution; no threshold applies"),
    ("speculative_accept_threshold_acc", "--speculative-accept-threshold-acc", 1.0,
     "the tree accept samples each node exactly from the target's filtered distribution; no threshold applies"),
    ("speculative_use_rejection_sampling", "--speculative-use-rejection-sampling", False,
     "the tree accept samples each node from the target and walks to the matching child; it has no "
     "rejection-sampling mode"),
    ("speculative_token_map", "--speculative-token-map", None,
     "the tree ranks the drafter's full-vocabulary distributions; a reduced draft vocabulary is not implemented"),
    ("speculative_draft_window_size", "--speculative-draft-window-size", None,
     "the tree round's draft block reads the whole draft KV cache, not DFLASH's compact sliding window"),
    ("speculative_draft_sink_size", "--speculative-draft-sink-size", None,
     "the tree round's draft block reads the whole draft KV cache, not DFLASH's compact sliding window"),
)
#: The same for server features KDTREE's round would silently not honour. Per-token state SGLang captures by KV slot
#: during the target's forward and returns with each response: KDTREE's commit moves the accepted tree rows' KV to
#: the committed slots and not the captured state, so a response would carry the state of the wrong tree nodes.
#: Sampling features SGLang's sampler applies and the tree accept does not.
_UNSERVED_SERVER_FLAGS = (
    ("enable_return_routed_experts", "--enable-return-routed-experts", False,
     "the routing is captured per KV slot of the verify forward, and the commit does not move it with the "
     "accepted rows"),
    ("enable_return_indexer_topk", "--enable-return-indexer-topk", False,
     "the indexer's top-k is captured per KV slot of the verify forward, and the commit does not move it with the "
     "accepted rows"),
    ("enable_watermark", "--enable-watermark", False,
     "SGLang's sampler applies the watermark; the tree accept draws each node from the target's distribution "
     "without it, so responses would carry no watermark"),
    ("enable_mixed_chunk", "--enable-mixed-chunk", False,
     "a round verifies decode requests only; SGLang's own later check refuses it for KDTREE with an assertion"),
    ("enable_strict_thinking", "--enable-strict-thinking", False,
     "SGLang enforces it with a grammar token filter in its sampler, which the tree accept does not apply (as for "
     "grammar requests)"),
)

#: Whether SGLang's overlap scheduler may run the worker: the decode round reads nothing back from the device
#: (its host lengths are SGLang's, its faults and width statistics are read one result later;
#: ``tests/test_host_syncs.py``), so overlap is on unless ``--disable-overlap-schedule`` is given.
SUPPORTS_OVERLAP = True


def _device_type(device) -> str:
    return str(device or "cuda").split(":", 1)[0]


def _is_mla_model(server_args) -> bool | None:
    """Whether the target uses MLA attention (None when the model config cannot be read at this point)."""
    from sglang.srt.arg_groups.model_override_base import use_mla_backend

    try:  # SGLang hands plugins a write-recording stand-in whose `_cfg` is the resolving view
        view = object.__getattribute__(server_args, "_cfg")
    except AttributeError:
        view = server_args
    try:
        return bool(use_mla_backend(view))
    except Exception:  # no readable config (e.g. a remote id): the attention backend decides at model load
        return None


def device_limits(arch_without_gpu=None) -> "DeviceLimits | None":
    """The GPU a launch is judged for, decided here only: with a GPU, ``gpu.limits.current()`` (the device, or the
    test-only ``KDTREE_DEVICE_PROFILE`` profile, so an H200 under ``sm_120`` is judged as an sm_120 card);
    without one, ``gpu.limits.for_arch(arch_without_gpu)`` (``doctor --arch``), else None: the checks that depend
    on the GPU are skipped (CPU servers, tests). ValueError for a profile wider than the GPU or an unknown arch."""
    from sglang_kdtree.gpu import limits
    from sglang_kdtree.gpu.runtime import gpu_available

    if gpu_available():
        # device 0, not torch's current device: asking torch would initialise CUDA in SGLang's launching process,
        # which runs no kernel (the driver's properties need no context); a box's GPUs are one kind
        return limits.current(0)
    return None if arch_without_gpu is None else limits.for_arch(arch_without_gpu)


def _fa3_problems(sa, limits: "DeviceLimits"):
    """``fa3`` where SGLang 0.5.23 refuses it: ``create_flashattention_v3_backend``
    (``srt/layers/attention/attention_registry.py``) asserts ``(major == 8 and not use_mla_backend) or major == 9``
    when the model runner builds its backends, after the whole weight load; refused here, before it."""
    major, minor = limits.arch
    if major == 9:
        return
    flags = [flag for flag, value in (("--attention-backend", sa.attention_backend),
                                      ("--decode-attention-backend", sa.decode_attention_backend),
                                      ("--prefill-attention-backend", sa.prefill_attention_backend))
             if value == "fa3"]
    if not flags:
        return
    mla = _is_mla_model(sa)
    if major == 8 and not mla:
        return  # MHA on 8.x is SGLang's to serve; an unreadable config (a remote id) is judged by SGLang at load
    where = f"compute capability {major}.{minor}" + (" with an MLA target" if mla else "")
    rule = ("SGLang's fa3 backend serves MLA on compute capability 9.x only" if mla else
            "SGLang's fa3 backend runs on compute capability 9.x, and on 8.x for MHA targets")
    for flag in flags:
        yield (f"KDTREE: {flag} fa3 is not supported on {where} ({limits.source}; {rule}, and "
               f"asserts so only after loading the weights); use {flag} triton")


def _draft_depths(sa) -> int | None:
    """``L = block_size - 1`` from ``--speculative-dflash-block-size`` or the drafter's config.json; None when neither
    can be read here (the worker reads it again, and its tree builder checks the same limit at startup)."""
    block = sa.speculative_dflash_block_size
    if block is None and sa.speculative_draft_model_path:
        try:
            from sglang_kdtree.round.worker import _read_draft_block_size

            block = _read_draft_block_size(sa)
        except Exception:  # a remote id or a drafter the worker will report on
            return None
    return None if block is None or not MIN_BLOCK_SIZE <= int(block) <= MAX_BLOCK_SIZE else int(block) - 1


def _tree_problems(sa, budget: int, limits: "DeviceLimits"):
    """A budget whose tree launches cannot fit the GPU's shared memory at the drafter's depths: refused here, before
    the weight load (``gpu.tree.check_tree_fits``, with the tree kernels' static shared memory from an NVRTC build
    for the GPU's architecture: no CUDA context in the launching process)."""
    depth = _draft_depths(sa)
    if depth is None or depth < 1:
        return
    from sglang_kdtree.gpu import tree
    from sglang_kdtree.gpu.limits import LaunchDoesNotFit

    try:
        tree.check_tree_fits(budget, depth, limits, tree.static_smem_of_build(limits.arch_name))
    except LaunchDoesNotFit as exc:
        yield f"KDTREE: verify width {budget + 1} (budget {budget}) at {depth} draft depths: {exc}"
    except RuntimeError as exc:  # NVRTC missing or failing here: the worker's tree builder checks at startup
        logger.warning("KDTREE: the tree budget's fit was not checked before loading (%s)", exc)


#: set when the plugin itself wrote ``SGLANG_KDTREE_VERIFY_WIDTHS`` (so a later resolution in the same process may
#: replace it; a user's own value is only ever checked against the flag)
_WRITTEN_ENV = "SGLANG_KDTREE_VERIFY_WIDTHS_RESOLVED"


def resolve_widths(flag_value) -> int:
    """The server's verify widths from ``--speculative-num-draft-tokens`` (one pinned width) or
    ``SGLANG_KDTREE_VERIFY_WIDTHS`` (tiers chosen per round; ``widths.DEFAULT_WIDTHS`` when neither is given),
    written back to that variable so every scheduler process reads the same tiers; returns the largest width.
    ValueError naming the flag or variable, the value and the fix."""
    text = os.environ.get(WIDTHS_ENV)
    if os.environ.get(_WRITTEN_ENV) == "1" and flag_value is not None and text and \
            max(parse_widths(text)) != int(flag_value):
        text = None  # written by an earlier resolution in this process (another engine), not by the user
    policy = os.environ.get(POLICY_ENV)
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"KDTREE: {POLICY_ENV}={policy!r} is not one of {', '.join(POLICIES)}; unset it for auto")
    if flag_value is None:
        tiers = parse_widths(text)
        os.environ[WIDTHS_ENV], os.environ[_WRITTEN_ENV] = ",".join(map(str, tiers)), "1"
        logger.info("KDTREE: verify widths %s chosen per round (--speculative-num-draft-tokens N pins one)",
                    os.environ[WIDTHS_ENV])
        return max(tiers)
    try:
        width = int(flag_value)
    except (TypeError, ValueError):
        raise ValueError(
            f"KDTREE: --speculative-num-draft-tokens must be an integer (node budget + 1), got {flag_value!r}"
        ) from None
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(
            f"KDTREE: --speculative-num-draft-tokens {width} is out of range: it is the verify width N = budget + 1 "
            f"and must lie in [2, {MAX_WIDTH}] (node budget 1..{MAX_BUDGET}); e.g. "
            f"--speculative-num-draft-tokens {DEFAULT_VERIFY_WIDTH} for a budget of {DEFAULT_BUDGET}, or leave it "
            f"out to let the plugin choose among {WIDTHS_ENV} per round"
        )
    if text is not None and text.strip() and max(parse_widths(text)) != width:
        raise ValueError(
            f"KDTREE: --speculative-num-draft-tokens {width} pins one verify width, and {WIDTHS_ENV}={text!r} asks "
            f"for tiers up to {max(parse_widths(text))}; use one of them (drop the flag to choose among the tiers, "
            f"or unset {WIDTHS_ENV} to pin the width)"
        )
    if text is None or not text.strip():
        os.environ[WIDTHS_ENV], os.environ[_WRITTEN_ENV] = str(width), "1"
    return width


def launch_problems(server_args, resolved: dict, limits: "DeviceLimits | None" = None):
    """Every setting of ``server_args`` DDTree cannot honour, one message each (naming the flag, the value and the
    fix), in the order a reader fixes them; ``resolved["width"]`` gets the largest verify width when the widths
    resolve (``resolve_widths``). ``limits``: the GPU the launch is judged for (``device_limits``); None skips
    the checks that depend on it."""
    sa = server_args
    try:
        resolved["width"] = resolve_widths(sa.speculative_num_draft_tokens)
    except ValueError as exc:
        yield str(exc)
    tiers = os.environ.get(WIDTHS_ENV, "")
    if "," in tiers:
        # each extra width captures its own verify graph runner; these features keep one shared per-width state
        for field, flag in (("enable_lora", "--enable-lora"), ("enable_two_batch_overlap", "--enable-two-batch-overlap"),
                            ("enable_pdmux", "--enable-pdmux")):
            if getattr(sa, field, False):
                yield (
                    f"KDTREE: {flag} is not supported with several verify widths ({WIDTHS_ENV}={tiers}: its state is "
                    f"sized for one width); pin one width with --speculative-num-draft-tokens, or drop {flag}"
                )
    block = sa.speculative_dflash_block_size
    if block is not None and not MIN_BLOCK_SIZE <= int(block) <= MAX_BLOCK_SIZE:
        yield (
            f"KDTREE: --speculative-dflash-block-size {block} is out of range [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}] "
            f"(draft depths L = block_size - 1 <= {MAX_BLOCK_SIZE - 1}); omit it to use the drafter's own block size"
        )
    if sa.speculative_draft_model_path is None:
        yield (
            "KDTREE: --speculative-draft-model-path is required (the DFlash block-diffusion drafter checkpoint)"
        )

    device = _device_type(sa.device)
    allowed = TREE_MASK_BACKENDS.get(device)
    if allowed is None:
        yield (f"KDTREE: --device {sa.device} is not supported; use cuda (or cpu for tests)")
    for flag, value in (
        ("--attention-backend", sa.attention_backend),
        ("--decode-attention-backend", sa.decode_attention_backend),
        ("--prefill-attention-backend", sa.prefill_attention_backend),
    ):
        if value is None or allowed is None or value in allowed:
            continue
        why = (
            "plans causal attention for target verify and ignores the tree mask"
            if value in CAUSAL_ONLY_BACKENDS
            else "is not known to honour a tree mask in target verify"
        )
        yield (
            f"KDTREE: {flag} {value} {why}; use {flag} {allowed[0]} "
            f"(supported on {device}: {', '.join(allowed)})"
        )
    if "flashinfer" in {sa.attention_backend, sa.decode_attention_backend} and _is_mla_model(sa):
        yield (
            "KDTREE: --attention-backend flashinfer on an MLA model (DeepSeek-V3 / Kimi K2) runs flashinfer_mla, "
            "which plans causal attention for target verify and ignores the tree mask; use --attention-backend "
            "fa3 (Hopper) or triton"
        )
    if limits is not None and device == "cuda":
        yield from _fa3_problems(sa, limits)
        if "width" in resolved:
            yield from _tree_problems(sa, resolved["width"] - 1, limits)
    if sa.page_size is not None and int(sa.page_size) != 1:
        yield (
            f"KDTREE: --page-size {sa.page_size} is not supported (tree KV rows are compacted slot by slot); "
            "use --page-size 1"
        )
    if int(sa.pp_size) != 1:
        yield (f"KDTREE: --pp-size {sa.pp_size} is not supported; use --pp-size 1")
    if getattr(sa, "dp_size", 1) not in (None, 1) and getattr(sa, "enable_dp_attention", False):
        yield ("KDTREE: DP attention is not supported; drop --enable-dp-attention")

    mode = getattr(sa, "return_hidden_states_mode", None)
    if getattr(sa, "enable_return_hidden_states", False) or mode is not None:
        # Without this, a request with return_hidden_states gets an empty list from the KDTREE server (the plain
        # server returns one row per token): the tree round does not collect the committed tokens' hidden states.
        yield (
            f"KDTREE: returning hidden states is not supported (--enable-return-hidden-states / "
            f"--return-hidden-states-mode {mode or 'full'}): the tree round does not collect them, so requests with "
            "return_hidden_states would get none; drop the flag"
        )
    for field, flag, off, why in _UNSERVED_SPEC_FLAGS + _UNSERVED_SERVER_FLAGS:
        value = getattr(sa, field, off)
        if value is not None and value != off:
            yield (f"KDTREE: {flag} {value} is not supported ({why}); drop {flag}")
    # EAGLE's knobs: the plugin sets both below; a different value asked for would be silently overridden.
    steps = sa.speculative_num_steps
    if steps is not None and int(steps) != KDTREE_NUM_STEPS:
        yield (
            f"KDTREE: --speculative-num-steps {steps} does not apply (DDTree runs the drafter once per round; the "
            "tree is at most the drafter's block size - 1 deep, --speculative-dflash-block-size); drop it"
        )
    topk = sa.speculative_eagle_topk
    if topk is not None and int(topk) != KDTREE_EAGLE_TOPK:
        yield (
            f"KDTREE: --speculative-eagle-topk {topk} does not apply (DDTree's per-depth top-K is the node budget, "
            "--speculative-num-draft-tokens - 1); drop it"
        )



def validate_server_args(server_args, limits: "DeviceLimits | None" = None) -> None:
    """Refuse settings DDTree cannot honour (runs during SGLang's argument resolution, before any model load): one
    ``ValueError`` listing every problem of the launch (``launch_problems``), one ``KDTREE: ...`` line each.
    ``limits``: the GPU the launch is judged for (``doctor --arch`` passes ``device_limits(arch)``); None: this
    machine's, ``device_limits()`` (none on a CPU machine or a CPU server).

    Writes the verify width when unset and the EAGLE-style fields SGLang's tree-verify machinery reads:
    ``speculative_num_steps = 1`` and ``speculative_eagle_topk = 2`` (a value > 1 switches fa3 / triton into
    tree-mask mode; DDTree's own top-K is ``min(B, V)`` and does not use this field). A user value for either
    other than those is refused: it would have no effect.
    """
    resolved: dict = {}
    problems = []
    if limits is None and _device_type(server_args.device) == "cuda":
        try:
            limits = device_limits()
        except ValueError as exc:  # e.g. KDTREE_DEVICE_PROFILE wider than this GPU: the message names the fix
            problems.append(f"KDTREE: {exc}")
    problems += launch_problems(server_args, resolved, limits)
    if problems:
        raise ValueError("\n".join(problems))
    server_args.speculative_num_draft_tokens = resolved["width"]
    server_args.speculative_num_steps = KDTREE_NUM_STEPS
    server_args.speculative_eagle_topk = KDTREE_EAGLE_TOPK


class KDTreeSpec(CustomSpecAlgo):
    """``CustomSpecAlgo`` for DDTree on the DFlash drafter.

    Reports itself as DFLASH-family so SGLang builds the DFlash drafter infrastructure (target aux-hidden
    capture, draft KV pool, draft CUDA graph with ``input_embeds``), and adds the four methods SGLang 0.5.23's
    ``CustomSpecAlgo`` lacks but its scheduler calls unconditionally.
    """

    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True, needs_confidence_relay: bool = False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def resolve_max_speculative_num_draft_tokens(self, server_args):
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        width = cfg.speculative_num_draft_tokens or max(parse_widths(os.environ.get(WIDTHS_ENV)))
        return max(int(width), int(cfg.speculative_dflash_block_size or 0))
