"""Pack what a CUDA-server run on the GPU machine needs into one folder that fits its 64 MiB carry.

``device/device_server.sh`` needs SGLang's pure-Python wheels (``.whl``, from
``../shared/device/fetch-sglang-wheels.sh``), the server's extra wheels (``.whl-server``), and, for the
Kimi-shaped W4A16 target, SGLang's Marlin JIT modules prebuilt for sm_90a (``.jitcache/sm90a``, from
``tests/e2e/prebuild_jit.py --export``): 51 + 6.7 + 11 MiB, over the carry. This writes ``.dev-carry/``:

* ``whl/``: every wheel of both lists except ``jedi`` (IPython's completer; nothing a server runs imports it),
  with the ``sglang`` wheel rewritten without the native Rust extensions of paths these servers never take
  (``sglang/srt/rust_extensions/_{server,grpc,bench,multimodal}*.so``: the Rust HTTP server, gRPC mode, the
  benchmark client and multimodal processors; 17.6 MiB) and without ``sglang/multimodal_gen/test``. Both
  are dropped from the wheel's RECORD too. Nothing else in any wheel changes.
* ``jit/``: the prebuilt JIT modules (seeded by ``prebuild_jit.py --seed``, which checks each against its
  sources and compiles whatever does not match);
* ``jitcache-server.tar.gz`` when it exists and fits; ``tiny_models/`` only with ``--tiny-models`` (the
  committed ``tests/e2e/tiny_models`` travel with the working tree).

    python device/device_carry.py            # then run(..., carry=[".dev-carry"])

It prints the folder's size; the script refuses to write more than ``--limit`` MiB (default 62).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DROP_WHEELS = ("jedi-",)
DROP_IN_SGLANG = ("sglang/srt/rust_extensions/_server", "sglang/srt/rust_extensions/_grpc",
                  "sglang/srt/rust_extensions/_bench", "sglang/srt/rust_extensions/_multimodal",
                  "sglang/multimodal_gen/test/")


def slim_sglang_wheel(src: Path, dest: Path) -> int:
    """Copy the sglang wheel without DROP_IN_SGLANG (files and RECORD lines); returns bytes dropped."""
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(DROP_IN_SGLANG):
                dropped += info.compress_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not ln.startswith(DROP_IN_SGLANG)).encode()
            zout.writestr(info, data)
    return dropped


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def build(out: Path, wheel_dirs: list[Path], jit: Path, jit_server: Path, tiny: Path | None, limit: float) -> float:
    if out.exists():
        shutil.rmtree(out)
    (out / "whl").mkdir(parents=True)
    for d in wheel_dirs:
        for whl in sorted(d.glob("*.whl")):
            if whl.name.startswith(DROP_WHEELS):
                continue
            if whl.name.startswith("sglang-"):
                dropped = slim_sglang_wheel(whl, out / "whl" / whl.name)
                print(f"{whl.name}: dropped {dropped / 2**20:.1f} MiB (rust extensions, multimodal_gen tests)")
            else:
                shutil.copy2(whl, out / "whl" / whl.name)
    if jit.is_dir():
        shutil.copytree(jit, out / "jit")
    for extra, name in ((jit_server / "jitcache-server.tar.gz", "jitcache-server.tar.gz"), (tiny, "tiny_models")):
        if extra is None or not extra.exists():
            continue
        extra_mib = size_mib(extra) if extra.is_dir() else extra.stat().st_size / 2**20
        if size_mib(out) + extra_mib > limit:
            print(f"skipped {extra} ({extra_mib:.1f} MiB): over {limit} MiB")
            continue
        (shutil.copytree if extra.is_dir() else shutil.copy2)(extra, out / name)
    total = size_mib(out)
    if total > limit:
        shutil.rmtree(out)
        raise SystemExit(f"{out}: {total:.1f} MiB is over the {limit} MiB limit; removed")
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / ".dev-carry")
    p.add_argument("--wheels", type=Path, nargs="+", default=[REPO / ".whl", REPO / ".whl-server"])
    p.add_argument("--jit", type=Path, default=REPO / ".jitcache" / "sm90a")
    p.add_argument("--jit-server", type=Path, default=REPO / ".jitcache-server")
    p.add_argument("--tiny-models", type=Path, default=None,
                   help="a tiny-model build other than the committed tests/e2e/tiny_models")
    p.add_argument("--limit", type=float, default=62.0, help="MiB (the carry is 64 MiB with the working tree)")
    a = p.parse_args(argv)
    total = build(a.out, a.wheels, a.jit, a.jit_server, a.tiny_models, a.limit)
    print(f"{a.out}: {total:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
