"""Test-only CUDA stand-in for ``sgl_kernel`` (never shipped or installed by sglang-kdtree).

Why it exists: SGLang 0.5.23 on CUDA imports ops from the ``sglang-kernel`` binary wheel, which is built
against SGLang's pinned torch (2.14.1). The H200 test machine has torch 2.11 and no package index, so that
wheel cannot run there. Most of SGLang's CUDA path already goes through SGLang's own JIT kernels
(``sglang.kernels.ops``: rope, MoE top-k / fused gate, concat_mla, the Triton attention and fused-MoE
kernels); what is left are the few names below (some of them ``KernelBackend.AOT`` registrations of
``sglang.kernels.ops`` itself, e.g. ``sgl_kernel:moe_align_block_size``). ``tests/e2e/cuda_servers.py``
puts this folder first on the server's ``PYTHONPATH`` (with ``sitecustomize.py`` beside it for the
import shims).

Contract (like the CPU stand-in in ``tests/e2e/sgl_kernel_stub``):

* every op a CUDA server of the test targets calls is implemented here in plain torch (device-agnostic,
  so ``tests/test_sgl_kernel_cuda_standin.py`` checks it on CPU against float64 math), with the argument
  order of the real op and a docstring naming its SGLang call site;
* ``moe_align_block_size`` and ``sgl_kernel.utils.is_arch_support_pdl`` delegate to SGLang's own JIT
  kernel / helper (``sglang.kernels.ops.moe.moe_align``, ``sglang.kernels.jit.utils``);
* Marlin ops from ``_marlin_ops.py`` (helper B's file, if present): every name in its ``__all__`` becomes
  ``sgl_kernel.<name>``; a module attribute ``scalar_type`` of it is registered as
  ``sgl_kernel.scalar_type``;
* every other name, and every other ``sgl_kernel.*`` submodule, resolves to a stub that raises
  ``NotImplementedError`` naming the op when called, so a new dependency fails loudly, by name.

What this changes in a server: the numerics of these few elementwise ops (torch instead of the fused CUDA
kernels) and nothing else. SGLang's scheduler, model runner, CUDA-graph runners, memory pool, Triton
attention and fused-MoE kernels, and sglang-kdtree's own GPU code, are the real thing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch
import torch.nn.functional as F

__version__ = "0.4.10+kdtree.cuda.standin"


class _MissingOp:
    """A name the real sgl_kernel provides that no tested CUDA path calls: raise on use; allow attribute
    chains (``scalar_types.uint4b8``) because some modules read them at import time."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self._name} is not provided by the sglang-kdtree CUDA test stand-in "
            "(tests/e2e/sgl_kernel_cuda); implement it there (torch or sglang.kernels.ops) if a tested "
            "server path needs it"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingOp(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel CUDA stand-in: missing {self._name}>"


def _rms(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """``out = input / sqrt(mean(input^2) + eps) * weight`` per row, in float32, cast to input's dtype.

    Call site: ``sglang/srt/layers/layernorm.py:RMSNorm.forward_cuda`` (no residual: the first layer's
    input norm, the final norm, the MLA q/kv LoRA norms, the DFlash drafter's norms)."""
    del enable_pdl
    result = _rms(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place: ``residual += input`` (sum taken in float32), then ``input = rmsnorm(residual)`` of that
    float32 sum (FlashInfer's FusedAddRMSNorm order).

    Call site: ``sglang/srt/layers/layernorm.py:RMSNorm.forward_cuda`` (``residual is not None``: the
    pre-attention / pre-MLP norms of every decoder layer after the first, the final norm)."""
    del enable_pdl
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms(total, weight, eps))


def _act_and_mul(act, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    x32 = input.float()
    result = (act(x32[..., :d]) * x32[..., d:]).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``, computed in float32.

    Call site: ``sglang/srt/layers/activation.py:_act_and_mul`` (via ``SiluAndMul.forward_cuda``) when
    SGLang's JIT kernel rejects the width (``_jit_act_supported``: width not a multiple of 16 bytes)."""
    del enable_pdl
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None):
    """``gelu(x[..., :d]) * x[..., d:]`` (erf GELU), in float32.

    Call site: ``sglang/srt/layers/activation.py:_act_and_mul`` (``GeluAndMul(approximate="none")``),
    same width fallback as ``silu_and_mul``; imported there at module level."""
    del enable_pdl
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None):
    """``gelu_tanh(x[..., :d]) * x[..., d:]``, in float32.

    Call site: ``sglang/srt/layers/activation.py:_act_and_mul`` (``GeluAndMul(approximate="tanh")``),
    same width fallback as ``silu_and_mul``; imported there at module level."""
    del enable_pdl
    return _act_and_mul(lambda t: F.gelu(t, approximate="tanh"), input, out)


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float) -> None:
    """``output[t] = routed_scaling_factor * sum_k input[t, k]`` for ``input`` of shape
    ``[tokens, topk, hidden]``, accumulated in float32.

    Call sites: ``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py:fused_experts_impl``
    (combine step: more than 32 tokens and ``topk > 2`` or a scaling factor != 1) and
    ``sglang/srt/layers/moe/fused_moe_triton/fused_marlin_moe.py:fused_marlin_moe``."""
    output.copy_(input.float().sum(dim=1) * routed_scaling_factor)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                         sorted_token_ids: torch.Tensor, experts_ids: torch.Tensor,
                         num_tokens_post_pad: torch.Tensor, cumsum_buffer: torch.Tensor,
                         pad_sorted_token_ids: bool = False, ignore_invalid_expert: bool = False) -> None:
    """Block-align the (token, expert) pairs for the fused-MoE GEMM, through SGLang's own JIT kernel
    ``sglang.kernels.ops.moe.moe_align:moe_align_block_size`` (same positional contract: ``num_experts``
    already counts the +1 bucket of filtered ids; SGLang calls that JIT kernel with these arguments itself
    when ``return_inactive_prefix_count`` / ``pad_expert_ids`` is asked for).

    Call site: ``sglang/kernels/ops/moe/__init__.py:moe_align_block_size`` (the ``KernelBackend.AOT``
    registration ``sgl_kernel:moe_align_block_size``), reached from
    ``sglang/srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py:moe_align_block_size`` for every
    Triton fused-MoE and Marlin MoE forward above the tiny-batch Triton path."""
    if ignore_invalid_expert:
        raise NotImplementedError(
            "sgl_kernel.moe_align_block_size(ignore_invalid_expert=True) (expert parallelism) is not provided "
            "by the sglang-kdtree CUDA test stand-in (tests/e2e/sgl_kernel_cuda)"
        )
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit_moe_align_block_size

    jit_moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                             num_tokens_post_pad, cumsum_buffer, pad_sorted_token_ids)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as ``tensor`` (same shape, strides, offset).

    The real op returns a view that does *not* keep the storage alive; this one does, which only keeps
    graph-pool memory reserved a little longer (it never frees early, so it cannot corrupt anything).

    Call site: ``sglang/srt/model_executor/runner_backend_utils/weak_ref_tensor.py:weak_ref_tensors``
    (breakable CUDA-graph capture of the prefill graph,
    ``runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py``)."""
    return tensor.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


_IMPLEMENTED = {
    "rmsnorm": rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "moe_sum_reduce": moe_sum_reduce,
    "moe_align_block_size": moe_align_block_size,
    "weak_ref_tensor": weak_ref_tensor,
}

# Helper B's Marlin ops, if that file is present (see the module docstring for the contract).
if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_marlin_ops.py")):
    from . import _marlin_ops

    for _name in getattr(_marlin_ops, "__all__", ()):
        _IMPLEMENTED[_name] = getattr(_marlin_ops, _name)
    if isinstance(getattr(_marlin_ops, "scalar_type", None), types.ModuleType):
        sys.modules[f"{__name__}.scalar_type"] = _marlin_ops.scalar_type



def _traced(name: str, fn):
    """With ``KDTREE_STANDIN_TRACE=FILE``: append ``name`` to FILE on the op's first call in this process
    (the harness records which stand-in ops a server really used)."""
    import functools

    path = os.environ.get("KDTREE_STANDIN_TRACE")
    if not path:
        return fn
    seen = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not seen:
            seen.append(True)
            with open(path, "a") as f:
                f.write(f"{name} pid={os.getpid()}\n")
        return fn(*args, **kwargs)

    return wrapper


globals().update({name: _traced(name, fn) for name, fn in _IMPLEMENTED.items()})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _MissingOp(name)


class _MissingSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``sgl_kernel.<sub>`` imports that no file in this package provides (it sits at the end of
    ``sys.meta_path``, so ``utils.py`` and the like win) to a module whose attributes are ``_MissingOp``s."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name[len(__name__) + 1:]

        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _MissingOp(f"{prefix}.{attr}")

        module.__getattr__ = missing
        return module

    def exec_module(self, module):
        return None


if not any(type(f).__name__ == "_MissingSubmoduleFinder" for f in sys.meta_path):
    sys.meta_path.append(_MissingSubmoduleFinder())
