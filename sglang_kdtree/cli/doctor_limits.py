"""``doctor``'s check of the launch configurations (check 6b): the variant each step of the round runs on the GPU it
judges (the device's own limits, ``KDTREE_DEVICE_PROFILE``'s, or ``--arch``'s without a GPU), and every launch
configuration for Kimi K2.6's shapes built with NVRTC for that architecture and held to its limits
(``gpu.launch_plan``): registers x threads, static + dynamic shared memory, the launch bound. Not only the compile:
a kernel that compiles but asks for more than the GPU allows fails here."""

from __future__ import annotations

from sglang_kdtree.cli.doctor_install import Report
from sglang_kdtree.gpu.limits import DeviceLimits


def variants(lim: DeviceLimits) -> dict[str, str]:
    """What each step runs on a GPU with limits ``lim``: the MLA tree-verify kernel ``$SGLANG_KDTREE_MLA_KERNEL``
    picks there, and the tree's largest budget at the drafters' usual depths."""
    from sglang_kdtree.gpu import mla_attention, tree

    out = {}
    try:
        kernel = mla_attention.choose_kernel(None, lim)
        shape = mla_attention.SHAPES[kernel]
        out["MLA verify"] = f"{kernel} ({shape.row_tile} rows x {shape.key_tile}-key stages, {shape.smem_bytes:,} B)"
    except ValueError as exc:
        out["MLA verify"] = f"refused: {exc}"
    static_smem = tree.static_smem_of_build(lim.arch_name)
    largest = {d: tree.largest_budget(d, lim, static_smem) for d in (15, 31)}
    out["tree"] = f"sized from the need; largest budget {largest[15]} at 15 draft depths, {largest[31]} at 31"
    return out


def check_launch_configurations(report: Report, lim: DeviceLimits) -> bool:
    """Report each step's variant and whether every Kimi K2.6 launch configuration fits ``lim``; False on a
    failure (or when NVRTC is missing, a warning)."""
    from sglang_kdtree.gpu import launch_plan

    try:
        for step, variant in variants(lim).items():
            report.ok(f"{step} on {lim.arch_name}: {variant}")
        checked, problems = launch_plan.check(lim)
    except RuntimeError as exc:  # NVRTC missing or failing here
        report.warn(f"launch configurations: not checked ({exc})",
                    "on the serving machine NVRTC comes with the CUDA toolkit or nvidia-cuda-nvrtc")
        return False
    if problems:
        report.fail(f"launch configurations: {len(problems)} of {len(checked)} do not fit {lim.arch_name}: "
                    + "; ".join(problems), "report it: a launcher asks for more than this GPU allows")
        return False
    largest = max(r.static_smem + launch.dynamic_smem for launch, r in checked)
    report.ok(f"launch configurations: all {len(checked)} of Kimi K2.6's fit {lim.arch_name} (largest shared memory "
              f"{largest:,} B of {lim.smem_per_block:,}; NVRTC builds, registers and shared memory from the cubins)")
    return True
