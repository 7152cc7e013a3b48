"""Writes .ci/requirements-cpu.txt: the exact set CI installs on a CPU-only machine.

Run it inside a full install (``pip install -e '.[test]'``, what users and the GPU machine get). It keeps every
distribution reachable from ``sglang-kdtree[test]`` through installed requirements, except the subtrees of
GPU_ONLY: binary CUDA kernel libraries that nothing imports on a machine without a GPU (no test, no server
path on CPU). Dropping them takes the CI venv from ~11 GB to ~8.7 GB, so CI fits a smaller disk (a CI run
failed with ENOSPC while installing the full set). sglang-kernel stays: a CPU test reads its pure-Python
scalar_type.py. CI installs the file with ``pip install --no-deps``; tests/test_ci_lock.py checks it against
the installed SGLang's requirements.

    python .ci/lock_cpu.py            # rewrites .ci/requirements-cpu.txt
"""
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

GPU_ONLY = ("flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "tilelang", "nvidia-mathdx",
            "humming-kernels", "nvshmem4py-cu13", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
            "quack-kernels")
LOCK = Path(__file__).with_name("requirements-cpu.txt")
HEADER = """\
# Written by .ci/lock_cpu.py from a full `pip install -e '.[test]'` on {date} (Python {py}).
# Installed by .ci/run with `pip install --no-deps -r`. Left out (with what only they pull in):
# {excluded}
"""


def requirements(dist, extras=()):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("",) + tuple(extras)):
            continue
        yield canonicalize_name(req.name), tuple(req.extras)


def closure(root="sglang-kdtree", extras=("test",), excluded=GPU_ONLY):
    dists = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    skip = {canonicalize_name(n) for n in excluded}
    seen, stack = set(), [(canonicalize_name(root), extras)]
    while stack:
        name, ex = stack.pop()
        if name in skip or (name, ex) in seen:
            continue
        if name not in dists:
            sys.exit(f"lock_cpu: {name} is required but not installed; run this inside a full install")
        seen.add((name, ex))
        stack.extend(requirements(dists[name], ex))
    keep = {n for n, _ in seen} - {canonicalize_name(root)}
    return {n: dists[n].version for n in keep}


def main():
    import datetime
    pins = closure()
    LOCK.write_text(HEADER.format(date=datetime.date.today(), py=sys.version.split()[0],
                                  excluded=", ".join(GPU_ONLY))
                    + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print(f"{LOCK}: {len(pins)} distributions")


if __name__ == "__main__":
    main()
