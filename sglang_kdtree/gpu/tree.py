"""GPU exact best-first DDTree (``sglang_kdtree/kernels/best_first_tree.cu``); twin of ``reference.build_trees``, plus
``TreeBuilder``, which owns every workspace and output buffer of the per-round path
"draft logits -> top-K + lse -> tree -> verify inputs" for the largest batch and budget, so a round
allocates nothing, never syncs the host and can be captured in a CUDA graph.

Error reporting: value errors that need the data (NaN / +inf / unsorted log-probs, negative ids, bad
logits) set bits of an ``int32 [1]`` flag tensor (``sglang_kdtree.gpu.topk.TOPK_ERRORS``); read it at the
next natural sync with ``raise_on_flag`` or pass ``check=True`` to sync and raise at once.
"""

from __future__ import annotations

import numpy as np

from sglang_kdtree.contract import Trees
from sglang_kdtree.gpu import limits, runtime
from sglang_kdtree.gpu.topk import (
    TopKWorkspace,
    _check_k,
    _ptr,
    _require_cuda,
    new_error_flag,
    raise_on_flag,
    topk_logprobs,
)
from sglang_kdtree.state import MAX_BUDGET

__all__ = ["build_trees", "build_trees_verify", "TreeBuilder", "MAX_DEPTH", "tree_launches", "check_tree_fits",
           "largest_budget"]

MAX_DEPTH = 31
_KERNEL = "best_first_tree.cu"
_THREADS = 128  # every tree kernel: warp 0 builds the tree, warps 1.. validate the input meanwhile
# Budgets up to LIST_MAX_BUDGET take the sorted-list kernels (build_trees_list1 / 2 / 4: candidates in
# warp 0's registers, exact for budget <= 64 * J); larger budgets the shared-memory slot kernel
# (build_trees_kernel). Both are exact; tests set this to 0 to run the slot kernel at every budget.
LIST_MAX_BUDGET = 256
# build_trees_verify fuses the verify inputs into the list kernels' launch (build_trees_verify_list1/2/4); False
# (benchmarks/round_parts.py --ab, tests) takes the two launches it replaces.
FUSE_VERIFY = True


_STATIC_SMEM: dict[str, int] = {}  # each tree kernel's static shared memory, read from the driver once
_CHECKED: dict[tuple[str, int], int] = {}  # (kernel, dynamic shared memory) launches checked: the total they ask for


def _tree_kernel_name(budget: int) -> str:
    if LIST_MAX_BUDGET <= 0 or budget > min(256, LIST_MAX_BUDGET):
        return "build_trees_kernel"
    return "build_trees_list1" if budget <= 64 else "build_trees_list2" if budget <= 128 else "build_trees_list4"


def tree_smem_bytes(name: str, depth: int, ks: int) -> int:
    """Dynamic shared memory of one tree kernel's block: the slot kernel stages ``[L, KS]`` floats; the list kernels
    ``L`` rows of ``KS + 1`` doubles plus one (each row's column ``KS`` and the last entry hold -inf)."""
    if name == "build_trees_kernel":
        return max(depth, 1) * ks * 4
    return (depth * (ks + 1) + 1) * 8


def tree_launches(budget: int, depth: int) -> list[tuple[str, int]]:
    """``(kernel, dynamic shared memory)`` of each tree launch a round at ``budget`` with ``depth`` draft depths may
    make (top-K keeps ``K = budget`` candidates per depth, so a block stages ``depth x budget`` of them): the fused
    build-and-verify kernel and the build-only one for the list budgets, the slot kernel beyond."""
    name = _tree_kernel_name(max(budget, 0))
    ks = max(budget, 1)
    smem = tree_smem_bytes(name, depth, ks)
    if name == "build_trees_kernel":
        return [(name, smem)]
    return [(name, smem), (name.replace("build_trees_list", "build_trees_verify_list"), smem)]


def _static_smem_here(name: str) -> int:
    """A tree kernel's static shared memory on this GPU, from the driver (once per kernel)."""
    if name not in _STATIC_SMEM:
        _STATIC_SMEM[name] = runtime.load_module(_KERNEL).get_function(name).shared_size_bytes
    return _STATIC_SMEM[name]


