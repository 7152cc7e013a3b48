"""Shared CuPy plumbing for the kernels in ``sglang_kdtree/kernels/``: availability, source lookup, compile cache,
torch stream and zero-copy tensor exchange.

Everything here imports on a machine without a GPU or without CuPy; only calling into a kernel needs one.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import os
from pathlib import Path

__all__ = ["gpu_available", "gpu_unavailable_reason", "kernel_source", "compile_source", "load_module",
           "load_module_arch", "ARCH_SPECIFIC", "device_capability", "arch_runs_here", "as_cupy", "current_stream",
           "require_cuda", "device_ptr", "launch", "PDL", "pdl_status"]

#: kernels built for an architecture-specific target (``load_module_arch``), by source name; every other kernel
#: compiles for the device's own compute capability (``load_module``)
ARCH_SPECIFIC = {"mla_tree_verify_wgmma.cu": "sm_90a"}


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when CuPy and torch both see a CUDA device, else a one-line reason."""
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency of sglang
        return f"torch does not import: {exc}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy
    except Exception as exc:
        return f"cupy does not import ({exc}); install cupy-cuda13x"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
    except Exception as exc:
        return f"cupy cannot reach the CUDA driver: {exc}"
    return None


def gpu_available() -> bool:
    return gpu_unavailable_reason() is None


def kernels_dir() -> Path:
    """Folder of the ``.cu`` sources: the ``sglang_kdtree.kernels`` subpackage, the same folder in a checkout, an
    editable install and a wheel. Where an incomplete install lacks it, the path it should have (callers then
    report the missing sources by name)."""
    try:
        path = Path(str(importlib.resources.files("sglang_kdtree.kernels")))
    except ModuleNotFoundError:
        path = Path(__file__).resolve().parents[1] / "kernels"
    return path


def kernel_source(name: str) -> str:
    """The text of ``sglang_kdtree/kernels/<name>``."""
    path = kernels_dir() / name
    if not path.is_file():
        raise FileNotFoundError(
            f"kernel source {name!r} is missing from {path.parent}; the installation is incomplete: "
            "reinstall sglang-kdtree"
        )
    return path.read_text()


@functools.cache
def load_module(name: str, options: tuple[str, ...] = ()):
    """Compile ``sglang_kdtree/kernels/<name>`` once per process with NVRTC and return the ``cupy.RawModule``.

    ``-fmad=false`` is always passed: the tree kernels must reproduce the reference's float64 operation
    order bit for bit, and contraction into FMA would change the rounding.
    """
    import cupy

    opts = ("--std=c++17", "-fmad=false", f"-I{kernels_dir()}") + tuple(options)
    return cupy.RawModule(code=compile_source(name), options=opts, name_expressions=None)


def nvrtc_cache_key(source: str, options: tuple[str, ...]) -> str:
    """What names a compile in the kernel cache folder: the source as compiled (``compile_source``: headers'
    digest included), the NVRTC options and the NVRTC version."""
    import hashlib

    from cupy_backends.cuda.libs import nvrtc

    return hashlib.sha256("\0".join((source,) + tuple(options) + (str(nvrtc.getVersion()),)).encode()).hexdigest()[:32]


def kernel_cache_dir() -> Path:
    """CuPy's on-disk kernel cache folder (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), where the
    cubins CuPy cannot cache for us and doctor's compile-check records live beside CuPy's own."""
    import os

    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


