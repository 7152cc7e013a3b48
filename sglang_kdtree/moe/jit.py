"""SGLang's JIT Marlin modules for the MoE path: build or load them (``ensure_marlin_kernels``), and move built
ones between machines (``export_prebuilt`` here, ``seed_prebuilt`` there) so a GPU host need not run nvcc.

Marlin MoE is a JIT module: the first call compiles it with nvcc (~6 minutes on the H200 machine) into
SGLang's cache (``$SGLANG_JIT_CACHE_DIR``, default ``~/.cache/sglang/jit``); later processes load it in
well under a second. ``ensure_marlin_kernels`` logs before compiling; ``python -m sglang_kdtree.moe
--warmup`` builds it ahead of time. Only one Marlin specialization is used for both GEMMs (bf16, no EP,
no bias, generic block order), so one compile serves the whole path.

SGLang internals used here (each pinned by ``tests/test_moe_sglang_private.py``): the module getters
``_jit_gptq_marlin_repack_module`` and ``_jit_moe_wna16_marlin_module``; the cache's ``_resolve_path`` and
``_file_digest`` (to verify a prebuilt module's sources), its layout (``<target>/<module>/build-*/deps-*/``
with ``sgl_deps.json``) and ``ninja.build``, which ``seed_prebuilt`` swaps for a verified copy while
SGLang's own ``load_jit`` runs.

An export records each module's JIT target (``MANIFEST``: SGLang's ``<target>`` cache segment, e.g. ``sm90a`` for
compute capability 9.0); ``seed_prebuilt`` plants a module only where SGLang's JIT target is that same one, so
sm_90a code never lands on an sm_120 card (nor an export that does not say what it was built for).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["MARLIN_SPECIALIZATION", "MANIFEST", "jit_cache_dir", "marlin_kernels_cached", "ensure_marlin_kernels",
           "marlin_module_builders", "export_modules", "export_prebuilt", "jit_target", "seed_prebuilt"]

#: the single Marlin specialization this path uses: (is_ep, has_bias, expert_ids_are_sorted,
#: zero_inactive_output, has_inactive_prefix_count). moe_align.cu emits only live blocks, so the
#: generic block walk never meets a -1 block and costs the same as the sorted one.
MARLIN_SPECIALIZATION = (False, False, False, False, False)
#: the dependency roots a prebuilt module must match file by file (system / toolkit headers: same CUDA major is
#: the caller's promise)
_VERIFIED_ROOTS = ("kernels", "tvm_ffi")
#: the file of an export that names each module's JIT target: ``{"modules": {"<module>": {"target": "sm90a"}}}``
MANIFEST = "prebuilt.json"
_TARGET = re.compile(r"sm(\d+)(\d)([a-z]?)")  # SGLang's cache segment: sm + major + minor + suffix


def jit_cache_dir():
    """SGLang's JIT cache root (``$SGLANG_JIT_CACHE_DIR``, default ``~/.cache/sglang/jit``)."""
    from sglang.kernels.jit.utils.compile.cache import cache_root

    return cache_root()


def marlin_kernels_cached() -> bool:
    """Whether a built Marlin MoE module is in the cache (any target and build key: a heuristic for the log;
    SGLang's own key check decides whether it is reused)."""
    root = jit_cache_dir()
    return root.is_dir() and any(root.glob("*/*moe_wna16_marlin*/**/*.so"))


@functools.cache
def ensure_marlin_kernels(dtype_name: str = "bfloat16"):
    """Build (or load from SGLang's cache) the Marlin repack and MoE JIT modules, logging before a compile.

    Returns the seconds it took. Needs nvcc, ninja and apache-tvm-ffi, and a visible GPU (the target is
    the local arch). Once per process; SGLang's per-build file lock makes TP ranks compile only once.
    """
    cached = marlin_kernels_cached()
    if not cached:
        logger.warning(
            "sglang-kdtree: compiling Marlin MoE kernels (nvcc, ~6 min on an H200 host, once), cached at %s "
            "(set SGLANG_JIT_CACHE_DIR to keep it elsewhere; pre-build with `python -m sglang_kdtree.moe "
            "--warmup`)", jit_cache_dir())
    start = time.perf_counter()
    for build in marlin_module_builders(dtype_name):
        build()
    seconds = time.perf_counter() - start
    (logger.info if seconds > 5 or not cached else logger.debug)(
        "sglang-kdtree: Marlin MoE kernels ready in %.1f s (cache %s)", seconds, jit_cache_dir())
    return seconds


def marlin_module_builders(dtype_name: str = "bfloat16"):
    """The SGLang JIT module getters this path needs (repack, then the one Marlin MoE specialization)."""
    import torch

    from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module
    from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module

    dtype = getattr(torch, dtype_name)
    return (_jit_gptq_marlin_repack_module, lambda: _jit_moe_wna16_marlin_module(dtype, *MARLIN_SPECIALIZATION))


def _describe(target: str | None) -> str:
    """``sm120f (compute capability 12.0)``; ``an unknown architecture`` for None."""
    if target is None:
        return "an unknown architecture"
    match = _TARGET.fullmatch(target)
    return f"{target} (compute capability {match[1]}.{match[2]})" if match else target


def jit_target() -> str:
    """The target SGLang's JIT builds for here, as its cache names it (``cache._target_tag``): the local GPU's
    (``sm90a``, ``sm120f``), or the ``override_jit_cuda_arch`` in force."""
    from sglang.kernels.jit.utils.arch import get_jit_cuda_arch

    arch = get_jit_cuda_arch()
    return f"sm{arch.major}{arch.minor}{arch.suffix}"