def static_smem_of_build(arch_name: str):
    """``static_smem(name)`` for ``largest_budget`` / ``check_tree_fits`` without a GPU (or without a CUDA context):
    each tree kernel's static shared memory in an NVRTC build for ``arch_name`` (``gpu.cubin``)."""
    from sglang_kdtree.gpu import cubin

    resources = cubin.resources_of(_KERNEL, arch_name)
    return lambda name: resources[name].static_smem


def _fits(budget: int, depth: int, lim: limits.DeviceLimits, static_smem) -> bool:
    return all(smem + static_smem(name) <= lim.smem_per_block for name, smem in tree_launches(budget, depth))


def largest_budget(depth: int, lim: limits.DeviceLimits, static_smem=_static_smem_here) -> int:
    """The largest budget (<= ``MAX_BUDGET``) whose tree launches fit ``lim`` at ``depth``; ``static_smem(name)``
    gives each kernel's static shared memory (default: the running GPU's; ``doctor --arch`` reads a cubin's)."""
    budget = MAX_BUDGET
    while budget > 1 and not _fits(budget, depth, lim, static_smem):
        budget -= 1
    return budget


def check_tree_fits(budget: int, depth: int, lim: limits.DeviceLimits, static_smem=_static_smem_here) -> None:
    """Raise ``limits.LaunchDoesNotFit`` naming the limit and the largest budget that fits, unless every tree launch
    of a round at ``budget`` and ``depth`` fits ``lim``: the server calls it when it sizes its round, so a budget
    the GPU cannot build is refused at startup, never in a round."""
    if _fits(budget, depth, lim, static_smem):
        return
    largest = largest_budget(depth, lim, static_smem)
    fix = (f"the largest budget that fits at {depth} draft depths is {largest}: verify at most {largest + 1} rows "
           f"(SGLANG_KDTREE_VERIFY_WIDTHS / --speculative-num-draft-tokens), or draft fewer depths "
           f"(--speculative-dflash-block-size)")
    for name, smem in tree_launches(budget, depth):
        limits.check_launch(f"{name} (budget {budget}, {depth} draft depths)", _THREADS, smem, static_smem(name), lim,
                            fix=fix)


def _check_budget(budget) -> int:
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int, got {type(budget).__name__} {budget!r}")
    budget = int(budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"budget = {budget} exceeds MAX_BUDGET {MAX_BUDGET}")
    return budget


def _alloc_tree(bs, width, device):
    import torch

    return Trees(
        tokens=torch.empty((bs, width), dtype=torch.int64, device=device),
        depths=torch.empty((bs, width), dtype=torch.int64, device=device),
        parents=torch.empty((bs, width), dtype=torch.int64, device=device),
        num_nodes=torch.empty(bs, dtype=torch.int64, device=device),
        ranks=torch.empty((bs, width), dtype=torch.int64, device=device),
        scores=torch.empty((bs, width), dtype=torch.float64, device=device),
    )


def _slice_tree(t: Trees, bs, width) -> Trees:
    """Views of a preallocated [max_bs, max_width] batch as a contiguous [bs, width] batch."""

    def v(x):
        return x.view(-1)[: bs * width].view(bs, width)

    return Trees(tokens=v(t.tokens), depths=v(t.depths), parents=v(t.parents), num_nodes=t.num_nodes[:bs],
                 ranks=v(t.ranks), scores=v(t.scores))


