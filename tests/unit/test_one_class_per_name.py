"""One meaning per class name (issue 49): each of these names is defined once in the product and the lab, so a
reader who meets `Layout` or `Tier` knows which one it is. Anything else with the same meaning takes a name of
its own (e.g. the lab's `NamedLayout`, loadtest's `GoodputCriterion`, safety's `Detector`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tokenization", "rpcgen", "engine", "kvtransfer", "scheduler", "services", "loadtest", "lab")
ONE_DEFINITION = {
    "Layout": "scheduler/planner.py",
    "SLO": "scheduler/types.py",
    "Tier": "scheduler/types.py",
    "LengthDistribution": "loadtest/datasets.py",
    "FinishReason": "tokenization/finish_reason.py",
    # Where a KV block lives and what happened to it: the engine and the scheduler share them from the ground floor
    # (`Tier` is the customer tier above; the engine's KV tier was also named `Tier` until it moved here).
    "KVTier": "tokenization/kv_blocks.py",
    "KVEvent": "tokenization/kv_blocks.py",
    "KVEventKind": "tokenization/kv_blocks.py",
    "WorkerRole": "scheduler/types.py",  # the worker's config names the scheduler's
}


def _defined_names(tree: ast.Module) -> set[str]:
    """Class statements and module-level assignments (a `Literal` alias counts)."""
    names = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    return names | {t.id for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}


def _definitions() -> dict[str, set[str]]:
    """Where each name in ONE_DEFINITION is defined. Every file is parsed once: parsing the product and
    the lab once per name took ~16 s of `make test`."""
    found: dict[str, set[str]] = {name: set() for name in ONE_DEFINITION}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "rpcgen/baton" in path.as_posix():
                continue  # generated protobuf code
            for name in _defined_names(ast.parse(path.read_text(), str(path))) & found.keys():
                found[name].add(path.relative_to(ROOT).as_posix())
    return found


def test_each_name_is_defined_once() -> None:
    definitions = _definitions()
    for name, home in ONE_DEFINITION.items():
        others = definitions[name] - {home}
        assert not others, f"{name} is defined in {home} and also in {sorted(others)}"
        assert home in definitions[name]