@functools.cache
def load_module_arch(name: str, arch: str, options: tuple[str, ...] = ()):
    """``load_module`` for an architecture-specific target such as ``sm_90a`` (Hopper's wgmma), which CuPy's
    compile path cannot name (it derives ``-arch`` from the device's compute capability as an integer).

    Compiled once per process with NVRTC to a cubin, kept in CuPy's kernel cache folder under a name keyed by
    the source (headers included), the options and the NVRTC version, then loaded with ``cupy.RawModule``."""
    import os
    import tempfile

    import cupy

    from sglang_kdtree.gpu.cubin import compile_cubin

    opts = ("--std=c++17", "-fmad=false", f"-I{kernels_dir()}", f"--gpu-architecture={arch}") + tuple(options)
    key = nvrtc_cache_key(compile_source(name), opts)
    cache = kernel_cache_dir()
    path = cache / f"sglang_kdtree_{Path(name).stem}_{arch}_{key}.cubin"
    if not path.is_file():
        cubin = compile_cubin(name, arch, tuple(options))  # the same text and options: the key names this build
        cache.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: tensor-parallel ranks compiling at once never load a partial file
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    return cupy.RawModule(path=str(path))


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device, once per process."""
    import torch

    return tuple(torch.cuda.get_device_capability(device_index))


def arch_runs_here(arch: str, device_index: int | None = None) -> bool:
    """Whether a cubin for ``arch`` (``sm_90a``: exactly compute capability 9.0) loads on a GPU (default: the
    current one)."""
    if device_index is None:
        import torch

        device_index = torch.cuda.current_device()
    major, minor = device_capability(device_index)
    return arch.removesuffix("a") == f"sm_{major}{minor}"


@functools.cache
def headers_digest() -> str:
    """sha256 of every ``.cuh`` under the kernels folder (names and contents), once per process."""
    import hashlib

    h = hashlib.sha256()
    root = kernels_dir()
    for path in sorted(root.rglob("*.cuh")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def compile_source(name: str) -> str:
    """What NVRTC compiles for ``sglang_kdtree/kernels/<name>``: its text after a comment naming the digest of the
    headers.

    CuPy's on-disk kernel cache is keyed by the source text and the options, not by what the source
    ``#include``s; without the digest, an upgrade that changed only a header (``common.cuh``) would load the
    kernels compiled from the old one."""
    return f"// sglang_kdtree/kernels/*.cuh sha256 {headers_digest()}\n" + kernel_source(name)


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int):
    import warnings

    import cupy

    # CuPy 14 deprecates ExternalStream (warning on every construction) in favour of Stream.from_external,
    # which needs a stream object implementing __cuda_stream__; built once per torch stream and cached, the
    # wrapper costs nothing per launch (constructing it per call cost tens of microseconds).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle)


def current_stream():
    """torch's current CUDA stream as a (cached) CuPy stream: ``with current_stream(): kernel(...)``.

    Kernels always launch there, never on CuPy's own default stream, so they order correctly with torch's
    work and are captured by ``torch.cuda.graph``."""
    import torch

    return _external_stream(torch.cuda.current_stream().cuda_stream)


def as_cupy(t):
    """Zero-copy view of a torch CUDA tensor as a CuPy array (DLPack)."""
    import cupy

    return cupy.from_dlpack(t)


def require_cuda(name: str, t, dtypes=None) -> None:
    """Boundary check shared by every launcher: ``t`` is a torch CUDA tensor (of one of ``dtypes``)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch CUDA tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}; the kernels need a CUDA tensor: move it to the GPU (e.g. {name}.cuda())"
        )


def device_ptr(t):
    """Raw device address of a tensor (0 for None) as a kernel argument: zero-copy like DLPack, without a
    per-tensor conversion on the hot path."""
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


#: programmatic dependent launches on (``launch(..., pdl=True)``; sm_90+): ``SGLANG_KDTREE_PDL=0`` turns them off,
#: and benchmarks flip it to time both
PDL = os.environ.get("SGLANG_KDTREE_PDL", "1") != "0"

_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _arg_ctypes():
    import numpy as np

    # a kernel argument's C type by its numpy scalar type (the launchers pass numpy scalars, as CuPy takes them)
    return {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32, np.int32: ctypes.c_int32,
            np.float32: ctypes.c_float, np.float64: ctypes.c_double}


_ARG_CTYPES = _arg_ctypes()


@functools.cache
def _cu_launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` (CUDA 12.0+), or None when libcuda lacks it."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def pdl_status() -> str:
    """Whether ``launch(..., pdl=True)`` takes programmatic dependent launches on the current GPU: ``"on"``, or
    ``"off (<why>)"`` (the worker's startup line and ``doctor`` report it)."""
    import torch

    if not PDL:
        return "off (SGLANG_KDTREE_PDL=0)"
    if _cu_launch_kernel_ex() is None:
        return "off (the CUDA driver has no cuLaunchKernelEx)"
    major, minor = device_capability(torch.cuda.current_device())
    if major < 9:
        return f"off (compute capability {major}.{minor}: they need 9.0+)"
    return "on"


def _pdl_runs_here() -> bool:
    return pdl_status() == "on"


def launch(kernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, *, pdl: bool = False) -> None:
    """``kernel(grid, block, args, shared_mem=...)`` (a ``cupy.RawKernel``; numpy-scalar arguments) on torch's current
    stream.

    ``pdl``: a programmatic dependent launch (sm_90+, ``PDL`` on): the kernel's launch may begin before the previous
    kernel in the stream has finished. Only for kernels that call ``pdl_wait()`` (``sglang_kdtree/kernels/common.cuh``)
    before touching global memory, so only the launch latency moves; captured into a CUDA graph as a programmatic edge.
    Else, and on older GPUs, a plain launch."""
    if not (pdl and _pdl_runs_here()):
        with current_stream():
            kernel(grid, block, args, shared_mem=shared_mem)
        return
    import torch

    values = []
    for a in args:
        ctype = _ARG_CTYPES.get(type(a))
        if ctype is None:
            raise TypeError(f"kernel argument {a!r}: a numpy scalar of "
                            f"{sorted(t.__name__ for t in _ARG_CTYPES)} is needed")
        values.append(ctype(a.item()))
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])  # values outlive the call
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    attr = _LaunchAttribute(id=_PDL_ATTRIBUTE, value=1)
    config = _LaunchConfig(*grid, *block, int(shared_mem), torch.cuda.current_stream().cuda_stream,
                           ctypes.pointer(attr), 1)
    rc = _cu_launch_kernel_ex()(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx of {kernel.name} failed with CUresult {rc}")
