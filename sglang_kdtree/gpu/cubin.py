"""Per-kernel resources (registers, static shared memory, local memory, launch bound) of the kernels under
``sglang_kdtree/kernels/``, read from the cubin NVRTC builds for a named architecture.

Nothing here needs a GPU: NVRTC compiles for any architecture it knows, and the cubin is parsed as an ELF64 file
with ``struct`` alone. The numbers are the ones ptxas wrote into the cubin: the driver's ``cuFuncGetAttribute``
(``NUM_REGS``, ``SHARED_SIZE_BYTES``, ``LOCAL_SIZE_BYTES``) reports the same for a loaded kernel, and
``cuobjdump -res-usage`` prints them too (its ``SHARED`` with the reserved bytes below), for an architecture the
machine may not have.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass

from sglang_kdtree.gpu import runtime

__all__ = ["KernelResources", "compile_cubin", "kernel_resources", "resources_of", "RESERVED_SMEM"]

#: shared memory the system reserves in every block (``cudaDevAttrReservedSharedMemoryPerBlock``): cubins for sm_90
#: and newer count it in each kernel's ``.nv.shared.<name>`` section, older ones leave it to the driver
RESERVED_SMEM = 1024


@dataclass(frozen=True)
class KernelResources:
    """What one kernel takes per thread and per block, as ptxas allocated it.

    ``static_smem`` counts the kernel's own ``__shared__`` variables only: neither dynamic shared memory nor the
    ``RESERVED_SMEM`` bytes the system keeps in every block (add both for a block's footprint).
    ``local_bytes`` is the per-thread stack (spills, local arrays, callees' frames) plus any static local memory.
    ``max_threads`` is the ``__launch_bounds__`` maximum (x*y*z), 0 where the kernel declares none."""

    name: str
    registers: int
    static_smem: int
    local_bytes: int
    max_threads: int


def _whole_cubin(nvrtc, prog: int) -> bytes:
    """The compiled program's cubin, every byte of it.

    CuPy's ``nvrtc.getCUBIN`` strips a trailing NUL as it does for PTX, which leaves the ELF one byte short (its
    last program header ends past the file, and cuobjdump refuses the file); NVRTC's own calls give its size."""
    lib = ctypes.CDLL(f"libnvrtc.so.{nvrtc.getVersion()[0]}")  # the copy CuPy has loaded, found by its soname
    handle = ctypes.c_void_p(prog)
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(handle, ctypes.byref(size)) != 0:
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(handle, buf) != 0:
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


@functools.cache
def compile_cubin(source_name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin of ``sglang_kdtree/kernels/<source_name>`` for ``arch`` (``"sm_90"``, ``"sm_90a"``, ``"sm_120"``),
    compiled as the runtime compiles it (``runtime.load_module_arch``: the same text and options, then ``options``),
    once per process.

    Raises ValueError for a source that ``runtime.ARCH_SPECIFIC`` ties to another architecture, and RuntimeError
    naming the source, the architecture and NVRTC's log when NVRTC cannot compile it."""
    own = runtime.ARCH_SPECIFIC.get(source_name)
    if own is not None and own != arch:
        raise ValueError(f"sglang_kdtree/kernels/{source_name} compiles for {own} only, not {arch}")
    from cupy_backends.cuda.libs import nvrtc

    opts = ("--std=c++17", "-fmad=false", f"-I{runtime.kernels_dir()}", f"--gpu-architecture={arch}") + tuple(options)
    prog = nvrtc.createProgram(runtime.compile_source(source_name), source_name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC could not compile sglang_kdtree/kernels/{source_name} for {arch}: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return _whole_cubin(nvrtc, prog)
    finally:
        nvrtc.destroyProgram(prog)


# ELF64 little-endian layouts: file header, section header, symbol
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10  # st_other bit of a kernel (a __global__ entry point), not set on device functions

# .nv.info record formats: the value of every format but SVAL lies in the record's 4-byte header
_EIFMT_SVAL = 0x04
_EIFMT_KNOWN = {0x01, 0x02, 0x03, _EIFMT_SVAL}  # NVAL (none), BVAL (u8), HVAL (u16), SVAL (u16 size, then bytes)
# attributes read here; in the file-wide .nv.info each is an SVAL of (u32 symbol index, u32 value)
_EIATTR_MAX_THREADS = 0x05  # per kernel's .nv.info.<name>: u32 x, y, z of __launch_bounds__
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12  # the stack a kernel needs with its callees' frames
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2f


def _cstr(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode()


def _records(data: bytes):
    """``(attribute, payload)`` for each record of a ``.nv.info`` section."""
    off = 0
    while off + 4 <= len(data):
        fmt, attr, value = struct.unpack_from("<BBH", data, off)
        if fmt not in _EIFMT_KNOWN:
            raise ValueError(f"unknown .nv.info record format {fmt:#x} at offset {off}")
        if fmt == _EIFMT_SVAL:
            yield attr, data[off + 4:off + 4 + value]
            off += 4 + value
        else:
            yield attr, data[off + 2:off + 4]
            off += 4


def _sym_values(data: bytes) -> dict[int, dict[int, int]]:
    """The file-wide ``.nv.info``'s per-function attributes: ``{attribute: {symbol index: value}}``."""
    out: dict[int, dict[int, int]] = {}
    for attr, payload in _records(data):
        if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE, _EIATTR_MIN_STACK_SIZE, _EIATTR_MAX_STACK_SIZE):
            sym, value = struct.unpack_from("<II", payload)
            out.setdefault(attr, {})[sym] = value
    return out


def _reserved_smem(symbols, names) -> int:
    """Bytes of system-reserved shared memory the cubin lays out in each kernel's ``.nv.shared.<name>``: none
    without ``.nv.reservedSmem`` symbols (sm_80 and older), their ``.cap`` where one is given (sm_100, sm_120),
    else ``RESERVED_SMEM`` (sm_90)."""
    found = [(name, sym[4]) for sym, name in zip(symbols, names) if name.startswith(".nv.reservedSmem")]
    if not found:
        return 0
    return next((value for name, value in found if name == ".nv.reservedSmem.cap"), RESERVED_SMEM)


def kernel_resources(cubin: bytes) -> dict[str, KernelResources]:
    """Every kernel (``__global__`` entry point) of an ELF64 cubin and its resources, by symbol name.

    Registers come from ``EIATTR_REGCOUNT`` (the ``.text.<name>`` section's ``sh_info`` holds only the kernel's
    symbol index in the cubins of CUDA 12.9 and 13), static shared memory from the ``.nv.shared.<name>`` section's
    size, less the reserved bytes where the cubin lays them out there (sm_90 and newer: the ``.nv.reservedSmem``
    symbols), local memory from the stack attributes plus ``.nv.local.<name>``, and the launch bound from
    ``EIATTR_MAX_THREADS``.
    Raises ValueError for a file that is not an ELF64 little-endian cubin or lacks a kernel's register count."""
    if len(cubin) < _EHDR.size or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not an ELF64 little-endian cubin")
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, shstrndx) = _EHDR.unpack_from(cubin)
    headers = [_SHDR.unpack_from(cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    # name -> (type, file offset, size, link); a NOBITS section's size is real, its bytes absent from the file
    sections = {_cstr(cubin, names_at + h[0]): (h[1], h[4], h[5], h[6]) for h in headers}

    def data(name: str) -> bytes:
        _, offset, size, _ = sections[name]
        return cubin[offset:offset + size]

    symtab = sections[".symtab"]
    strings_at = headers[symtab[3]][4]
    symbols = [_SYM.unpack_from(cubin, symtab[1] + i * _SYM.size) for i in range(symtab[2] // _SYM.size)]
    symbol_names = [_cstr(cubin, strings_at + s[0]) for s in symbols]
    reserved = _reserved_smem(symbols, symbol_names)
    values = _sym_values(data(".nv.info")) if ".nv.info" in sections else {}

    out = {}
    for index, ((_, info, other, _, _, _), name) in enumerate(zip(symbols, symbol_names)):
        if info & 0xf != _STT_FUNC or not other & _STO_CUDA_ENTRY:
            continue
        registers = values.get(_EIATTR_REGCOUNT, {}).get(index)
        if registers is None:
            raise ValueError(f"kernel {name} has no EIATTR_REGCOUNT in the cubin's .nv.info")
        stack = max(values.get(attr, {}).get(index, 0)
                    for attr in (_EIATTR_FRAME_SIZE, _EIATTR_MIN_STACK_SIZE, _EIATTR_MAX_STACK_SIZE))
        local = sections.get(f".nv.local.{name}", (0, 0, 0, 0))[2]
        shared = sections.get(f".nv.shared.{name}", (0, 0, 0, 0))[2]
        max_threads = 0
        if f".nv.info.{name}" in sections:
            for attr, payload in _records(data(f".nv.info.{name}")):
                if attr == _EIATTR_MAX_THREADS:
                    x, y, z = struct.unpack_from("<III", payload)
                    max_threads = x * y * z
        out[name] = KernelResources(name=name, registers=registers, static_smem=max(shared - reserved, 0),
                                    local_bytes=stack + local, max_threads=max_threads)
    return out


def resources_of(source_name: str, arch: str, options: tuple[str, ...] = ()) -> dict[str, KernelResources]:
    """``kernel_resources(compile_cubin(source_name, arch, options))``: the kernels of one source for one
    architecture (ValueError for an architecture-specific source asked for another architecture)."""
    return kernel_resources(compile_cubin(source_name, arch, tuple(options)))
