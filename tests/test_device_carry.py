"""CPU test of ``device/device_carry.py``: the slimmed sglang wheel drops exactly the listed paths, from the
archive and from its RECORD, and keeps every other file byte for byte; the folder limit is enforced."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("device_carry", REPO / "device" / "device_carry.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FILES = {
    "sglang/__init__.py": b"x = 1\n",
    "sglang/srt/rust_extensions/__init__.py": b"",
    "sglang/srt/rust_extensions/loader.py": b"def load(): ...\n",
    "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": b"\0" * 4096,
    "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so": b"\1" * 2048,
    "sglang/multimodal_gen/test/test_a.py": b"def test(): ...\n",
    "sglang/multimodal_gen/runtime/keep.py": b"keep = True\n",
}


def _wheel(path: Path) -> Path:
    record = "".join(f"{name},sha256=abc,{len(data)}\n" for name, data in FILES.items())
    record += "sglang-0.5.23.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in FILES.items():
            z.writestr(name, data)
        z.writestr("sglang-0.5.23.dist-info/RECORD", record)
    return path


def test_slim_sglang_wheel_drops_only_the_listed_paths(tmp_path):
    dc = _load()
    src = _wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl")
    dest = tmp_path / "out.whl"
    dropped = dc.slim_sglang_wheel(src, dest)
    assert dropped > 0
    with zipfile.ZipFile(dest) as z:
        names = set(z.namelist())
        record = z.read("sglang-0.5.23.dist-info/RECORD").decode()
        kept = {n: z.read(n) for n in names if not n.endswith("RECORD")}
    gone = {n for n in FILES if n.startswith(dc.DROP_IN_SGLANG)}
    assert gone == {"sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so",
                    "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so",
                    "sglang/multimodal_gen/test/test_a.py"}
    assert kept == {n: d for n, d in FILES.items() if n not in gone}
    assert not any(line.startswith(tuple(gone)) for line in record.splitlines())
    assert "sglang/srt/rust_extensions/loader.py,sha256=abc" in record


def test_build_skips_jedi_and_refuses_more_than_the_limit(tmp_path):
    dc = _load()
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl")
    (wheels / "jedi-0.20.1-py2.py3-none-any.whl").write_bytes(b"j" * 100)
    (wheels / "orjson-3.13.0-cp312-cp312-any.whl").write_bytes(b"o" * 100)
    jit = tmp_path / "jit"
    jit.mkdir()
    (jit / "mod.so").write_bytes(b"m" * 1000)
    out = tmp_path / "carry"
    total = dc.build(out, [wheels], jit, tmp_path / "none", tmp_path / "none2", limit=1.0)
    assert 0 < total < 1.0
    assert sorted(p.name for p in (out / "whl").iterdir()) == [
        "orjson-3.13.0-cp312-cp312-any.whl", "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"]
    assert (out / "jit" / "mod.so").read_bytes() == b"m" * 1000
    (jit / "big.so").write_bytes(b"b" * (2 * 2**20))
    with pytest.raises(SystemExit, match="over the 1.0 MiB limit"):
        dc.build(out, [wheels], jit, tmp_path / "none", tmp_path / "none2", limit=1.0)
    assert not out.exists()
