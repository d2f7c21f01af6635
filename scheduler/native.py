"""The scheduler's decision path compiled to C with mypyc: the same decisions, 1.5-3.4x sooner.

    python -m scheduler.native SITE     # SITE: a directory holding an installed `scheduler` package

A routing decision at 64 workers is ~35 cost-model evaluations, ~20 placements and ~50 worker scores,
each a handful of float operations behind Python calls; no one function is more than a few percent of
the time (docs/benchmarks.md, scheduler decision latency), so the interpreter's per-call cost is the
cost. mypyc compiles the typed modules as they are (no second implementation to keep in step): the
boundary types (`scheduler/types.py`), `scheduler/core` and the online fit its cost model refits with
(`scheduler/calibration/windowed.py`). The rest (adapters, replay, simulator,
planner) stays interpreted and imports the compiled modules like any other.

The extension modules land next to their sources, and Python imports an extension module before a
`.py` of the same name. So this compiles installed copies only (an image's site-packages, a
benchmark's scratch copy), never a source checkout, where an edited `.py` would silently keep running
as its stale compiled self. An installed copy can go stale too: `pip install` of a newer Baton over a
compiled one replaces the sources and leaves the extension modules (pip does not know them). So the build
records each source's hash (`MANIFEST`), and the scheduler refuses to start while a compiled module's
source differs from what was compiled (`check_fresh`). `compiled()` says which path a process runs; the
scheduler logs it at start.
Needs mypy (which ships mypyc) and a C compiler with the Python headers at build time, nothing at run
time beyond `mypy_extensions`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

# The modules compiled, as globs under the directory that holds the package.
MODULES = ("scheduler/types.py", "scheduler/core/*.py", "scheduler/core/policies/*.py",
           "scheduler/calibration/windowed.py")
GROUP = "baton_scheduler"  # the name of the shared library the compiled modules link to
MANIFEST = "scheduler/native-sources.json"  # under the site: {source path: sha256 when compiled}


def sources(site: Path) -> list[str]:
    """The module files to compile under `site`, relative to it, in a stable order."""
    found = sorted({str(p.relative_to(site)) for pattern in MODULES for p in site.glob(pattern)})
    if not found:
        raise ValueError(f"no scheduler package under {site}")
    return found


def build(site: Path) -> list[Path]:
    """Compile `sources(site)` and put the extension modules next to them; returns those written.

    The compile runs on a scratch copy of the package: mypy reads the working directory as a source
    root, and an installed site-packages holds modules (`mypy_extensions.py`) that would shadow its own."""
    site = site.resolve()
    if (site / ".git").exists() or (site / "pyproject.toml").exists():
        raise ValueError(f"{site} is a source checkout: compile an installed copy (see the module docstring)")
    paths = sources(site)
    from mypyc.build import mypycify  # build-time only: mypy is not a run-time dependency
    from setuptools import setup

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as temp:
        scratch = Path(temp)
        # tokenization too: the ground-floor types the compiled modules import (tokenization/kv_blocks.py),
        # which mypy must read to type-check them; only `paths` are compiled.
        for package in ("scheduler", "tokenization"):
            shutil.copytree(site / package, scratch / package, ignore=shutil.ignore_patterns("__pycache__"))
        os.chdir(scratch)  # mypyc names modules by their path from the working directory
        try:
            setup(name="baton-scheduler-native", ext_modules=mypycify(paths, opt_level="3", group_name=GROUP),
                  script_args=["build_ext", "--inplace", "--build-temp", str(scratch / "build")], py_modules=[])
        finally:
            os.chdir(cwd)
        built = [p.relative_to(scratch) for p in scratch.glob("**/*.so")]
        built = sorted(p for p in built if p.parts[0] != "build")
        for relative in built:
            shutil.copy2(scratch / relative, site / relative)
    (site / MANIFEST).write_text(json.dumps({path: _sha256(site / path) for path in paths}, indent=1))
    return [site / relative for relative in built]


def stale(site: Path) -> list[str]:
    """The package's extension modules under `site` whose source is not what was compiled (changed,
    gone, or compiled without a manifest), as source paths relative to `site`."""
    manifest = site / MANIFEST
    recorded = json.loads(manifest.read_text()) if manifest.exists() else {}
    found = []
    for extension in (site / "scheduler").rglob("*"):
        suffix = next((x for x in EXTENSION_SUFFIXES if extension.name.endswith(x)), None)
        if suffix is None:
            continue
        source = extension.with_name(extension.name[: -len(suffix)] + ".py")
        path = str(source.relative_to(site))
        if not source.exists() or recorded.get(path) != _sha256(source):
            found.append(path)
    return sorted(found)


def check_fresh() -> None:
    """Raise ValueError when this process's `scheduler` package has stale compiled modules (`stale`)."""
    site = Path(__file__).resolve().parents[1]  # this module is never compiled: it sits in the package's sources
    changed = stale(site)
    if changed:
        raise ValueError(f"compiled modules older than their sources under {site}: {', '.join(changed)}; "
                         f"recompile (python -m scheduler.native {site}) or delete the extension modules")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiled() -> bool:
    """Whether this process runs the compiled decision path."""
    from scheduler.core import scheduler

    return not (scheduler.__file__ or "").endswith(".py")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path, help="the directory that holds the installed `scheduler` package")
    args = parser.parse_args(argv)
    try:
        written = build(args.site)
    except ValueError as e:
        sys.exit(f"scheduler.native: {e}")
    print(f"compiled {len(written)} extension modules under {args.site}")


if __name__ == "__main__":
    main()