def build_trees(logprobs, token_ids, budget: int, root_tokens, *, out: Trees | None = None,
                error_flag=None, check: bool = False) -> Trees:
    """The exact best-first tree for every request, in one launch; twin of ``reference.build_trees``.

    Args:
        logprobs: ``[bs, L, K]`` float32 CUDA, each row sorted descending (``topk_logprobs``), L <= 31.
        token_ids: ``[bs, L, K]`` int64 CUDA.
        budget: node budget B (same for the batch), ``B <= MAX_BUDGET``; ``B <= 0`` or ``L == 0``: root only.
        root_tokens: ``[bs]`` int64 CUDA, each request's bonus token (node 0).
        out: a preallocated ``contract.Trees`` whose buffers hold at least ``bs * (B+1)`` rows (written as
            contiguous ``[bs, B+1]`` views); else one is allocated.
        error_flag: ``int32 [1]`` CUDA flag (``gpu.errors``: ERR_LOGPROB_NAN, ERR_LOGPROB_POSINF, ERR_UNSORTED,
            ERR_NEGATIVE_ID).
        check: sync and raise the reference's ``ValueError`` if the flag is set.

    Returns:
        ``contract.Trees`` of width ``N = max(B, 0) + 1`` with ``scores`` (bit-identical to
        ``reference.build_tree``) and ``ranks``; nodes in pop order (score desc, then rank tuple).
    """
    t = _TreeLaunch(logprobs, token_ids, budget, root_tokens, out, error_flag)
    if t.bs:
        t.launch(t.name, (t.bs,), ())
    if check:
        raise_on_flag(t.error_flag, "build_trees")
    return t.out


