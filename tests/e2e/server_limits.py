"""What a CUDA KDTREE server's log says of the GPU's limits (its ``KDTREE launch limits:`` line, written by
``sglang_kdtree.server.prewarm.log_launch_limits``), and whether every KDTREE server of a probe kept within a
``KDTREE_DEVICE_PROFILE`` (``tests/e2e/cuda_servers.py`` reads both)."""

from __future__ import annotations


def launch_limits(log: str) -> dict | None:
    """A KDTREE server's ``KDTREE launch limits:`` line (``gpu.limits.summary``): the line, the variant each step
    ran and the largest shared memory any launch asked for; None when the log has none."""
    import re

    line = next((x.split("KDTREE launch limits: ", 1)[1] for x in log.splitlines() if "KDTREE launch limits: " in x),
                None)
    if line is None:
        return None
    variants_ = dict(re.findall(r"(\w+)=(\w+)", line.split("variants: ", 1)[1].split(";")[0]))
    largest = int(re.search(r"largest shared memory asked: ([\d,]+) B", line).group(1).replace(",", ""))
    return {"line": line, "variants": variants_, "largest_smem": largest, "arch": line.split(" ", 1)[0]}


def profile_holds(summary: dict, profile: str) -> list[str]:
    """Under ``KDTREE_DEVICE_PROFILE=profile``, what every KDTREE server's log must show: its limits line for that
    architecture, no wgmma variant, and no launch asking for more shared memory than the profile allows."""
    from sglang_kdtree.gpu import limits

    lim = limits.for_arch(profile)
    problems = []
    for name, rec in summary["servers"].items():
        if "kdtree" not in name:
            continue
        got = rec.get("launch_limits")
        if got is None:
            problems.append(f"{name}: no 'KDTREE launch limits' line in its log")
            continue
        if got["arch"] != lim.arch_name or any("wgmma" in v for v in got["variants"].values()) \
                or got["largest_smem"] > lim.smem_per_block or "wgmma" in rec.get("mla_kernels", []):
            problems.append(f"{name}: {got['line']} (MLA kernels {rec.get('mla_kernels')})")
    return problems
