"""Every kernel, built with NVRTC for sm_120, sm_90 and sm_100 (no GPU needed), fits each architecture at the launch
configurations its launcher picks for Kimi K2.6's shapes (``sglang_kdtree.gpu.launch_plan``): registers x threads
within the SM's register file, static + dynamic shared memory within the per-block opt-in, threads within the launch
bound. A deliberately oversized configuration fails the same check. The wgmma MLA kernel exists for sm_90a only and
is skipped by name elsewhere."""

from __future__ import annotations

import pathlib

import pytest

from sglang_kdtree.gpu import launch_plan, limits, runtime

ARCHS = ("12.0", "9.0", "10.0")


@pytest.fixture(scope="module", autouse=True)
def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy or libnvrtc missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")


def _sources() -> list[str]:
    root = pathlib.Path(runtime.kernels_dir())
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.cu"))


@pytest.mark.parametrize("arch", ARCHS)
def test_kimi_launches_fit(arch):
    checked, problems = launch_plan.check(arch)
    assert not problems, "\n".join(problems)
    lim = limits.for_arch(arch)
    for launch, res in checked:  # the check's arithmetic, redone here from the raw figures
        assert res.static_smem + launch.dynamic_smem <= lim.smem_per_block, launch
        assert -(-res.registers * 32 // 256) * 256 * -(-launch.threads // 32) <= lim.registers_per_sm, launch
        assert launch.threads <= 1024 and (not res.max_threads or launch.threads <= res.max_threads), launch


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", _sources())
def test_every_kernel_of_every_source_is_planned(arch, source):
    """No kernel escapes the check: each function NVRTC builds from each source is one of the plan's launches."""
    from sglang_kdtree.gpu import cubin

    lim = limits.for_arch(arch)
    own = runtime.ARCH_SPECIFIC.get(source)
    if own is not None and own.removesuffix("a") != lim.arch_name:
        pytest.skip(f"{source} exists for {own} only, not {lim.arch_name}")
    planned = {launch.function for launch in launch_plan.kimi_launches(lim) if launch.source == source}
    if not planned:  # e.g. the mma MLA kernel on sm_120: refused there (155,648 B), auto picks mma_compact
        pytest.skip(f"no launcher picks a kernel of {source} on {lim.arch_name}")
    options = {launch.options for launch in launch_plan.kimi_launches(lim) if launch.source == source} or {()}
    for opts in options:
        built = set(cubin.resources_of(source, own or lim.arch_name, opts))
        assert built <= planned, f"{source} {opts}: {sorted(built - planned)} are built but not in the launch plan"


def test_the_sm120_plan_takes_the_sm120_variants():
    plan = launch_plan.kimi_launches(limits.for_arch("12.0"))
    mla = [launch for launch in plan if launch.function.endswith("_i64") and "mla" in launch.function]
    assert len(mla) == 1 and mla[0].function == "mla_tree_verify_compact_i64" and mla[0].threads == 192 and mla[0].dynamic_smem == 99_584
    assert not any("wgmma" in launch.function for launch in plan)
    tree = {launch.function: launch.dynamic_smem for launch in plan if launch.step == "tree"}
    # the slot kernel at the largest budget that fits each depth: 17 depths x 984 floats is the most (31 x 539 at 31)
    assert tree["build_trees_kernel"] == max(d * min(1024, (101_376 - 34_464) // (4 * d)) * 4 for d in range(1, 32))
    assert tree["build_trees_kernel"] == 17 * 984 * 4


@pytest.mark.parametrize("oversized", [
    # the default mma shape (155,648 B) on sm_120: what the server launched there before the compact shape
    launch_plan.Launch("mla_verify", "mla_tree_verify.cu", "mla_tree_verify_i64", 256, 155_648),
    # a tree at budget 1,024 with 31 draft depths: 126,976 B of candidates + 34,464 static
    launch_plan.Launch("tree", "best_first_tree.cu", "build_trees_kernel", 128, 31 * 1024 * 4),
    # the greedy accept past its __launch_bounds__ (512)
    launch_plan.Launch("accept", "tree_accept.cu", "accept_greedy_bf16", 1024),
])
def test_an_oversized_configuration_fails(oversized):
    _, problems = launch_plan.check("12.0", [oversized])
    assert len(problems) == 1 and oversized.function in problems[0], problems


def test_doctor_reports_the_variants_and_the_fit_for_its_arch():
    import io

    from sglang_kdtree.cli.doctor_install import Report
    from sglang_kdtree.cli.doctor_limits import check_launch_configurations

    report = Report(out=io.StringIO())
    assert check_launch_configurations(report, limits.for_arch("12.0"))
    text = report.out.getvalue()
    assert "MLA verify on sm_120: mma_compact (48 rows x 16-key stages, 99,584 B)" in text
    assert "largest budget 1024 at 15 draft depths, 539 at 31" in text
    assert "fit sm_120" in text and "FAIL" not in text
    report = Report(out=io.StringIO())
    assert check_launch_configurations(report, limits.for_arch("9.0"))
    assert "MLA verify on sm_90: wgmma" in report.out.getvalue()
