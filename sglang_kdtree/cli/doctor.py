"""``python -m sglang_kdtree doctor``: check what can break a deployment; exit 1 naming the fix.

Checks, in order (each prints one ``ok`` / ``WARN`` / ``FAIL`` line, a failure followed by ``fix:``):

1. the package: where ``sglang_kdtree`` is imported from, and that its ``patches`` and ``kernels``
   subpackages resolve there (a checkout and an installed wheel must look the same); which copy that is
   (``doctor_install.py``): the installed one, a checkout on ``sys.path`` that shadows it, or a checkout whose
   stale ``*.egg-info`` is the only ``kdtree`` entry point (a failure: SGLang's server would not load the plugin);
2. SGLang's version against the exact pin of this package;
3. the plugin: the ``kdtree`` entry point, ``SGLANG_PLUGINS``, SGLang's ``load_plugins()`` running
   ``register()`` without an error, and ``--speculative-algorithm kdtree`` resolving afterwards;
4. the patches: every hook the plugin registered was applied by SGLang's ``HookRegistry`` (its own
   resolution of the target), and every other symbol a patch names (``TARGETS``) resolves the same way
   (``pkgutil.resolve_name``);
5. CuPy and the GPU (a machine without a GPU is a warning unless ``--require-gpu``: it can run the CPU
   reference and the tests, not a CUDA server);
6. a kernel compile: every ``sglang_kdtree/kernels/*.cu`` through NVRTC, loaded on the GPU where there is one (a kernel
   built for an architecture-specific target, ``runtime.ARCH_SPECIFIC``, only on that GPU), else a front-end compile for
   ``--arch`` (or that kernel's own target); then the launch configurations (``doctor_limits.py``): the variant each
   step runs on the GPU judged (the device's limits, ``KDTREE_DEVICE_PROFILE``'s, or ``--arch``'s) and every launch
   configuration for Kimi K2.6's shapes held to those limits (registers, shared memory, launch bounds);
7. optional ``--model-path`` / ``--speculative-draft-model-path``: the paths exist, the target's architecture
   is one SGLang's DFlash drafter can serve under DDTree (its hidden states can be captured, attention is
   MHA or MLA, no linear-attention / Mamba layers), and the drafter's block size is in the range DDTree
   supports;
8. optional ``--launch-command "python -m sglang.launch_server ..."``: the server's arguments pass SGLang's own
   argument parser and KDTREE's startup checks (``doctor_launch.py``; what the server would refuse before it
   loads anything), judged for this GPU, or without one for ``--arch`` (``spec.device_limits``: the same GPU
   checks 6 and 8 use).

The warnings SGLang and its libraries print while they import are kept out of the report (``--verbose`` lists
them after it); an error SGLang logs still shows.
"""

from __future__ import annotations

import argparse
import logging
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path

from sglang_kdtree.cli.doctor_checkpoints import check_drafter, check_target  # noqa: F401 (check 7; re-exported)
from sglang_kdtree.cli.doctor_install import (FAIL, OK, WARN, Report, check_install, check_package,  # noqa: F401
                                              check_sglang_version, quiet_imports, sglang_pin)
from sglang_kdtree.cli.doctor_launch import check_launch_command
from sglang_kdtree.cli.doctor_limits import check_launch_configurations
from sglang_kdtree.gpu.limits import ARCHS, for_arch

#: NVRTC options of ``sglang_kdtree.gpu.runtime.load_module`` (the include path is added per call).
NVRTC_OPTIONS = ("--std=c++17", "-fmad=false")
#: the compute capability doctor judges for without a GPU: the RTX PRO 6000 Blackwell Server Edition box
DEFAULT_ARCH = "12.0"


class _Capture(logging.Handler):
    """Collects the error records SGLang's plugin loader and hook registry log (they never raise)."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _one_line(exc: BaseException) -> str:
    """``Type: first non-empty line of the message`` (some import errors carry a page of diagnostics)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}" + (" ..." if len(lines) > 1 else "")


