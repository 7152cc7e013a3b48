"""Import shims for CUDA SGLang servers in the tests (test-only; never shipped or installed).

``tests/e2e/cuda_servers.py`` puts this folder first on the server's ``PYTHONPATH``; Python's ``site``
imports this file at start-up of every process (launcher, tokenizer, scheduler, detokenizer), then runs the
next ``sitecustomize`` further down ``sys.path``, if any. Besides the ``sgl_kernel`` stand-in package and
the ``sglang_kernel-*.dist-info`` metadata beside it (SGLang asserts ``sglang-kernel>=0.4.9`` from package
metadata on CUDA, ``entrypoints/engine.py:_set_envs_and_config``), it registers:

* ``soundfile`` -> ``shims/soundfile.py``, only if the real package is missing: SGLang's OpenAI audio
  routes import it at module level; the tests send no audio.
* ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` -> ``shims/cutedsl_dual_gemm.py``, only if ``cutlass``
  (the CUTLASS DSL) is missing: Llama's MLP imports it on CUDA, the kernel is SM100-only, and SGLang's own
  ``can_use_dual_gemm`` says no on the H200 anyway.
* After ``sglang.kernels.ops.sampling.renorm`` imports without FlashInfer (``flashinfer`` not importable),
  its ``top_k_renorm_prob`` / ``top_p_renorm_prob`` (lazy FlashInfer imports that would fail on first
  call) are pointed at SGLang's own Triton kernels (``sglang.kernels.ops.sampling.renorm_triton``, what
  SGLang uses on ROCm). Used by DFLASH's / EAGLE's sampled verify, not by greedy decoding.
* After ``sglang.srt.speculative.dflash_utils`` imports without FlashInfer, its
  ``_DFLASH_SAMPLING_VERIFY_AVAILABLE`` is set False: DFLASH's startup rehearsal of its sampled verify
  (``DFlashWorkerV2.prewarm_sampling``) JIT-compiles ``tree_speculative_sampling_target_only`` against
  FlashInfer's headers, which the GPU machine lacks. DFLASH then rehearses the model runner's sampling
  instead, and serves greedy requests as before (``benchmarks/bench_server.py`` sends only greedy ones).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SHIM_DIR = os.path.join(_HERE, "shims")


def _importable_elsewhere(name: str) -> bool:
    """Whether a finder other than ours resolves ``name`` (our finder steps aside while we ask)."""
    _ShimFinder.probing.add(name)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        _ShimFinder.probing.discard(name)


class _ShimFinder(importlib.abc.MetaPathFinder):
    # module -> (shim file, module whose absence makes the shim apply)
    SHIMS = {
        "soundfile": ("soundfile.py", "soundfile"),
        "sglang.kernels.ops.gemm.cutedsl_dual_gemm": ("cutedsl_dual_gemm.py", "cutlass"),
    }
    probing: set = set()

    def find_spec(self, fullname, path=None, target=None):
        entry = self.SHIMS.get(fullname)
        if entry is None or fullname in self.probing:
            return None
        shim_file, needed = entry
        if _importable_elsewhere(needed):
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(_SHIM_DIR, shim_file))


def _renorm_without_flashinfer(module) -> None:
    if _importable_elsewhere("flashinfer"):
        return
    if type(getattr(module, "top_k_renorm_prob", None)).__name__ != "LazyImport":
        return  # not the CUDA branch (or SGLang changed): leave it alone
    from sglang.kernels.ops.sampling import renorm_triton

    module.top_k_renorm_prob = renorm_triton.top_k_renorm_probs_triton
    module.top_p_renorm_prob = renorm_triton.top_p_renorm_probs_triton


def _dflash_sampling_without_flashinfer(module) -> None:
    if _importable_elsewhere("flashinfer"):
        return
    if not hasattr(module, "_DFLASH_SAMPLING_VERIFY_AVAILABLE"):
        return  # SGLang changed: leave it alone
    module._DFLASH_SAMPLING_VERIFY_AVAILABLE = False


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs a patch right after the named module's own code, before anyone imports names from it."""

    PATCHES = {
        "sglang.kernels.ops.sampling.renorm": _renorm_without_flashinfer,
        "sglang.srt.speculative.dflash_utils": _dflash_sampling_without_flashinfer,
    }

    def find_spec(self, fullname, path=None, target=None):
        patch = self.PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)


def _install() -> None:
    if not any(type(f).__name__ == "_ShimFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())
        sys.meta_path.insert(0, _ShimFinder())


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows (the first one later on ``sys.path``), if any."""
    seen_self = False
    for entry in sys.path:
        directory = os.path.abspath(entry or os.curdir)
        if directory == _HERE:
            seen_self = True
            continue
        candidate = os.path.join(directory, "sitecustomize.py")
        if seen_self and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_kdtree_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_install()
_chain_next_sitecustomize()
