"""Every SGLang private (underscore) symbol the MoE code reaches into, pinned against the installed SGLang, so an
SGLang upgrade that renames, moves or reshapes one fails here on a CPU machine instead of at the first Marlin
call on a GPU host.

The MoE code is ``sglang_kdtree/moe/``, ``sglang_kdtree/patches/marlin_moe.py`` and the JIT seeding tool
``tests/e2e/prebuild_jit.py``; ``test_every_private_use_is_pinned`` scans them, so a new private use without a
pin here fails too. Besides the underscore names, ``seed_prebuilt`` relies on how SGLang's JIT loader works
inside: it swaps ``ninja.build`` while ``load_jit`` runs, writes a depfile for ``ninja.scan_dependencies``, and
reads the cache layout and ``sgl_deps.json`` entries ``export_prebuilt`` copies; those are pinned as well.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOE_SOURCES = sorted((ROOT / "sglang_kdtree" / "moe").glob("*.py")) + [
    ROOT / "sglang_kdtree" / "patches" / "marlin_moe.py",
    ROOT / "tests" / "e2e" / "prebuild_jit.py",
]

POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
KW = inspect.Parameter.KEYWORD_ONLY

#: symbol -> its parameters (name, kind) as the MoE code calls it
PRIVATE = {
    # jit.marlin_module_builders: called positionally with (dtype, *MARLIN_SPECIALIZATION), whose order this pins
    "sglang.kernels.ops.moe.moe_wna16_marlin._jit_moe_wna16_marlin_module": [
        ("dtype", POS), ("is_ep", POS), ("has_bias", POS), ("expert_ids_are_sorted", POS),
        ("zero_inactive_output", POS), ("has_inactive_prefix_count", POS)],
    "sglang.kernels.ops.quantization.gptq_marlin_repack._jit_gptq_marlin_repack_module": [],
    # jit._verified_sources: a prebuilt module's recorded sources, resolved and hashed like SGLang does
    "sglang.kernels.jit.utils.compile.cache._resolve_path": [("root", KW), ("relpath", KW)],
    "sglang.kernels.jit.utils.compile.cache._file_digest": [("path", POS)],
    # tests/e2e/prebuild_jit.py --which glue: fused_marlin_moe's small JIT modules, called positionally
    "sglang.kernels.ops.moe.moe_align._jit_moe_align_module": [
        ("dtype", POS), ("write_inactive_prefix_count", POS), ("map_invalid_experts_to_sentinel", POS),
        ("pad_expert_ids", POS)],
    "sglang.kernels.ops.moe.moe_align_single_token._jit_align_single_token_module": [
        ("write_inactive_prefix_count", POS)],
}

#: public names of SGLang's JIT internals that the seeding swaps or calls with these parameters
INTERNAL = {
    "sglang.kernels.jit.utils.compile.ninja.build": [("spec", KW), ("build_dir", KW), ("build_file", KW)],
    "sglang.kernels.jit.utils.compile.ninja.scan_dependencies": [("build_dir", POS)],
    "sglang.kernels.jit.utils.compile.cache.cache_root": [],
    "sglang.kernels.jit.utils.arch.override_jit_cuda_arch": [("major", POS), ("minor", POS), ("suffix", POS)],
}


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _parameters(fn) -> list:
    return [(p.name, p.kind) for p in inspect.signature(inspect.unwrap(fn)).parameters.values()]


@pytest.mark.parametrize("symbol", sorted(PRIVATE) + sorted(INTERNAL))
def test_symbol_exists_with_the_expected_parameters(symbol):
    expected = PRIVATE.get(symbol, INTERNAL.get(symbol))
    fn = _resolve(symbol)
    assert callable(fn), f"{symbol} is no longer callable"
    assert _parameters(fn) == expected, f"{symbol} changed its parameters: {inspect.signature(inspect.unwrap(fn))}"


def _private_uses(path: Path) -> set[str]:
    """``module._name`` for every SGLang underscore name ``path`` imports or reads off an imported SGLang module."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> SGLang module it is bound to
    uses: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sglang" and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            for a in node.names:
                if a.name.startswith("_"):
                    uses.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            uses.add(f"{aliases[node.value.id]}.{node.attr}")
    return uses


def test_every_private_use_is_pinned():
    found = {use: path.relative_to(ROOT).as_posix() for path in MOE_SOURCES for use in _private_uses(path)}
    assert set(found) <= set(PRIVATE), {use: where for use, where in found.items() if use not in PRIVATE}
    # the scan sees the uses it must (a scan that finds nothing would pass vacuously)
    assert {"sglang.kernels.jit.utils.compile.cache._resolve_path",
            "sglang.kernels.ops.moe.moe_wna16_marlin._jit_moe_wna16_marlin_module"} <= set(found)


def test_load_jit_builds_through_the_ninja_module_attribute():
    """``seed_prebuilt`` replaces ``ninja.build`` on the module; that only takes effect if ``load_jit`` looks it
    up there at call time (not a ``from ... import build`` copy) with these keywords."""
    from sglang.kernels.jit.utils.compile import loader, ninja

    assert loader.ninja is ninja
    source = inspect.getsource(loader.load_jit)
    assert "ninja.build(spec=spec, build_dir=staging, build_file=build_file)" in source
    assert "ninja.scan_dependencies(staging)" in source


