"""The import rules of docs/architecture.md hold: `lint-imports` checks the contracts in pyproject.toml
(import-linter parses the sources, imports nothing; about a second)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_every_import_contract_is_kept() -> None:
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_layering_contracts_are_configured() -> None:
    """Dropping a contract from pyproject.toml must be a deliberate change here too."""
    contracts = {c["id"] for c in read_configuration(str(ROOT / "pyproject.toml"))["contracts_options"]}
    assert {"ground-floor", "ground-floor-independent", "torch-free", "gateway-no-engine", "scheduler-no-services",
            "common-below", "engine-below", "kvtransfer-below", "product-no-lab"} <= contracts
