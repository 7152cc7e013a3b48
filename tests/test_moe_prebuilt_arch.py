"""Prebuilt Marlin JIT modules carry the architecture they were built for: ``moe.jit.export_modules``
records each module's JIT target (SGLang's ``<target>`` cache segment) in the export's manifest, and
``seed_prebuilt`` plants a module only where SGLang's JIT builds for that same target; another target, or an export
that records none, is compiled instead, with one warning naming both. On the CPU: a fake SGLang cache and export
folder, ``ninja.build`` as a recorder, the JIT target set with SGLang's ``override_jit_cuda_arch``."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang.kernels.jit.utils.arch import override_jit_cuda_arch  # noqa: E402
from sglang.kernels.jit.utils.compile import cache, ninja  # noqa: E402

from sglang_kdtree.moe import jit  # noqa: E402

MODULE = "moe_wna16_marlin_test"


def _real_kernel_source() -> tuple[str, str]:
    """A ``kernels`` source of this SGLang and its digest, so the prebuilt module's sources verify here."""
    root = dict(cache._anchor_roots())["kernels"]
    path = next(p for p in sorted(root.rglob("*.cuh")) if p.is_file())
    return path.relative_to(root).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest()


def _cached_build(cache_root: Path, target: str, name: str = MODULE) -> Path:
    """A built module in SGLang's cache layout: ``<target>/<module>/build-*/deps-*/<module>.so``."""
    leaf = cache_root / target / name / "build-k" / "deps-d"
    leaf.mkdir(parents=True)
    relpath, digest = _real_kernel_source()
    (leaf / "sgl_deps.json").write_text(json.dumps([["kernels", relpath, digest]]))
    so = leaf / f"{name}.so"
    so.write_bytes(f"ELF for {target}".encode())
    return so


def _seed(source: Path, tmp_path: Path, monkeypatch, arch: tuple, name: str = MODULE) -> tuple[list, list]:
    """Seed ``name`` from ``source`` with SGLang's JIT building for ``arch`` (major, minor, suffix)."""
    compiled = []

    def real_build(*, spec, build_dir, build_file):
        compiled.append(spec.module_name)
        return build_dir / f"{spec.module_name}.so"

    monkeypatch.setattr(ninja, "build", real_build)
    spec = type("Spec", (), {"module_name": name})()

    def builder():  # stands in for load_jit: calls ninja.build through the module
        ninja.build(spec=spec, build_dir=tmp_path / "build", build_file="")

    with override_jit_cuda_arch(*arch):
        seeded = jit.seed_prebuilt(source, builders=[builder])
    return seeded, compiled


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == jit.logger.name and r.levelno == logging.WARNING]


def test_export_records_each_modules_target(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "jit_cache_dir", lambda: tmp_path / "cache")
    so = _cached_build(tmp_path / "cache", "sm90a")
    dest = tmp_path / "export"
    assert jit.export_prebuilt(dest) == [MODULE]
    assert (dest / f"{MODULE}.so").read_bytes() == so.read_bytes()
    assert (dest / f"{MODULE}.deps.json").read_bytes() == (so.parent / "sgl_deps.json").read_bytes()
    assert json.loads((dest / jit.MANIFEST).read_text()) == {"modules": {MODULE: {"target": "sm90a"}}}
    # a second export into the same folder keeps what the first recorded
    other = _cached_build(tmp_path / "cache2", "sm120f", "gptq_marlin_repack")
    assert jit.export_modules([other], dest) == ["gptq_marlin_repack"]
    assert json.loads((dest / jit.MANIFEST).read_text())["modules"] == {
        MODULE: {"target": "sm90a"}, "gptq_marlin_repack": {"target": "sm120f"}}


def _export_then_seed_on_sm120(tmp_path, monkeypatch, caplog, built_for: str):
    """A module built for ``built_for`` in the JIT cache, exported, then seeded on a compute capability 12.0 GPU
    (SGLang's JIT target sm120f); returns ``(seeded, compiled)``."""
    monkeypatch.setattr(jit, "jit_cache_dir", lambda: tmp_path / "cache")
    _cached_build(tmp_path / "cache", built_for)
    jit.export_prebuilt(tmp_path / "export")
    caplog.set_level(logging.WARNING, logger=jit.logger.name)
    return _seed(tmp_path / "export", tmp_path, monkeypatch, (12, 0, "f"))


def test_a_module_built_for_sm90a_is_not_planted_on_sm120(tmp_path, monkeypatch, caplog):
    seeded, compiled = _export_then_seed_on_sm120(tmp_path, monkeypatch, caplog, "sm90a")
    assert seeded == [] and compiled == [MODULE]
    assert not (tmp_path / "build" / f"{MODULE}.so").exists()  # SGLang compiles it; nothing of sm_90a lands
    (warning,) = _warnings(caplog)
    assert "built for sm90a (compute capability 9.0)" in warning
    assert "SGLang's JIT builds for sm120f (compute capability 12.0) here" in warning
    assert "compiling it instead" in warning


def test_the_same_target_is_seeded(tmp_path, monkeypatch, caplog):
    seeded, compiled = _export_then_seed_on_sm120(tmp_path, monkeypatch, caplog, "sm120f")
    assert seeded == [MODULE] and compiled == [] and not _warnings(caplog)
    assert (tmp_path / "build" / f"{MODULE}.so").read_bytes() == b"ELF for sm120f"


@pytest.mark.parametrize("manifest", [None, {"modules": {}}, "not json"])
def test_an_export_without_a_recorded_target_is_compiled(tmp_path, monkeypatch, caplog, manifest):
    """An export that does not say what it was built for (no manifest, the module not in it, an unreadable one):
    compiled, with one warning naming the unknown architecture and this one."""
    source = tmp_path / "export"
    source.mkdir()
    relpath, digest = _real_kernel_source()
    (source / f"{MODULE}.so").write_bytes(b"ELF")
    (source / f"{MODULE}.deps.json").write_text(json.dumps([["kernels", relpath, digest]]))
    if manifest is not None:
        (source / jit.MANIFEST).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    caplog.set_level(logging.WARNING, logger=jit.logger.name)
    seeded, compiled = _seed(source, tmp_path, monkeypatch, (9, 0, "a"))
    assert seeded == [] and compiled == [MODULE]
    (warning,) = _warnings(caplog)
    assert "built for an unknown architecture" in warning and jit.MANIFEST in warning
    assert "sm90a (compute capability 9.0)" in warning


def test_jit_target_follows_sglangs_override():
    with override_jit_cuda_arch(12, 0, "f"):
        assert jit.jit_target() == "sm120f"
    with override_jit_cuda_arch(9, 0, "a"):
        assert jit.jit_target() == "sm90a"


def test_prebuild_jit_export_writes_the_manifest(tmp_path, monkeypatch):
    """``tests/e2e/prebuild_jit.py --export`` (every built module) records the targets the same way."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
    import prebuild_jit

    monkeypatch.setattr(jit, "jit_cache_dir", lambda: tmp_path / "cache")
    _cached_build(tmp_path / "cache", "sm90a")
    _cached_build(tmp_path / "cache", "sm90a", "gptq_marlin_repack")
    assert prebuild_jit.export(tmp_path / "export") == ["gptq_marlin_repack", MODULE]
    modules = json.loads((tmp_path / "export" / jit.MANIFEST).read_text())["modules"]
    assert modules == {"gptq_marlin_repack": {"target": "sm90a"}, MODULE: {"target": "sm90a"}}