def test_scan_dependencies_reads_the_prebuilt_depfile(tmp_path):
    """The depfile ``seed_prebuilt`` writes (``prebuilt.o.d``, spaces escaped) lists exactly the verified sources."""
    from sglang.kernels.jit.utils.compile import ninja

    paths = ["/a/kernel.cuh", "/b/with space/x.h"]
    (tmp_path / "prebuilt.o.d").write_text("prebuilt.o: " + " ".join(p.replace(" ", "\\ ") for p in paths) + "\n")
    assert [str(p) for p in ninja.scan_dependencies(tmp_path)] == paths


def test_cache_layout_and_dependency_entries():
    """``export_prebuilt`` globs ``<target>/<module>/build-*/deps-*/<module>.so`` and copies ``sgl_deps.json``;
    ``seed_prebuilt`` reads its entries as ``[root, relpath, digest]`` and checks the ``kernels`` and
    ``tvm_ffi`` roots."""
    import msgspec
    from sglang.kernels.jit.utils.compile import cache

    from sglang_kdtree.moe import jit

    assert (cache._DEPS_FILE, cache._BUILD_KEY_PREFIX, cache._DEPS_KEY_PREFIX) == ("sgl_deps.json", "build-", "deps-")
    assert "cache_root() / _target_tag() / module_name" in inspect.getsource(cache.build_key_dir)
    entry = cache._DepEntry(root="kernels", relpath="gemm/marlin/x.cuh", digest="ab12")
    assert json.loads(msgspec.json.encode([entry])) == [["kernels", "gemm/marlin/x.cuh", "ab12"]]
    assert set(jit._VERIFIED_ROOTS) <= {token for token, _ in cache._anchor_roots()}


def test_resolve_path_and_file_digest_behave_as_used(tmp_path):
    from sglang.kernels.jit.utils.compile import cache
    from sglang.kernels.jit.utils.compile.paths import KERNEL_PATH

    kernels_root = dict(cache._anchor_roots())["kernels"]
    assert cache._resolve_path(root="kernels", relpath="a/b.cuh") == kernels_root / "a/b.cuh"
    assert kernels_root == Path(KERNEL_PATH).resolve()
    assert cache._resolve_path(root="no-such-root", relpath="x") is None
    f = tmp_path / "f.cuh"
    f.write_bytes(b"__global__ void k() {}\n")
    assert cache._file_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert cache._file_digest(tmp_path / "missing") is None


def _fake_spec(name):
    return type("Spec", (), {"module_name": name})()


def test_seed_prebuilt_copies_a_verified_module_and_compiles_the_rest(tmp_path, monkeypatch):
    """``seed_prebuilt`` against SGLang's real cache helpers, with ``ninja.build`` as a recorder: a module whose
    recorded ``kernels`` source hashes like the installed one is copied (and its depfile written); one recorded
    from a different source, or absent from ``source``, goes to the real build. (The export's JIT target matches
    here; another target: test_moe_prebuilt_arch.py.)"""
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch
    from sglang.kernels.jit.utils.compile import cache, ninja

    from sglang_kdtree.moe import jit

    kernels_root = dict(cache._anchor_roots())["kernels"]
    real_source = next(p for p in sorted(kernels_root.rglob("*.cuh")) if p.is_file())
    relpath = real_source.relative_to(kernels_root).as_posix()
    digest = hashlib.sha256(real_source.read_bytes()).hexdigest()
    source = tmp_path / "prebuilt"
    source.mkdir()
    for name, recorded in (("good", digest), ("stale", "0" * 64)):
        (source / f"{name}.so").write_bytes(b"ELF")
        (source / f"{name}.deps.json").write_text(json.dumps([["kernels", relpath, recorded], ["sys", "x.h", "y"]]))
    (source / jit.MANIFEST).write_text(json.dumps({"modules": {n: {"target": "sm120f"} for n in ("good", "stale")}}))
    compiled = []

    def real_build(*, spec, build_dir, build_file):
        compiled.append(spec.module_name)
        return build_dir / f"{spec.module_name}.so"

    monkeypatch.setattr(ninja, "build", real_build)
    builds = {}

    def builder(name):
        def build():  # stands in for load_jit: calls ninja.build through the module, as pinned above
            builds[name] = ninja.build(spec=_fake_spec(name), build_dir=tmp_path / f"build-{name}", build_file="")
        return build

    with override_jit_cuda_arch(12, 0, "f"):
        seeded = jit.seed_prebuilt(source, builders=[builder("good"), builder("stale"), builder("absent")])
    assert seeded == ["good"] and compiled == ["stale", "absent"]
    assert (tmp_path / "build-good" / "good.so").read_bytes() == b"ELF"
    assert (tmp_path / "build-good" / "prebuilt.o.d").read_text() == f"prebuilt.o: {real_source}\n"
    assert ninja.build is real_build  # restored after every builder