def export_modules(builds, dest) -> list:
    """Copy cached module builds (``<cache>/<target>/<module>/build-*/deps-*/<module>.so``) into ``dest`` as
    ``<module>.so`` plus ``<module>.deps.json`` (SGLang's recorded dependency list), and record each module's
    ``<target>`` in ``dest/MANIFEST`` (kept for modules exported there before). Returns the module names."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    modules = manifest.setdefault("modules", {})
    exported = []
    for so in builds:
        so = Path(so)
        shutil.copy2(so, dest / so.name)
        shutil.copy2(so.parent / "sgl_deps.json", dest / f"{so.stem}.deps.json")
        modules[so.stem] = {"target": so.parents[3].name}
        exported.append(so.stem)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return exported


def export_prebuilt(dest) -> list:
    """Copy the built Marlin modules out of SGLang's JIT cache into ``dest`` (``export_modules``: the newest build
    of each, with its JIT target recorded), so another machine with the same sglang, apache-tvm-ffi, CUDA major
    and GPU arch can seed its cache with ``seed_prebuilt`` instead of compiling. Returns the module names."""
    builds = []
    for pattern in ("*gptq_marlin_repack", "*moe_wna16_marlin_*"):
        found = sorted(jit_cache_dir().glob(f"*/{pattern}/build-*/deps-*/*.so"), key=lambda p: p.stat().st_mtime)
        builds += found[-1:]
    return export_modules(builds, dest)


def _recorded_target(source: Path, module_name: str) -> str | None:
    """The JIT target ``source``'s manifest records for ``module_name``, or None."""
    try:
        entry = json.loads((source / MANIFEST).read_text())["modules"][module_name]
        return str(entry["target"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _verified_sources(module_name: str, deps: Path) -> list | None:
    """The local paths of the SGLang kernel and tvm-ffi sources a prebuilt module's dependency list names, or
    None (with a warning) when one of them is missing here or hashes differently."""
    from sglang.kernels.jit.utils.compile import cache as jit_cache

    paths = []
    for root, relpath, digest in json.loads(deps.read_text()):
        if root not in _VERIFIED_ROOTS:
            continue
        path = jit_cache._resolve_path(root=root, relpath=relpath)
        if path is None or jit_cache._file_digest(path) != digest:
            logger.warning("sglang-kdtree: prebuilt %s was built from a different %s:%s; compiling instead",
                           module_name, root, relpath)
            return None
        paths.append(str(path))
    return paths


def _built_here(source: Path, module_name: str) -> bool:
    """Whether ``source`` records ``module_name`` as built for this JIT target; else one warning naming both."""
    recorded, here = _recorded_target(source, module_name), jit_target()
    if recorded == here:
        return True
    why = "" if recorded is not None else f" ({source / MANIFEST} does not name it: re-export it)"
    logger.warning("sglang-kdtree: prebuilt %s in %s was built for %s%s, and SGLang's JIT builds for %s here; "
                   "compiling it instead", module_name, source, _describe(recorded), why, _describe(here))
    return False


def _prebuilt_build(source: Path, real_build, seeded: list):
    """A stand-in for SGLang's ``ninja.build``: copies ``source``'s verified prebuilt module into the build
    directory (recording its sources where SGLang reads the compiler's depfiles), else runs ``real_build``.
    Verified: built for this JIT target (``_built_here``) from sources that hash like this installation's."""

    def build(*, spec, build_dir, build_file):
        so = source / f"{spec.module_name}.so"
        deps = source / f"{spec.module_name}.deps.json"
        paths = None
        if so.is_file() and deps.is_file() and _built_here(source, spec.module_name):
            paths = _verified_sources(spec.module_name, deps)
        if paths is None:
            return real_build(spec=spec, build_dir=build_dir, build_file=build_file)
        build_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, build_dir / so.name)
        # SGLang records what the compiler read from the depfiles; list the verified sources there
        escaped = (p.replace(" ", "\\ ") for p in paths)
        (build_dir / "prebuilt.o.d").write_text("prebuilt.o: " + " ".join(escaped) + "\n")
        seeded.append(spec.module_name)
        return build_dir / so.name

    return build


def seed_prebuilt(source, dtype_name: str = "bfloat16", *, builders=None) -> list:
    """Seed SGLang's JIT cache with Marlin modules exported by ``export_prebuilt`` on another machine.

    Runs SGLang's own ``load_jit`` (same cache key, lock and publication) with only its compile step
    replaced: for a module found in ``source`` that ``source``'s manifest records as built for SGLang's JIT
    target here (``jit_target``; another target, or none recorded, gets one warning naming both) and whose
    recorded SGLang kernel sources and tvm-ffi headers hash exactly like this installation's, the prebuilt
    ``.so`` is copied in place of running nvcc, then loaded
    (a library that does not load here raises inside ``load_jit``) and published. Anything that does not
    match falls through to a normal compile. ``builders``: the zero-argument SGLang module getters to run
    (default ``marlin_module_builders(dtype_name)``). Returns the modules seeded from ``source``.
    """
    from sglang.kernels.jit.utils.compile import ninja as jit_ninja

    real_build = jit_ninja.build
    seeded = []
    prebuilt_build = _prebuilt_build(Path(source), real_build, seeded)
    for build in marlin_module_builders(dtype_name) if builders is None else builders:
        before = len(seeded)
        jit_ninja.build = prebuilt_build
        try:
            build()
        except Exception as exc:  # e.g. the library needs a newer libstdc++ than this machine has
            del seeded[before:]
            logger.warning("sglang-kdtree: a prebuilt Marlin module did not load here (%s); it will be compiled",
                           exc)
        finally:
            jit_ninja.build = real_build
    return seeded
