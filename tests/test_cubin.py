"""``sglang_kdtree.gpu.cubin`` on a machine without a GPU: every kernel source compiles with NVRTC to a cubin for
sm_90, sm_100 and sm_120 (an architecture-specific source for its own target only), and the resources read from
each cubin are checked against computations that share no code with the parser: the kernel names and launch
bounds the source text declares, ``cuobjdump -res-usage`` where one is installed, and a synthetic kernel whose
shared memory, stack and launch bound are known by hand."""

from __future__ import annotations

import glob
import importlib.util
import multiprocessing
import os
import re
import shutil
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy (and its NVRTC bindings) is not installed")
try:
    nvrtc.getVersion()
except Exception as exc:  # libnvrtc missing on this machine
    pytest.skip(f"NVRTC unavailable: {exc}", allow_module_level=True)

from sglang_kdtree.gpu import cubin, runtime  # noqa: E402

ARCHS = ("sm_90", "sm_100", "sm_120")
KERNELS_DIR = Path(runtime.kernels_dir())
SOURCES = sorted(p.relative_to(KERNELS_DIR).as_posix()
                 for p in [*KERNELS_DIR.glob("*.cu"), *KERNELS_DIR.glob("moe/*.cu")])
#: (source, arch) pairs compiled here: an architecture-specific source for its own target only
TARGETS = [(name, arch) for name in SOURCES
           for arch in ((runtime.ARCH_SPECIFIC[name],) if name in runtime.ARCH_SPECIFIC else ARCHS)]


@pytest.fixture(scope="module")
def cubins() -> dict[tuple[str, str], bytes]:
    """Every target's cubin. NVRTC holds the GIL and one process compiles one program at a time, so the targets
    are spread over worker processes (the largest sources first, so the workers finish together): CI's 2 cores
    halve the ~90 s the 34 compiles take in one process."""
    order = sorted(TARGETS, key=lambda t: -(KERNELS_DIR / t[0]).stat().st_size)
    workers = min(2, os.cpu_count() or 1)
    # spawn, not fork: the parent has CuPy loaded, and a forked CUDA library is unsafe
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        built = pool.map(cubin.compile_cubin, [t[0] for t in order], [t[1] for t in order])
        return dict(zip(order, built))


# -- the kernels a source declares, from its text ---------------------------------------------------------------

_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)(.*)$", re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+((?:(?:void|__\w+__\s*\([^()]*\))\s*)+)\s*(\w+)\s*\(')


def _call_args(text: str, i: int) -> tuple[list[str], int]:
    """The comma-separated arguments of a macro call whose ``(`` is at ``text[i - 1]``, and the index past its ``)``."""
    args, depth, start = [], 0, i
    while True:
        ch = text[i]
        if ch == '"':
            i = text.index('"', i + 1)
        elif ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch in ",)" and not depth:
            args.append(text[start:i].strip())
            if ch == ")":
                return args, i + 1
            start = i + 1
        i += 1


def _expand(text: str, macros: dict[str, tuple[list[str], str]]) -> str:
    """``text`` with each call of ``macros`` replaced by its body: parameters substituted (outside string
    literals), ``##`` pasted, and nested calls expanded in turn."""
    call = re.compile(r"\b(" + "|".join(map(re.escape, macros)) + r")\s*\(") if macros else None
    out, pos = [], 0
    while call and (m := call.search(text, pos)):
        args, end = _call_args(text, m.end())
        params, body = macros[m[1]]
        bound = dict(zip(params, args))
        body = re.sub(r'"[^"]*"|\b\w+\b', lambda t: bound.get(t[0], t[0]), body)
        out += [text[pos:m.start()], _expand(re.sub(r"\s*##\s*", "", body), macros)]
        pos = end
    return "".join(out) + text[pos:]


def declared_kernels(name: str) -> dict[str, bool]:
    """The ``extern "C" __global__`` functions ``sglang_kdtree/kernels/<name>`` declares, directly or through a
    function-like macro of its own or of a header beside it, each mapped to whether it declares
    ``__launch_bounds__``: a preprocessor of the few features the kernels use, not NVRTC's."""
    text = (KERNELS_DIR / name).read_text().replace("\\\n", " ")
    headers = " ".join(p.read_text().replace("\\\n", " ") for p in sorted(KERNELS_DIR.glob("*.cuh")))
    defined = {m[1]: ([p.strip() for p in m[2].split(",")], m[3]) for m in _DEFINE.finditer(headers + "\n" + text)}
    # only macros that stamp out kernels (directly or through another such macro) are expanded
    makers: dict[str, tuple[list[str], str]] = {}
    while True:
        more = {k: v for k, v in defined.items() if k not in makers
                and ("__global__" in v[1] or any(re.search(rf"\b{m}\s*\(", v[1]) for m in makers))}
        if not more:
            break
        makers.update(more)
    code = _expand(_DEFINE.sub("", text), makers)
    return {m[2]: "__launch_bounds__" in m[1] for m in _KERNEL.finditer(code)}


def test_declared_kernels_expands_macros():
    """The text-side computation itself: kernels stamped out by nested, pasting macros are found."""
    found = declared_kernels("topk_histogram.cu")
    assert {"hist_pass_bf16_v8", "hist_select_logprobs_bf16_v8", "hist_select_partials_wide_f32_v1"} <= set(found)
    assert set(declared_kernels("gather_hidden.cu")) == {"gather_hidden_16B", "gather_hidden_4B", "gather_hidden_2B"}
    assert all(declared_kernels("kv_compact.cu")[k] for k in ("compact_kv_16B", "compact_kv_1B"))


