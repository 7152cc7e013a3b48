"""``doctor`` checks 1-2: which copy of ``sglang_kdtree`` is checked, how it is installed, and SGLang's version.

SGLang's server finds plugins through the entry points of installed distributions. A checkout on ``sys.path``
can fool a check run from inside it: ``python -m`` puts the current directory first on ``sys.path``, so the
checkout's ``sglang_kdtree/`` shadows the installed copy, and the ``*.egg-info`` folder that ``pip install .``
leaves in the checkout still declares the ``kdtree`` entry point after ``pip uninstall``. ``find_install`` looks
at the distributions a server started from another directory (systemd starts it from ``/``) would see.

Also here: ``Report``, the lines every check writes, and ``quiet_imports``, which keeps the warnings SGLang and
its libraries print while they import out of those lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

#: The SGLang release this package is written against (also the exact pin in pyproject.toml).
SUPPORTED_SGLANG = "0.5.23"
DIST_NAME = "sglang-kdtree"
ENTRY_POINT_GROUP = "sglang.srt.plugins"

OK, WARN, FAIL = "ok", "WARN", "FAIL"


@dataclass
class Report:
    """Lines printed as they are found (a slow check shows where it is), and the tally for the exit code."""

    verbose: bool = False
    out: object = field(default_factory=lambda: sys.stdout)
    counts: dict = field(default_factory=lambda: {OK: 0, WARN: 0, FAIL: 0})

    def add(self, status: str, what: str, fix: str | None = None, details: str | None = None) -> None:
        self.counts[status] += 1
        print(f"{status:<5} {what}", file=self.out, flush=True)
        if details and (self.verbose or status == FAIL):
            for line in details.rstrip().splitlines():
                print(f"        {line}", file=self.out)
        if fix:
            print(f"      fix: {fix}", file=self.out, flush=True)

    def ok(self, what: str) -> None:
        self.add(OK, what)

    def warn(self, what: str, fix: str | None = None) -> None:
        self.add(WARN, what, fix)

    def fail(self, what: str, fix: str, details: str | None = None) -> None:
        self.add(FAIL, what, fix, details)


@dataclass
class ImportNoise:
    """What ``quiet_imports`` kept out of the report: Python warnings and SGLang's log records."""

    warnings: list = field(default_factory=list)
    records: list = field(default_factory=list)

    def lines(self) -> list[str]:
        shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in self.warnings]
        return shown + [f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records]