def build_trees_verify(logprobs, token_ids, budget: int, root_tokens, seq_lens, *, seq_lens_sum: int | None = None,
                       out: Trees | None = None, out_verify=None, fill_prefix: bool = True, error_flag=None,
                       check: bool = False):
    """``build_trees`` then ``gpu.verify.verify_inputs`` of its trees, ``(contract.Trees, contract.VerifyInputs)``: in one
    launch for budgets the sorted-list kernels take (``build_trees_verify_list1/2/4``: each request's block builds
    the tree, then derives the verify inputs from its nodes in parallel; further blocks fill the request's
    FULL_MASK prefix columns meanwhile), else (or with ``FUSE_VERIFY`` off) the two launches. Arguments as the two
    functions' (``out_verify``: ``verify_inputs``' ``out``); the same outputs, bit for bit."""
    from sglang_kdtree.gpu.verify import verify_inputs, verify_outputs

    t = _TreeLaunch(logprobs, token_ids, budget, root_tokens, out, error_flag)
    if t.name == "build_trees_kernel" or not FUSE_VERIFY:  # budgets past the list kernels: the two launches
        if t.bs:
            t.launch(t.name, (t.bs,), ())
        res = verify_inputs(t.out, seq_lens, seq_lens_sum=seq_lens_sum, out=out_verify, fill_prefix=fill_prefix,
                            error_flag=t.error_flag)
        if check:
            raise_on_flag(t.error_flag, "build_trees_verify")
        return t.out, res
    res = verify_outputs(seq_lens, t.bs, t.width, seq_lens_sum, out_verify, t.dev)
    if t.bs:
        sl = seq_lens.contiguous()
        fill = -(-t.width // (_THREADS // 32)) if fill_prefix else 0  # one FULL_MASK row per warp of the fill blocks
        t.launch(t.name.replace("build_trees_list", "build_trees_verify_list"), (t.bs, 1 + fill),
                 (_ptr(sl), _ptr(res.input_ids), _ptr(res.positions),
                  _ptr(res.ancestor_bits), _ptr(res.retrieve_index), _ptr(res.retrieve_next_token),
                  _ptr(res.retrieve_next_sibling), _ptr(res.full_mask)))
    if check:
        raise_on_flag(t.error_flag, "build_trees_verify")
    return t.out, res


class _TreeLaunch:
    """The checked arguments of one tree launch (``build_trees``' checks and output views) and ``launch``."""

    def __init__(self, logprobs, token_ids, budget, root_tokens, out, error_flag):
        import torch

        budget = _check_budget(budget)
        for name, t in (("logprobs", logprobs), ("token_ids", token_ids), ("root_tokens", root_tokens)):
            _require_cuda(name, t)
        if not logprobs.dtype.is_floating_point:
            raise TypeError(f"logprobs must be a floating-point array, got dtype {logprobs.dtype}")
        if logprobs.dtype != torch.float32:
            raise TypeError(f"logprobs must be float32 (topk_logprobs' output), got {logprobs.dtype}; cast with "
                            ".float()")
        if token_ids.dtype != torch.int64:
            raise TypeError(f"token_ids must be int64, got dtype {token_ids.dtype}")
        if root_tokens.dtype != torch.int64:
            raise TypeError(f"root_tokens must be an int64 array, got dtype {root_tokens.dtype}")
        if logprobs.ndim != 3 or root_tokens.shape != logprobs.shape[:1] or token_ids.shape != logprobs.shape:
            raise ValueError(
                f"expected logprobs [bs, L, K], token_ids of the same shape and root_tokens [bs], got "
                f"{tuple(logprobs.shape)}, {tuple(token_ids.shape)} and {tuple(root_tokens.shape)}"
            )
        bs, depth, k = logprobs.shape
        if depth > MAX_DEPTH:
            raise ValueError(f"L = {depth} draft depths exceed the GPU limit {MAX_DEPTH}")
        if depth > 0 and k == 0:
            raise ValueError(f"logprobs has L={depth} depths but K=0 candidates")
        if k > MAX_BUDGET:
            raise ValueError(f"K = {k} candidates per depth exceed {MAX_BUDGET}; take top-K with K <= budget")
        width = max(budget, 0) + 1
        dev = logprobs.device
        if out is None:
            out = _alloc_tree(bs, width, dev)
        else:
            if out.tokens.numel() < bs * width or out.num_nodes.numel() < bs:
                raise ValueError(f"out holds {out.tokens.numel()} rows, fewer than bs*(budget+1) = {bs * width}")
            out = _slice_tree(out, bs, width)
        self.error_flag = new_error_flag(dev) if error_flag is None else error_flag
        self.bs, self.depth, self.k, self.budget, self.width, self.dev, self.out = bs, depth, k, budget, width, dev, out
        self.name = _tree_kernel_name(max(budget, 0))
        if bs:
            self.lp, self.ids, self.roots = logprobs.contiguous(), token_ids.contiguous(), root_tokens.contiguous()

    def launch(self, name: str, grid: tuple, extra: tuple) -> None:
        """Launches tree kernel ``name`` (a ``self.name`` kind) on ``grid`` with its arguments, then ``extra``."""
        ks = min(self.k, self.width) if self.k else 1  # ranks >= budget + 1 can never be pushed
        smem = tree_smem_bytes(self.name, self.depth, ks)
        fn = runtime.load_module(_KERNEL).get_function(name)
        if (name, smem) not in _CHECKED:  # once per kernel and size: the check reads the device's limits
            static_smem = _static_smem_here(name)
            limits.check_launch(f"{name} ({self.depth} draft depths x {ks} candidates)", _THREADS, smem, static_smem,
                                limits.current(self.dev.index), fix="verify fewer rows or draft fewer depths")
            if smem + static_smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:  # the opt-in above 48 KiB
                fn.max_dynamic_shared_size_bytes = smem
            _CHECKED[(name, smem)] = smem + static_smem
        limits.record_launch("tree", name, _CHECKED[(name, smem)])
        out = self.out
        # the list kernels wait for the previous kernel at entry (pdl_wait): a dependent launch, whose launch overlaps
        # the top-K select's tail
        runtime.launch(fn, grid, (_THREADS,),
                       (_ptr(self.lp), _ptr(self.ids), _ptr(self.roots), np.int32(self.depth), np.int32(self.k),
                        np.int32(max(self.budget, 0)), np.int32(ks), _ptr(out.tokens), _ptr(out.depths),
                        _ptr(out.parents), _ptr(out.ranks), _ptr(out.scores), _ptr(out.num_nodes),
                        _ptr(self.error_flag)) + extra,
                       shared_mem=smem, pdl=name != "build_trees_kernel")


class TreeBuilder:
    """Owns the workspaces of one DDTree round for up to ``max_batch`` requests, budgets up to
    ``max_budget``, ``depth`` draft depths and a ``vocab``-wide drafter, and a verify FULL_MASK buffer of
    ``max_mask_bytes`` bytes. Every method launches on torch's current stream, allocates nothing and never
    syncs, so a round can be captured in a ``torch.cuda.CUDAGraph`` (warm up once eagerly first: the first
    call compiles the kernels).

    ``error_flag`` (``int32 [1]``) accumulates the error bits of every launch (``TOPK_ERRORS``); call
    ``check()`` at a natural sync point (raises ``ValueError``) and ``clear_errors()`` to reset.
    """

    def __init__(self, max_batch: int, max_budget: int, depth: int, vocab: int, device="cuda",
                 max_mask_bytes: int = 0):
        import torch

        from sglang_kdtree.gpu.verify import alloc_verify_inputs

        max_budget = _check_budget(max_budget)
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be in [1, {MAX_DEPTH}], got {depth}")
        if torch.device(device).type == "cuda":  # the buffers also build on the CPU (tests); no launch happens there
            check_tree_fits(max_budget, depth, limits.current(torch.device(device).index))
        self.max_batch, self.max_budget, self.depth, self.vocab = int(max_batch), max_budget, int(depth), int(vocab)
        self.device = torch.device(device)
        kmax = min(max(max_budget, 1), vocab)
        rows = self.max_batch * self.depth
        self.topk_workspace = TopKWorkspace(rows, vocab, kmax, self.device)
        self.logprobs = torch.empty(rows * kmax, dtype=torch.float32, device=self.device)
        self.token_ids = torch.empty(rows * kmax, dtype=torch.int64, device=self.device)
        self.trees = _alloc_tree(self.max_batch, max_budget + 1, self.device)
        self.verify = alloc_verify_inputs(self.max_batch, max_budget + 1, max_mask_bytes, self.device)
        self.error_flag = new_error_flag(self.device)

    def topk(self, logits, budget: int):
        """``topk_logprobs(logits [bs, L, V], budget)`` into the builder's buffers."""
        k = _check_k(max(budget, 1))
        bs = logits.shape[0]
        if bs > self.max_batch or logits.shape[1] != self.depth or logits.shape[2] != self.vocab:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not fit this TreeBuilder "
                f"([<= {self.max_batch}, {self.depth}, {self.vocab}])"
            )
        return topk_logprobs(logits, k, workspace=self.topk_workspace, out=(self.logprobs, self.token_ids),
                             error_flag=self.error_flag)

    def build(self, logprobs, token_ids, budget: int, root_tokens) -> Trees:
        return build_trees(logprobs, token_ids, budget, root_tokens, out=self.trees, error_flag=self.error_flag)

    def verify_inputs(self, trees: Trees, seq_lens, seq_lens_sum: int, fill_prefix: bool = True):
        from sglang_kdtree.gpu.verify import verify_inputs

        return verify_inputs(trees, seq_lens, seq_lens_sum=seq_lens_sum, out=self.verify, fill_prefix=fill_prefix,
                             error_flag=self.error_flag)

    def build_verify(self, logprobs, token_ids, budget: int, root_tokens, seq_lens, seq_lens_sum: int,
                     fill_prefix: bool = True):
        """``build`` then ``verify_inputs`` (``build_trees_verify``: one launch for budgets up to 256)."""
        return build_trees_verify(logprobs, token_ids, budget, root_tokens, seq_lens, seq_lens_sum=seq_lens_sum,
                                  out=self.trees, out_verify=self.verify, fill_prefix=fill_prefix,
                                  error_flag=self.error_flag)

    def round(self, logits, budget: int, root_tokens, seq_lens, seq_lens_sum: int, fill_prefix: bool = True):
        """Draft logits ``[bs, L, V]`` -> (``contract.Trees``, ``contract.VerifyInputs``), all on the device.

        ``seq_lens_sum`` is the host-side ``sum(seq_lens)`` the scheduler already knows (SGLang's
        ``batch.seq_lens_sum``); it sizes the FULL_MASK without a sync.
        """
        lp, ids = self.topk(logits, budget)
        return self.build_verify(lp, ids, budget, root_tokens, seq_lens, seq_lens_sum, fill_prefix)

    def check(self) -> None:
        raise_on_flag(self.error_flag, "TreeBuilder")

    def clear_errors(self) -> None:
        self.error_flag.zero_()
