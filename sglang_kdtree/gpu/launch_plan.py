"""Every launch configuration the launchers pick for Kimi K2.6's shapes, and whether each fits an architecture,
without a GPU: ``doctor --arch`` and the CI resource test (``tests/test_kernel_resources.py``) read it.

A configuration is a kernel (source, NVRTC options, function) with the threads per block and the dynamic shared
memory its launcher asks for; ``kimi_launches(limits)`` lists them from the launchers' own choices (``SHAPES`` and
``choose_kernel`` of the MLA verify, ``tree_launches`` and ``largest_budget`` of the tree, ``hist_kernel_names`` of
the top-K, the accept and commit launchers' block sizes, the MoE glue's) over Kimi K2.6's shapes at TP 8: batch
1-64, every budget the server accepts (those past ``largest_budget`` are refused at startup, so not launched), drafter
blocks up to 32 (31 draft depths), a 20,480-token vocabulary shard and the full 163,840, 384 experts. Contexts only
change grids. ``check(arch)`` compiles each kernel for ``arch`` with NVRTC (``gpu.cubin``) and compares registers x
threads and static + dynamic shared memory with the architecture's limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kdtree.gpu import limits, runtime

__all__ = ["Launch", "kimi_launches", "check", "KIMI_VOCAB", "KIMI_TP"]

KIMI_VOCAB, KIMI_TP, KIMI_EXPERTS = 163_840, 8, 384
KIMI_BATCHES = tuple(range(1, 65))
MAX_DRAFT_DEPTH = 31  # drafter blocks up to 32


@dataclass(frozen=True)
class Launch:
    """One launch configuration: ``step`` of the round, the kernel's ``source`` under ``sglang_kdtree/kernels/``, its
    NVRTC ``options`` and ``function``, and what the launcher asks for."""

    step: str
    source: str
    function: str
    threads: int
    dynamic_smem: int = 0
    options: tuple[str, ...] = ()


def _mla(lim: limits.DeviceLimits) -> list[Launch]:
    """The kernel ``auto`` picks and every other one ``$SGLANG_KDTREE_MLA_KERNEL`` may name on this GPU."""
    from sglang_kdtree.gpu import mla_attention as mla

    out = []
    for kernel in mla.KERNELS:
        try:
            mla.choose_kernel(kernel, lim)
        except ValueError:  # refused at startup on this GPU: never launched
            continue
        shape = mla.SHAPES[kernel]
        out += [Launch("mla_verify", shape.source, shape.entry + index, shape.threads, shape.smem_bytes)
                for index in ("i64", "i32")]
    out.append(Launch("mla_verify", mla.MERGE_SOURCE, "mla_tree_verify_merge", 128))  # the split-K merge
    return out


def _tree(lim: limits.DeviceLimits, static_smem) -> list[Launch]:
    from sglang_kdtree.gpu import tree

    largest: dict[str, int] = {}  # each tree kernel's largest dynamic shared memory over the budgets that fit
    for depth in range(1, MAX_DRAFT_DEPTH + 1):
        top = tree.largest_budget(depth, lim, static_smem)
        for budget in {min(b, top) for b in (64, 128, 256, top)}:
            for name, smem in tree.tree_launches(budget, depth):
                largest[name] = max(largest.get(name, 0), smem)
    return [Launch("tree", "best_first_tree.cu", name, tree._THREADS, smem) for name, smem in sorted(largest.items())]


def _topk() -> list[Launch]:
    from sglang_kdtree.gpu import topk

    names = set()
    for vocab in (KIMI_VOCAB // KIMI_TP, KIMI_VOCAB):
        for k in (1, 64, 256, 257, 1024):
            for bf16 in (True, False):
                for aligned in (True, False):
                    for g2 in ((True, False) if bf16 and aligned else (False,)):
                        for mode in (0, 1):
                            names.update(topk.hist_kernel_names(bf16, aligned, g2, k, vocab, mode))
    out = [Launch("topk", topk._HIST_KERNEL, name, topk.HIST_THREADS) for name in sorted(names)]
    # the vocabulary-parallel merge: KIMI_TP shards of at most the budget's candidates, sorted in shared memory
    merge_smem = 8 * topk.MAX_SHARD_CANDIDATES
    out.append(Launch("topk", topk._KERNEL, "topk_merge_shards", topk.MERGE_THREADS, merge_smem))
    # SGLANG_KDTREE_TOPK_IMPL=chunk (the A/B alternative)
    out += [Launch("topk", topk._KERNEL, f"topk_chunk_{suffix}", topk.CHUNK_THREADS)
            for suffix in ("bf16_v8", "bf16_v1", "f32_v4", "f32_v1")]
    out += [Launch("topk", topk._KERNEL, name, topk.MERGE_THREADS) for name in ("topk_merge_logprobs",
                                                                                 "topk_merge_partials")]
    return out


def _accept_and_commit() -> list[Launch]:
    from sglang_kdtree.gpu import accept, compact, verify

    greedy_threads = sorted({accept._greedy_threads(bs) for bs in KIMI_BATCHES})
    out = [Launch("accept", "tree_accept.cu", "accept_ids", accept._ACCEPT_THREADS_IDS)]
    out += [Launch("accept", "tree_accept.cu", f"accept_greedy_{t}", threads)
            for t in ("bf16", "f32") for threads in greedy_threads]
    out += [Launch("accept", "tree_accept.cu", f"accept_sampled_{t}", accept._ACCEPT_THREADS_LOGITS)
            for t in ("bf16", "f32")]
    out.append(Launch("verify_inputs", verify._KERNEL, "verify_inputs", 256))
    out += [Launch("commit", "kv_compact.cu", f"commit_plan_{i}", compact._PLAN_THREADS) for i in ("i64", "i32")]
    out += [Launch("commit", "kv_compact.cu", f"compact_kv_{u}", compact._COMPACT_THREADS) for u in ("16B", "4B", "2B",
                                                                                                  "1B")]
    out += [Launch("commit", "gather_hidden.cu", f"gather_hidden_{u}", compact._GATHER_THREADS)
            for u in ("16B", "4B", "2B")]
    return out


def _moe() -> list[Launch]:
    from sglang_kdtree.moe import launch as moe

    return [Launch("moe", "moe/moe_align.cu", f"moe_align_{i}", moe._ALIGN_THREADS, 2 * KIMI_EXPERTS * 4)
            for i in ("i32", "i64")] + [
        Launch("moe", "moe/silu_and_mul.cu", "silu_and_mul_bf16", moe._ELEMENTWISE_THREADS)] + [
        Launch("moe", "moe/moe_topk_sum.cu", f"moe_topk_sum_bf16_{i}", moe._ELEMENTWISE_THREADS) for i in ("i32", "i64")]


def kimi_launches(lim: limits.DeviceLimits, static_smem=None) -> list[Launch]:
    """Every launch configuration for Kimi K2.6's shapes on a GPU with limits ``lim``. ``static_smem(name)``: a tree
    kernel's static shared memory (it bounds the budgets that fit); default: read from an NVRTC build for ``lim``."""
    if static_smem is None:
        from sglang_kdtree.gpu import tree

        static_smem = tree.static_smem_of_build(lim.arch_name)
    return _mla(lim) + _tree(lim, static_smem) + _topk() + _accept_and_commit() + _moe()


