"""Test-only stand-in for the CPU ops of ``sgl_kernel`` (never shipped or installed by sglang-kdtree).

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``sgl_kernel`` CPU ops at module level
(``mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``, ``kernels/ops/speculative/*``), but
PyPI ships only CUDA builds of sgl-kernel, which need ``libcuda``. The end-to-end tests put this folder
first on ``PYTHONPATH`` of the server subprocess so the CPU engine imports.

Contract:
* The ops a CPU server of the tiny models actually calls are implemented in plain torch (``_IMPLEMENTED``),
  each with the argument order of its SGLang call site.
* Every other name, and every ``sgl_kernel.*`` submodule, resolves to a stub that raises
  ``NotImplementedError`` naming the op when called, so a new dependency fails loudly instead of silently.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import sys
import types

import torch

__version__ = "0.0.0+kdtree-test-stub"


class _MissingOp:
    """A name the real sgl_kernel provides that no tested CPU path calls: raise on use, allow attribute
    chains (``scalar_types.uint4b8``) because some modules read them at import time."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self._name} is not provided by the sglang-kdtree test stub "
            "(tests/e2e/sgl_kernel_stub); add a pure-torch version if a CPU test path needs it"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingOp(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed run i]`` (runs packed
    back to back in batch order), as SGLang's Triton ``assign_req_to_token_pool``."""
    del pool_len  # the row stride is implied by req_to_token's shape here
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + length].to(req_to_token.dtype)
        offset += length


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (a raw base pointer and its row stride in bytes) copy row ``src_loc[j]`` to row
    ``tgt_loc[j]``. All source rows are read before any is written, like the Triton kernel's single
    load-then-store, so overlapping moves (dst of one = src of another) are safe."""
    ptrs = data_ptrs.tolist()
    row_bytes = strides.tolist()
    src = src_loc.tolist()
    dst = tgt_loc.tolist()
    for base, stride in zip(ptrs, row_bytes):
        staged = [ctypes.string_at(base + s * stride, stride) for s in src]
        for d, row in zip(dst, staged):
            ctypes.memmove(base + d * stride, row, stride)


_IMPLEMENTED = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}

globals().update(_IMPLEMENTED)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _MissingOp(name)


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves any ``sgl_kernel.<sub>`` import to a module whose attributes are ``_MissingOp``s."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name[len("sgl_kernel."):]
        module.__getattr__ = lambda attr: (_ for _ in ()).throw(AttributeError(attr)) if attr.startswith(
            "__") else _MissingOp(f"{prefix}.{attr}")
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _StubSubmoduleFinder())

# torch.ops.sgl_kernel.* lookups (e.g. cpu_has_amx_support probes convert_weight_packed) must fail as
# "no such op" so SGLang picks its non-AMX paths; nothing to register for that.
del torch
