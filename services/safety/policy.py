"""Per-organisation safety policies: which categories, which thresholds, which directions, which action.

A policy file (JSON, or YAML when PyYAML is installed) holds a default policy and per-organisation
overrides; an override names only what differs, and is merged onto the default field by field (and
category by category):

    {"default": {"input": true, "output": true, "action": "block",
                 "categories": {"pii": {"input": false}, "violence": {"threshold": 0.7}}},
     "orgs": {"org_research": {"action": "flag", "categories": {"malware": {"enabled": false}}},
              "org_internal": {"output": false}}}

Fields: `input`/`output` switch a direction off entirely (nothing runs, no latency added);
`action` is "block" (refuse / halt) or "flag" (serve, but the verdict carries the category);
per category `enabled`, `threshold` in (0, 1] (the classifier's harm score at or above which the
category fires; unset: the classifier's refuse threshold, chosen on its held-out split; pattern hits
score 1.0, so they fire at any threshold), and `input`/`output`.
Unknown organisations get the default. Everything is validated at load; errors name the bad key
and the valid choices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.safety.categories import Category, Direction

# None: the classifier's own refuse threshold, chosen on its held-out split (`train_head`).
DEFAULT_THRESHOLD: float | None = None


class Action(StrEnum):
    BLOCK = "block"
    FLAG = "flag"


@dataclass(frozen=True)
class CategoryRule:
    enabled: bool = True
    threshold: float | None = DEFAULT_THRESHOLD
    input: bool = True
    output: bool = True

    def applies_to(self, direction: Direction) -> bool:
        return self.enabled and (self.input if direction == Direction.INPUT else self.output)


def _default_rules() -> dict[Category, CategoryRule]:
    # A user may type their own e-mail address into a prompt; PII matters where the model emits it.
    return {c: CategoryRule(input=c is not Category.PII) for c in Category}


@dataclass(frozen=True)
class SafetyPolicy:
    input: bool = True
    output: bool = True
    action: Action = Action.BLOCK
    categories: Mapping[Category, CategoryRule] = field(default_factory=_default_rules)  # read-only

    def active(self, direction: Direction) -> tuple[Category, ...]:
        """The categories to check in `direction`, in Category order (empty: direction is off)."""
        if not (self.input if direction == Direction.INPUT else self.output):
            return ()
        return tuple(c for c in Category if c in self.categories and self.categories[c].applies_to(direction))

    def threshold(self, category: Category) -> float | None:
        """The category's threshold, or None for the classifier's calibrated default."""
        return self.categories[category].threshold


_POLICY_KEYS = ("input", "output", "action", "categories")
_RULE_KEYS = ("enabled", "threshold", "input", "output")


def _check_keys(obj: Any, valid: tuple[str, ...], where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected a mapping with keys {list(valid)}, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid: {list(valid)}")
    return obj


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _merge_rule(base: CategoryRule, spec: Any, where: str) -> CategoryRule:
    spec = _check_keys(spec, _RULE_KEYS, where)
    rule = base
    for key in ("enabled", "input", "output"):
        if key in spec:
            rule = replace(rule, **{key: _bool(spec[key], f"{where}.{key}")})
    if "threshold" in spec:
        t = spec["threshold"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 < t <= 1.0:
            raise ConfigError(f"{where}.threshold: expected a number in (0, 1], got {t!r}")
        rule = replace(rule, threshold=float(t))
    return rule


def _merge_categories(base: Mapping[Category, CategoryRule], spec: Any, where: str
                      ) -> dict[Category, CategoryRule]:
    spec = _check_keys(spec, tuple(c.value for c in Category), where)
    rules = dict(base)
    for name, rule_spec in spec.items():
        category = Category(name)
        rules[category] = _merge_rule(rules[category], rule_spec, f"{where}.{name}")
    return rules


def merge_policy(base: SafetyPolicy, spec: Any, where: str) -> SafetyPolicy:
    """`base` with the fields `spec` names replaced (categories merged one by one)."""
    spec = _check_keys(spec, _POLICY_KEYS, where)
    policy = base
    if "input" in spec:
        policy = replace(policy, input=_bool(spec["input"], f"{where}.input"))
    if "output" in spec:
        policy = replace(policy, output=_bool(spec["output"], f"{where}.output"))
    if "action" in spec:
        try:
            policy = replace(policy, action=Action(spec["action"]))
        except ValueError as e:
            raise ConfigError(f"{where}.action: {spec['action']!r}; valid: {[a.value for a in Action]}") from e
    if "categories" in spec:
        policy = replace(policy, categories=_merge_categories(policy.categories, spec["categories"],
                                                              f"{where}.categories"))
    return policy


class PolicyBook:
    """The default policy and the resolved policy of every organisation with an override."""

    def __init__(self, default: SafetyPolicy | None = None, orgs: Mapping[str, SafetyPolicy] | None = None
                 ) -> None:
        self.default = default or SafetyPolicy()
        self._orgs = dict(orgs or {})

    def for_org(self, org_id: str) -> SafetyPolicy:
        return self._orgs.get(org_id, self.default)

    @classmethod
    def from_mapping(cls, spec: Any, where: str = "policy") -> PolicyBook:
        spec = _check_keys(spec, ("default", "orgs"), where)
        default = merge_policy(SafetyPolicy(), spec.get("default", {}), f"{where}.default")
        orgs_spec = spec.get("orgs", {})
        if not isinstance(orgs_spec, Mapping):
            raise ConfigError(f"{where}.orgs: expected a mapping of organisation id to policy overrides")
        orgs = {str(org): merge_policy(default, o, f"{where}.orgs.{org}") for org, o in orgs_spec.items()}
        return cls(default, orgs)

    @classmethod
    def from_file(cls, path: Path) -> PolicyBook:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read safety policy file {path}: {e}") from e
        return cls.from_mapping(_parse(text, path), str(path))


def _parse(text: str, path: Path) -> Any:
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional: JSON needs nothing beyond the standard library
        except ImportError as e:
            raise ConfigError(f"{path}: YAML policy files need PyYAML (pip install PyYAML); "
                              "or write the policy as JSON") from e
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e}); use .yaml/.yml for YAML") from e