def _exc_line(exc_info) -> str:
    if not exc_info or exc_info[1] is None:
        return ""
    return _one_line(exc_info[1])


# --------------------------------------------------------------------------------------------------------
# 3-4. plugin load and patch targets
# --------------------------------------------------------------------------------------------------------


def check_plugin(report: Report) -> list[logging.LogRecord] | None:
    """Runs SGLang's ``load_plugins()``; returns the error records it logged, or None when the plugin failed."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kdtree"]
    if not eps:
        report.fail(
            "no 'kdtree' entry point in group sglang.srt.plugins: SGLang will not load the plugin",
            f"install sglang-kdtree into this environment ({sys.executable} -m pip install /path/to/sglang-kdtree)",
        )
        return None
    expected = "sglang_kdtree.plugin:register"
    if eps[0].value != expected:
        report.fail(f"entry point kdtree -> {eps[0].value} (expected {expected})",
                    "reinstall sglang-kdtree (pip install --force-reinstall --no-deps /path/to/sglang-kdtree)")
        return None
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "kdtree" not in {name.strip() for name in allowed.split(",")}:
        report.fail(f"SGLANG_PLUGINS={allowed!r} does not list kdtree: SGLang skips the plugin",
                    "add kdtree to SGLANG_PLUGINS (or unset it)")
        return None

    from sglang.srt.plugins import load_plugins

    capture = _Capture()
    loggers = [logging.getLogger("sglang.srt.plugins"), logging.getLogger("sglang.srt.plugins.hook_registry")]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(capture)
        lg.propagate = report.verbose  # the tracebacks are summarised below; --verbose shows them as logged
    try:
        load_plugins()
    finally:
        for lg, propagate in saved:
            lg.removeHandler(capture)
            lg.propagate = propagate

    from sglang_kdtree import plugin

    ours = [r for r in capture.records if "kdtree" in r.getMessage()]
    if ours or not plugin._registered:
        record = ours[0] if ours else None
        cause = _exc_line(record.exc_info) if record else (plugin._load_error or "register() was not called")
        details = "".join(traceback.format_exception(*record.exc_info)) if record and record.exc_info else None
        report.fail(
            f"SGLang's load_plugins() could not run the kdtree plugin: {cause}",
            _fix_for(cause),
            details,
        )
        return None
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_kdtree.server import spec

        algo = SpeculativeAlgorithm.from_string("kdtree")
        if not isinstance(algo, spec.KDTreeSpec):
            raise TypeError(f"resolves to {type(algo).__name__}, not KDTreeSpec")
    except Exception as exc:
        report.fail(f"--speculative-algorithm kdtree does not resolve after load_plugins(): {exc}",
                    "reinstall sglang-kdtree; run with --verbose for SGLang's plugin log")
        return None
    report.ok("plugin: entry point kdtree loaded by SGLang's load_plugins(); --speculative-algorithm kdtree resolves")
    return capture.records


def _fix_for(cause: str) -> str:
    if "sglang_kdtree.patches" in cause or "sglang_kdtree.kernels" in cause:
        return ("this sglang_kdtree is incomplete: reinstall sglang-kdtree (pip install .); in a checkout, restore "
                "the folders sglang_kdtree/patches and sglang_kdtree/kernels (git checkout -- sglang_kdtree)")
    return (f"sglang-kdtree supports sglang=={sglang_pin()} only: install it, or reinstall sglang-kdtree; "
            "--verbose shows the traceback")


def _diagnose(target: str) -> str:
    """Why ``target`` does not resolve: a module that does not exist or does not import, or a missing name."""
    import importlib
    import importlib.util

    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            continue
        try:
            obj = importlib.import_module(module)
        except Exception as exc:
            return f"import: module {module} does not import ({_one_line(exc)})"
        for name in parts[i:]:
            if not hasattr(obj, name):
                return f"missing: {'.'.join(parts[:i])}.{name} does not exist in the installed SGLang"
            obj = getattr(obj, name)
        return "resolves"
    return f"missing: no module of {target} exists in the installed SGLang"


def check_patch_targets(report: Report, loader_errors: list[logging.LogRecord], gpu_reason: str | None) -> bool:
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_kdtree import patches

    pin = sglang_pin()
    fix = (f"the installed SGLang is not the {pin} release these patches were written against: "
           f"pip install --force-reinstall sglang=={pin}, or upgrade sglang-kdtree to one that supports it")
    ok = True
    failed_apply = {}
    for record in loader_errors:
        message = record.getMessage()
        if message.startswith("Failed to apply hooks to "):
            failed_apply[message.removeprefix("Failed to apply hooks to ").strip()] = _exc_line(record.exc_info)
    hooked = sorted(
        target
        for target, hooks in HookRegistry._hooks.items()
        if any((src is not None and src.plugin_name == "kdtree")
               or getattr(hook, "__module__", "").startswith("sglang_kdtree.") for _, hook, src in hooks)
    )
    for target in hooked:
        if target not in HookRegistry._patched:
            why = failed_apply.get(target) or _diagnose(target)
            report.fail(f"hook target {target} was not patched by SGLang's HookRegistry ({why})", fix)
            ok = False
    named = 0
    skipped = []
    for name in patches.PATCH_MODULES:
        module = importlib.import_module(f"sglang_kdtree.patches.{name}")
        for target in module.TARGETS:
            if target in hooked:
                continue
            named += 1
            try:
                pkgutil.resolve_name(target)  # what HookRegistry._apply_target uses
                continue
            except Exception:
                why = _diagnose(target)
            if why.startswith("import:") and gpu_reason is not None:
                skipped.append(f"{target} ({why.removeprefix('import: ')})")
                continue
            report.fail(f"patch {name}: SGLang symbol {target} does not resolve ({why})", fix)
            ok = False
    if ok:
        report.ok(f"patches: {len(hooked)} hooks applied by SGLang's HookRegistry, {named - len(skipped)} more "
                  f"patched symbols resolve")
    for item in skipped:
        report.warn(f"not checked on this machine (its module needs CUDA to import): {item}",
                    "run doctor on the GPU machine to check it")
    return ok


# --------------------------------------------------------------------------------------------------------
# 5-6. CuPy, GPU, kernel compile
# --------------------------------------------------------------------------------------------------------


def check_gpu(report: Report, require_gpu: bool) -> str | None:
    """Returns None when kernels can run here, else the reason."""
    try:
        import cupy
    except Exception as exc:
        report.fail(f"CuPy does not import ({type(exc).__name__}: {exc})", "pip install cupy-cuda13x")
        return f"cupy does not import: {exc}"
    from sglang_kdtree.gpu.runtime import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is None:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        count = cupy.cuda.runtime.getDeviceCount()
        report.ok(f"GPU: {count} x {props['name'].decode()} (sm_{props['major']}{props['minor']}), "
                  f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
        from sglang_kdtree.gpu.runtime import pdl_status

        report.ok(f"dependent launches (the tree step's top-K select and tree kernel): {pdl_status()}")
        return None
    no_gpu = reason.startswith("torch sees no CUDA device")
    what = f"GPU: none ({reason}); CuPy {cupy.__version__} imports"
    if no_gpu and not require_gpu:
        report.warn(what + ". This machine runs the CPU reference and the tests, not a CUDA server",
                    "on the serving machine, run doctor --require-gpu")
    else:
        report.fail(what, "install the NVIDIA driver and a CUDA 13 runtime matching cupy-cuda13x; check "
                          "CUDA_VISIBLE_DEVICES" if no_gpu else "fix the CUDA setup named above")
    return reason


def _front_end_check(nvrtc, runtime, name: str, options: tuple[str, ...]) -> tuple[str, str]:
    """NVRTC's PTX compile of ``kernels/<name>`` on a machine without a GPU: ``("compiled", "")``,
    ``("recorded", "")`` when the same text, options and NVRTC version compiled before (a record in the kernel
    cache folder: each compile costs seconds, and the service runs doctor at every install and check), or
    ``("failed", log)``."""
    source = runtime.compile_source(name)
    key = runtime.nvrtc_cache_key(source, options)
    record = runtime.kernel_cache_dir() / f"sglang_kdtree_front_end_{Path(name).stem}_{key}.ok"
    if record.is_file():
        return "recorded", ""
    program = nvrtc.createProgram(source, name, (), ())
    try:
        nvrtc.compileProgram(program, options)
        nvrtc.getPTX(program)
    except nvrtc.NVRTCError:
        return "failed", nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
    except OSError:
        pass  # a read-only cache folder only costs the next run its compile
    return "compiled", ""


def check_kernels(report: Report, gpu_reason: str | None, arch: str) -> bool:
    from sglang_kdtree.gpu import runtime

    kdir = runtime.kernels_dir()
    sources = sorted(p.relative_to(kdir).as_posix() for p in kdir.rglob("*.cu"))  # sglang_kdtree/kernels/moe/ too
    if not sources:
        return False  # reported by check_package
    t0 = time.perf_counter()
    other_gpu = []  # architecture-specific kernels this GPU cannot load (they are not used on it)
    if gpu_reason is None:
        failed = []
        for name in sources:
            target = runtime.ARCH_SPECIFIC.get(name)
            try:
                if target is None:
                    runtime.load_module(name).compile()
                elif runtime.arch_runs_here(target):
                    runtime.load_module_arch(name, target).compile()
                else:
                    other_gpu.append(f"{name} ({target})")
            except Exception as exc:
                failed.append((name, f"{type(exc).__name__}: {exc}"))
        how = "compiled with NVRTC and loaded on the GPU"
        if other_gpu:
            how += f"; not for this GPU, not loaded: {', '.join(other_gpu)}"
    else:
        try:
            from cupy_backends.cuda.libs import nvrtc

            nvrtc_version = ".".join(map(str, nvrtc.getVersion()))
        except Exception as exc:
            report.warn(f"kernel compile: not checked, NVRTC is not available here ({exc})",
                        "on the serving machine NVRTC comes with the CUDA toolkit or nvidia-cuda-nvrtc")
            return True
        failed, passed_before = [], 0
        for name in sources:
            target = runtime.ARCH_SPECIFIC.get(name, f"sm_{arch}").replace("sm_", "compute_")
            outcome, log = _front_end_check(nvrtc, runtime, name, NVRTC_OPTIONS + (f"-I{kdir}", f"-arch={target}"))
            passed_before += outcome == "recorded"
            if outcome == "failed":
                failed.append((name, log))
        special = ", ".join(f"{n}: {a.replace('sm_', 'compute_')}" for n, a in runtime.ARCH_SPECIFIC.items())
        how = f"NVRTC {nvrtc_version} front end, compute_{arch} ({special}; no GPU here to load them"
        if passed_before:
            how += (f"; {passed_before} passed an earlier check of the same source, options and NVRTC, recorded in "
                    f"{runtime.kernel_cache_dir()}")
        how += ")"
    seconds = time.perf_counter() - t0
    for name, log in failed:
        report.fail(f"kernel {name} does not compile ({how})",
                    "the kernel sources and this CUDA toolkit disagree: reinstall sglang-kdtree, or use the CUDA "
                    "13 NVRTC that cupy-cuda13x expects", log[-3000:])
    if failed:
        return False
    report.ok(f"kernel compile: {len(sources)}/{len(sources)} kernels in {kdir} ({how}, {seconds:.1f} s)")
    return True


# --------------------------------------------------------------------------------------------------------


def _arch(text: str) -> str:
    """``--arch``: a compute capability the launch limits know (``12.0``, ``sm_120``, ``90``), as given."""
    try:
        for_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def judged_limits(report: Report, arch: str):
    """The GPU checks 6 and 8 judge for (``spec.device_limits``: this GPU, or ``arch`` without one), reported in
    one line; None when it cannot be told (the reason is reported)."""
    from sglang_kdtree.server.spec import device_limits

    try:
        limits = device_limits(arch)
    except ValueError as exc:
        report.fail(f"GPU limits: {exc}", "unset KDTREE_DEVICE_PROFILE, or pass a known --arch")
        return None
    report.ok(f"GPU judged for (kernel compile, launch command): {limits.describe()}")
    return limits


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, metavar="PATH",
                   help="also check this target checkpoint (path exists, architecture supported) (default: none)")
    p.add_argument("--speculative-draft-model-path", default=None, metavar="PATH",
                   help="also check this DFlash drafter (path exists, block size supported) (default: none)")
    p.add_argument("--speculative-dflash-block-size", type=int, default=None, metavar="N",
                   help="the block size the server will be given, if any (default: the drafter's config)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let SGLang run the target's own config code, as the server flag does (default: off)")
    p.add_argument("--require-gpu", action="store_true",
                   help="fail, instead of warning, when no GPU is visible (use on the serving machine) "
                        "(default: off)")
    p.add_argument("--arch", default=DEFAULT_ARCH, type=_arch, metavar="MAJOR.MINOR",
                   help="compute capability the kernel compile and the launch command are checked for when there is "
                        "no GPU (with a GPU: the GPU's own, or KDTREE_DEVICE_PROFILE's); one of "
                        f"{', '.join(f'{a}.{b}' for a, b in ARCHS)} (default: %(default)s)")
    p.add_argument("--launch-command", default=None, metavar="CMD",
                   help="also check a server command line (quoted; the whole 'python -m sglang.launch_server ...' "
                        "or only its arguments) against SGLang's parser and KDTREE's startup checks "
                        "(default: none)")
    p.add_argument("--verbose", action="store_true", help="show SGLang's plugin log and full tracebacks (default: off)")


def run(args: argparse.Namespace) -> int:
    report = Report(verbose=args.verbose)
    print(f"sglang-kdtree doctor ({sys.executable})", flush=True)
    with quiet_imports() as noise:
        _run_checks(report, args)
    lines = noise.lines()
    if lines and args.verbose:
        print("import warnings (kept out of the report above):")
        for line in lines:
            print(f"        {line}")
    elif lines:
        print(f"({len(lines)} import warning{'s' * (len(lines) != 1)} from SGLang and its libraries not shown; "
              "--verbose lists them)")
    return _finish(report)


def _run_checks(report: Report, args: argparse.Namespace) -> None:
    check_package(report)
    check_install(report)
    sglang_ok = check_sglang_version(report)
    try:
        import sglang  # noqa: F401
    except Exception as exc:
        if sglang_ok:
            report.fail(f"sglang does not import ({type(exc).__name__}: {exc})",
                        f"pip install --force-reinstall sglang=={sglang_pin()}")
        return
    gpu_reason = check_gpu(report, args.require_gpu)
    loader_errors = check_plugin(report)
    if loader_errors is not None:
        check_patch_targets(report, loader_errors, gpu_reason)
    limits = judged_limits(report, args.arch)
    if limits is not None:
        check_kernels(report, gpu_reason, f"{limits.arch[0]}{limits.arch[1]}")
        check_launch_configurations(report, limits)
    target_layers = None
    if args.model_path is not None:
        target_layers = check_target(report, args.model_path, args.trust_remote_code) or None
    if args.speculative_draft_model_path is not None:
        check_drafter(report, args.speculative_draft_model_path, args.speculative_dflash_block_size, target_layers)
    if args.launch_command is not None and limits is not None:
        # the command's own checkpoints, unless the doctor's flags named them (checked above)
        own = args.model_path is None and args.speculative_draft_model_path is None
        check_launch_command(report, args.launch_command, limits, checkpoints=own)


def _finish(report: Report) -> int:
    failed, warned = report.counts[FAIL], report.counts[WARN]
    if failed:
        print(f"status: FAILED ({failed} problem{'s' * (failed != 1)}; each names its fix above)")
        return 1
    print("status: OK" + (f" ({warned} warning{'s' * (warned != 1)})" if warned else ""))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_kdtree doctor", description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
