"""What the GPU allows, in one place: every launcher sizes its launches from ``current()`` and checks them with
``check_launch`` before they reach the driver, so a launch that would not fit fails here by name, on any GPU.

Where the limits come from:

* ``from_device(index)``: the running device, read from the driver (shared memory per block and per SM, SMs,
  threads and registers per SM) and its compute capability (wgmma exists on exactly 9.0);
* ``for_arch("12.0")``: an architecture's limits without a GPU (``doctor --arch``, the CI resource test), from
  CCCL's ``cuda/__device/arch_traits.h`` and the cards' data sheets, with the SM count of the card each
  architecture is served on here (H100/H200 132, B200 148, RTX PRO 6000 Blackwell 188);
* ``KDTREE_DEVICE_PROFILE=sm_120`` (test-only): ``current()`` returns sm_120's limits on whatever GPU runs, so an
  H100/H200 picks exactly the kernel variants and launch configurations an sm_120 card would, and a launch that
  would not fit sm_120 fails there too. The profile can only narrow: it is refused on a GPU that allows less.

``record_launch`` keeps the largest shared memory any launch asked for and the variant each step chose; the worker's
startup line and ``doctor`` print ``summary()``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

__all__ = ["DeviceLimits", "LaunchDoesNotFit", "ARCHS", "PROFILE_ENV", "for_arch", "from_device", "current",
           "profile_name", "check_launch", "registers_fit", "record_launch", "launch_records", "reset_records",
           "summary"]

PROFILE_ENV = "KDTREE_DEVICE_PROFILE"


@dataclass(frozen=True)
class DeviceLimits:
    """One GPU's launch limits. ``smem_per_block`` is the opt-in maximum of dynamic plus static shared memory a
    block may ask for; ``wgmma``: Hopper's warpgroup MMA (``sm_90a`` code) runs here."""

    arch: tuple[int, int]
    smem_per_block: int
    smem_per_sm: int
    sm_count: int
    threads_per_sm: int
    registers_per_sm: int
    wgmma: bool
    source: str  # where the figures come from: "device 0 (NVIDIA H200)", "profile sm_120 on device 0 (...)", ...

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch[0]}{self.arch[1]}"

    def describe(self) -> str:
        return (f"{self.arch_name} ({self.source}): {self.smem_per_block:,} B shared memory per block "
                f"({self.smem_per_sm:,} per SM), {self.sm_count} SMs, {self.threads_per_sm} threads and "
                f"{self.registers_per_sm // 1024} K registers per SM, wgmma {'yes' if self.wgmma else 'no'}")


#: limits by compute capability without a GPU (CCCL ``arch_traits<sm_XX>``: max_shared_memory_per_block_optin,
#: max_shared_memory_per_multiprocessor, max_threads_per_multiprocessor, max_registers_per_multiprocessor); SMs of
#: the card each is served on here (H100 SXM / H200: 132; B200: 148; RTX PRO 6000 Blackwell Server Edition: 188)
ARCHS: dict[tuple[int, int], DeviceLimits] = {
    (9, 0): DeviceLimits((9, 0), 232_448, 233_472, 132, 2048, 65_536, True, "sm_90 table (H100/H200)"),
    (10, 0): DeviceLimits((10, 0), 232_448, 233_472, 148, 2048, 65_536, False, "sm_100 table (B200)"),
    (12, 0): DeviceLimits((12, 0), 101_376, 102_400, 188, 1536, 65_536, False,
                          "sm_120 table (RTX PRO 6000 Blackwell Server Edition)"),
}


class LaunchDoesNotFit(ValueError):
    """A launch asks for more than the device (or the profile) allows; the message names the kernel, what it asked
    for, the limit and where the limit comes from."""


def _parse_arch(arch) -> tuple[int, int]:
    if isinstance(arch, tuple):
        return int(arch[0]), int(arch[1])
    text = str(arch).strip().lower().removeprefix("sm_").removesuffix("a").removesuffix("f")
    try:
        if "." in text:
            major, minor = text.split(".", 1)
            return int(major), int(minor)
        return int(text[:-1]), int(text[-1])
    except ValueError:
        raise ValueError(f"architecture {arch!r} is not a compute capability like 12.0, 9.0 or sm_120") from None


def for_arch(arch) -> DeviceLimits:
    """The limits of an architecture (``"12.0"``, ``"sm_120"``, ``(12, 0)``) from the table, without a GPU."""
    key = _parse_arch(arch)
    if key not in ARCHS:
        known = ", ".join(f"{a}.{b}" for a, b in ARCHS)
        raise ValueError(f"no launch limits are known for compute capability {key[0]}.{key[1]} (known: {known})")
    return ARCHS[key]