def check(arch, launches: list[Launch] | None = None) -> tuple[list[tuple[Launch, object]], list[str]]:
    """Compile every kernel of ``launches`` (default ``kimi_launches``) for ``arch`` (``"12.0"``, or a device's
    ``DeviceLimits``) and check each configuration against its limits: returns ``(launch, KernelResources)`` pairs and
    one problem line per launch that does not fit (empty when all fit)."""
    from sglang_kdtree.gpu import cubin

    lim = arch if isinstance(arch, limits.DeviceLimits) else limits.for_arch(arch)
    launches = kimi_launches(lim) if launches is None else launches
    checked, problems = [], []
    for launch in launches:
        # a kernel built for an architecture-specific target (wgmma: sm_90a) compiles for that target
        target = runtime.ARCH_SPECIFIC.get(launch.source, lim.arch_name)
        res = cubin.resources_of(launch.source, target, launch.options)
        if launch.function not in res:
            problems.append(f"{launch.source} has no kernel {launch.function} for {lim.arch_name}")
            continue
        r = res[launch.function]
        checked.append((launch, r))
        try:
            limits.check_launch(f"{launch.function} ({launch.step})", launch.threads, launch.dynamic_smem,
                                r.static_smem, lim, r.registers)
            if r.max_threads and launch.threads > r.max_threads:
                raise limits.LaunchDoesNotFit(f"kernel {launch.function} launches {launch.threads} threads, above its "
                                              f"__launch_bounds__ {r.max_threads}")
        except limits.LaunchDoesNotFit as exc:
            problems.append(str(exc))
    return checked, problems