@pytest.mark.parametrize("target", TARGETS, ids=[f"{a}-{n}" for n, a in TARGETS])
def test_every_declared_kernel_is_read_from_the_cubin(cubins, target):
    name, arch = target
    resources = cubin.kernel_resources(cubins[target])
    declared = declared_kernels(name)
    assert declared, f"no kernel found in the text of {name}"
    assert set(resources) == set(declared), f"{name} for {arch}"
    for kernel, bounded in declared.items():
        r = resources[kernel]
        assert r.name == kernel and 1 <= r.registers <= 255, r
        assert r.static_smem >= 0 and r.local_bytes >= 0, r
        assert (r.max_threads > 0) == bounded and r.max_threads <= 1024, r


def test_arch_specific_source_compiles_for_its_own_arch_only():
    for name, own in runtime.ARCH_SPECIFIC.items():
        for arch in {"sm_90", "sm_120"} - {own}:
            with pytest.raises(ValueError, match=own):
                cubin.resources_of(name, arch)


def test_resources_of_compiles_with_the_runtime_options():
    # a -D reaching NVRTC changes what compiles: the extra options are passed on after the runtime's
    base = cubin.resources_of("moe/silu_and_mul.cu", "sm_90")
    assert base.keys() == declared_kernels("moe/silu_and_mul.cu").keys()
    with pytest.raises(RuntimeError, match=r"(?s)moe/silu_and_mul\.cu for sm_90.*error"):
        cubin.compile_cubin("moe/silu_and_mul.cu", "sm_90", ("-Dbf16_t=not a type",))


def test_rejects_a_file_that_is_not_a_cubin():
    with pytest.raises(ValueError, match="ELF64"):
        cubin.kernel_resources(b"\x7fELF\x01\x01" + bytes(64))


# -- hand-computed numbers ----------------------------------------------------------------------------------------

SYNTHETIC = r"""
extern "C" __global__ void __launch_bounds__(192) shared_1000(float* out) {
  __shared__ float buf[1000];
  for (int i = threadIdx.x; i < 1000; i += blockDim.x) buf[i] = out[i];
  __syncthreads();
  out[threadIdx.x] = buf[999 - threadIdx.x];
}
extern "C" __global__ void stack_64(const int* in, int* out) {
  int scratch[64];  // indexed by values read at run time, so not in registers: 256 bytes of stack
  for (int i = 0; i < 64; ++i) scratch[in[i] & 63] = i;
  out[threadIdx.x] = scratch[in[64 + threadIdx.x] & 63];
}
extern "C" __global__ void plain(int* out) { out[threadIdx.x] += 1; }
"""


@pytest.mark.parametrize("arch", ("sm_80", *ARCHS))
def test_synthetic_kernel_numbers(arch):
    prog = nvrtc.createProgram(SYNTHETIC, "synthetic.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}"])
        data = nvrtc.getCUBIN(prog)  # CuPy's copy lacks the file's last byte; the parser never reads that far
    finally:
        nvrtc.destroyProgram(prog)
    r = cubin.kernel_resources(data)
    assert set(r) == {"shared_1000", "stack_64", "plain"}
    assert (r["shared_1000"].static_smem, r["shared_1000"].max_threads, r["shared_1000"].local_bytes) == (4000, 192, 0)
    assert (r["stack_64"].static_smem, r["stack_64"].max_threads, r["stack_64"].local_bytes) == (0, 0, 256)
    assert (r["plain"].static_smem, r["plain"].max_threads, r["plain"].local_bytes) == (0, 0, 0)


# -- cuobjdump ----------------------------------------------------------------------------------------------------

def _cuobjdump() -> str | None:
    """A cuobjdump: on PATH, in a CUDA toolkit, or the one Triton's NVIDIA backend ships (Triton is in the CPU
    install, so CI has one without a toolkit)."""
    found = shutil.which("cuobjdump") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))), None)
    if found:
        return found
    spec = importlib.util.find_spec("triton")  # located, not imported
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _res_usage(tool: str, path: Path) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage``: ``{kernel: {"REG": n, "STACK": n, "SHARED": n, "LOCAL": n, ...}}``."""
    text = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {m[1]: {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", m[2])}
            for m in re.finditer(r"Function (\S+):\n(.*)", text)}


@pytest.mark.parametrize("arch", ARCHS)
def test_cuobjdump_agrees(cubins, arch, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump on PATH, under /usr/local/cuda*/bin or in Triton's NVIDIA backend")
    compared = 0
    for (name, target_arch), data in cubins.items():
        if target_arch.removesuffix("a") != arch:
            continue
        path = tmp_path / f"{Path(name).stem}.cubin"
        path.write_bytes(data)
        usage = _res_usage(tool, path)
        resources = cubin.kernel_resources(data)
        assert set(usage) == set(resources), name
        for kernel, r in resources.items():
            u = usage[kernel]
            assert r.registers == u["REG"], (name, kernel, u)
            assert r.local_bytes == u["STACK"] + u["LOCAL"], (name, kernel, u)
            # sm_90 and newer lay the system's reserved 1 KiB out in every shared section a kernel has
            assert u["SHARED"] == (r.static_smem + cubin.RESERVED_SMEM if u["SHARED"] else 0), (name, kernel, u)
            compared += 1
    assert compared >= len(SOURCES)