@functools.cache
def from_device(index: int) -> DeviceLimits:
    """The running device's limits, read from the driver once per process."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    major, minor = props["major"], props["minor"]
    return DeviceLimits((major, minor), props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"],
                        props["multiProcessorCount"], props["maxThreadsPerMultiProcessor"],
                        props["regsPerMultiprocessor"], (major, minor) == (9, 0),
                        f"device {index} ({props['name'].decode(errors='replace')})")


def profile_name() -> str | None:
    """``$KDTREE_DEVICE_PROFILE`` normalised (``"sm_120"``), or None when unset."""
    raw = os.environ.get(PROFILE_ENV, "").strip()
    if not raw:
        return None
    return for_arch(raw).arch_name


@functools.cache
def _profiled(index: int, profile: str) -> DeviceLimits:
    real = from_device(index)
    limits = for_arch(profile)
    narrower = (limits.smem_per_block <= real.smem_per_block and limits.smem_per_sm <= real.smem_per_sm
                and limits.threads_per_sm <= real.threads_per_sm and (real.wgmma or not limits.wgmma))
    if not narrower:
        raise ValueError(f"{PROFILE_ENV}={profile} asks for more than {real.describe()} allows; the profile can "
                         f"only narrow a GPU's limits: unset {PROFILE_ENV} or run it on a larger GPU")
    return replace(limits, source=f"profile {profile} on {real.source}")


def current(device_index: int | None = None) -> DeviceLimits:
    """The limits every launcher sizes for: the device's, or under ``$KDTREE_DEVICE_PROFILE`` the profile's."""
    if device_index is None:
        import torch

        device_index = torch.cuda.current_device()
    profile = profile_name()
    return _profiled(device_index, profile) if profile else from_device(device_index)


def registers_fit(registers: int, threads: int, limits: DeviceLimits) -> bool:
    """Whether a block of ``threads`` at ``registers`` per thread fits one SM's register file (allocated per warp in
    units of 256 registers)."""
    per_warp = -(-registers * 32 // 256) * 256
    return per_warp * -(-threads // 32) <= limits.registers_per_sm


def check_launch(kernel: str, threads: int, dynamic_smem: int, static_smem: int, limits: DeviceLimits,
                 registers: int | None = None, fix: str = "") -> None:
    """Raise ``LaunchDoesNotFit`` unless a block of ``threads`` asking for ``dynamic_smem + static_smem`` bytes of
    shared memory (and ``registers`` per thread, when known) fits ``limits``. ``fix``: what the caller can change."""
    asked = dynamic_smem + static_smem
    problems = []
    if asked > limits.smem_per_block:
        problems.append(f"{asked:,} B of shared memory per block ({dynamic_smem:,} dynamic + {static_smem:,} static) "
                        f"> {limits.smem_per_block:,} B")
    if threads > min(1024, limits.threads_per_sm):
        problems.append(f"{threads} threads per block > {min(1024, limits.threads_per_sm)}")
    if registers is not None and not registers_fit(registers, threads, limits):
        problems.append(f"{registers} registers x {threads} threads > {limits.registers_per_sm:,} registers per SM")
    if problems:
        raise LaunchDoesNotFit(f"kernel {kernel} does not fit {limits.arch_name} ({limits.source}): "
                               + "; ".join(problems) + (f"; {fix}" if fix else ""))


_records: dict[str, tuple[str, int]] = {}  # step -> (variant, largest shared memory asked for)


def record_launch(step: str, variant: str, smem: int) -> None:
    """Note that ``step`` launched ``variant`` asking for ``smem`` bytes of shared memory (host-side, no sync); a step
    keeps its largest launch, so the summary's largest request is the process's."""
    old = _records.get(step)
    if old is None or old[1] < smem:
        _records[step] = (variant, smem)


def launch_records() -> dict[str, tuple[str, int]]:
    return dict(_records)


def reset_records() -> None:
    _records.clear()


def summary(limits: DeviceLimits) -> str:
    """One line: the limits, each step's variant (that of its largest launch) and the largest shared memory any launch
    asked for."""
    steps = ", ".join(f"{step}={variant}" for step, (variant, _) in sorted(_records.items())) or "none yet"
    largest = max((smem for _, smem in _records.values()), default=0)
    return f"{limits.describe()}; variants: {steps}; largest shared memory asked: {largest:,} B"