class _Keep(logging.Handler):
    """Keeps SGLang's records below ERROR; an error still reaches stderr as it happens (a real failure)."""

    def __init__(self, noise: ImportNoise):
        super().__init__(level=logging.NOTSET)
        self.noise = noise
        self.stderr = logging.StreamHandler(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.stderr.handle(record)
        else:
            self.noise.records.append(record)


@contextlib.contextmanager
def quiet_imports():
    """Collect the warnings raised and the ``sglang`` log records below ERROR while the checks import SGLang,
    CuPy and torch (``UserWarning: Only CUDA ... support AWQ``, ``Cannot detect CUDA architecture``): they are
    not findings, and printed as they come they interleave with the report. Yields the ``ImportNoise``."""
    noise = ImportNoise()
    logger = logging.getLogger("sglang")
    keep = _Keep(noise)
    propagate = logger.propagate
    with warnings.catch_warnings(record=True) as caught:
        logger.addHandler(keep)
        logger.propagate = False
        try:
            yield noise
        finally:
            logger.removeHandler(keep)
            logger.propagate = propagate
            noise.warnings.extend(caught)


def sglang_pin() -> str:
    """The exact SGLang version this installation requires (from its metadata, else ``SUPPORTED_SGLANG``)."""
    try:
        from packaging.requirements import Requirement

        for line in metadata.requires(DIST_NAME) or ():
            req = Requirement(line)
            if req.name == "sglang" and req.marker is None:
                pins = [s.version for s in req.specifier if s.operator == "=="]
                if pins:
                    return pins[0]
    except Exception:
        pass
    return SUPPORTED_SGLANG


# --------------------------------------------------------------------------------------------------------
# which copy
# --------------------------------------------------------------------------------------------------------

INSTALLED, SHADOWED, STALE, MISSING = "installed", "shadowed", "stale", "missing"


@dataclass(frozen=True)
class Install:
    """Where this process imports ``sglang_kdtree`` from (``here``) against what a server started elsewhere loads.

    ``state``: INSTALLED (the server loads ``here``), SHADOWED (it loads the installed ``code``, not ``here``),
    STALE (no distribution is installed; ``metadata`` is the entry point's folder, found only through the current
    directory), MISSING (no distribution declares the entry point at all)."""

    state: str
    here: Path
    version: str | None = None
    metadata: Path | None = None
    code: Path | None = None
    editable: bool = False


def server_sys_path() -> list[str]:
    """``sys.path`` as a process started from another directory sees it: without ``sys.path[0]``, the entry
    Python adds for the current directory (``-m``, ``-c``, a script on stdin) or a script's folder, unless
    ``-P`` / ``-I`` kept it out."""
    return list(sys.path) if getattr(sys.flags, "safe_path", False) else list(sys.path[1:])


def _metadata_dir(dist: metadata.Distribution) -> Path | None:
    found = getattr(dist, "_path", None)  # PathDistribution's folder; importlib.metadata has no public name
    return Path(os.path.abspath(found)) if found is not None else None


def _code_dir(dist: metadata.Distribution) -> tuple[Path, bool]:
    """Where ``dist`` puts ``sglang_kdtree``, and whether it is an editable install (pointing at a checkout)."""
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        info = {}
    url = info.get("url", "")
    if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return Path(unquote(urlparse(url).path)) / "sglang_kdtree", True
    return Path(os.path.abspath(dist.locate_file("sglang_kdtree"))), False


def _declares_kdtree(dist: metadata.Distribution) -> bool:
    return any(ep.group == ENTRY_POINT_GROUP and ep.name == "kdtree" for ep in dist.entry_points)


def find_install(here: Path, search_path: list[str], server_path: list[str]) -> Install:
    """Classify the copy of ``sglang_kdtree`` at ``here``: ``search_path`` is this process's ``sys.path``,
    ``server_path`` the one a server started from another directory has (``server_sys_path()``)."""
    installed = list(metadata.distributions(name=DIST_NAME, path=server_path))
    if not installed:
        visible = [d for d in metadata.distributions(name=DIST_NAME, path=search_path) if _declares_kdtree(d)]
        if not visible:
            return Install(MISSING, here)
        return Install(STALE, here, visible[0].version, _metadata_dir(visible[0]))
    dist = installed[0]  # the first on sys.path wins, for the import and for SGLang's entry points alike
    code, editable = _code_dir(dist)
    state = INSTALLED if os.path.realpath(code) == os.path.realpath(here) else SHADOWED
    return Install(state, here, dist.version, _metadata_dir(dist), code, editable)


def check_install(report: Report, search_path: list[str] | None = None, server_path: list[str] | None = None,
                  here: Path | None = None) -> Install:
    """Report which copy doctor checks. FAIL for STALE: SGLang's server would not load the plugin."""
    import sglang_kdtree

    here = here or Path(sglang_kdtree.__file__).parent
    found = find_install(here, sys.path if search_path is None else search_path,
                         server_sys_path() if server_path is None else server_path)
    where = found.metadata.parent if found.metadata else "?"
    if found.state == INSTALLED:
        how = f"an editable install of the checkout {found.code.parent}" if found.editable else "installed"
        report.ok(f"install: sglang-kdtree {found.version}, {how} (metadata in {where}); doctor checks that copy")
    elif found.state == SHADOWED:
        report.warn(f"install: doctor checks {here}, a checkout on sys.path (the current directory), not the "
                    f"installed sglang-kdtree {found.version} in {found.code} that SGLang's server loads",
                    "run doctor from another directory (cd / && python -m sglang_kdtree doctor) to check the "
                    "installed copy; or install this checkout (pip install .)")
    elif found.state == STALE:
        report.fail(f"install: sglang-kdtree is not installed in {sys.prefix}; the kdtree entry point seen here "
                    f"comes only from {found.metadata}, stale metadata in the current directory (what "
                    f"`pip install .` leaves in a checkout). SGLang's server, which finds plugins through installed "
                    "entry points, will not load the plugin",
                    f"{sys.executable} -m pip install {where} (or a wheel built from it); if you uninstalled it on "
                    f"purpose, delete {found.metadata}")
    return found  # MISSING: check_plugin reports the missing entry point


def check_package(report: Report) -> bool:
    import sglang_kdtree

    pkg_dir = Path(sglang_kdtree.__file__).parent
    where = str(pkg_dir)
    if (pkg_dir.parent / "pyproject.toml").is_file():
        where += " (a source checkout)"
    ok = True
    try:
        from sglang_kdtree import patches

        patches_dir = Path(patches.__file__).parent
    except ImportError as exc:
        report.fail(
            f"sglang_kdtree.patches does not import from {pkg_dir} ({exc})",
            "this sglang_kdtree is incomplete: reinstall sglang-kdtree (pip install .); in a checkout, restore the "
            "folder sglang_kdtree/patches (git checkout -- sglang_kdtree/patches)",
        )
        ok = False
        patches_dir = None
    from sglang_kdtree.gpu.runtime import kernels_dir

    kdir = kernels_dir()
    if not sorted(kdir.rglob("*.cu")):
        report.fail(
            f"no kernel sources (*.cu) in {kdir}",
            "this sglang_kdtree is incomplete: reinstall sglang-kdtree (pip install .); in a checkout, restore the "
            "folder sglang_kdtree/kernels (git checkout -- sglang_kdtree/kernels)",
        )
        ok = False
    if ok:
        report.ok(f"sglang_kdtree {sglang_kdtree.__version__} from {where}; patches {patches_dir}, kernels {kdir}")
    return ok


def check_sglang_version(report: Report) -> bool:
    pin = sglang_pin()
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        report.fail("sglang is not installed", f"pip install sglang=={pin}")
        return False
    if found != pin:
        report.fail(
            f"sglang {found} is installed; sglang-kdtree hooks SGLang internals and needs exactly {pin}",
            f"pip install sglang=={pin}",
        )
        return False
    report.ok(f"sglang {found} (required: =={pin})")
    return True
