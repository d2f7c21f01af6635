"""Per-organisation policies: overrides merge onto the default; bad files fail with the valid choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.safety.categories import Category, Direction
from services.safety.policy import Action, PolicyBook

BOOK = PolicyBook.from_mapping({
    "default": {"categories": {"violence": {"threshold": 0.7}}},
    "orgs": {
        "org_flag": {"action": "flag", "categories": {"malware": {"enabled": False}}},
        "org_off": {"input": False, "output": False},
        "org_pii_in": {"categories": {"pii": {"input": True}}},
    },
})


def test_unknown_org_gets_the_default() -> None:
    assert BOOK.for_org("nobody") is BOOK.default
    assert BOOK.default.action is Action.BLOCK


def test_pii_is_checked_on_output_only_by_default() -> None:
    assert Category.PII not in BOOK.default.active(Direction.INPUT)
    assert Category.PII in BOOK.default.active(Direction.OUTPUT)


def test_override_keeps_the_default_fields_it_does_not_name() -> None:
    org = BOOK.for_org("org_flag")
    assert org.action is Action.FLAG
    assert Category.MALWARE not in org.active(Direction.INPUT)
    assert org.threshold(Category.VIOLENCE) == 0.7  # inherited from the file's default


def test_directions_can_be_switched_off() -> None:
    org = BOOK.for_org("org_off")
    assert org.active(Direction.INPUT) == () and org.active(Direction.OUTPUT) == ()


def test_a_category_can_be_enabled_on_input() -> None:
    assert Category.PII in BOOK.for_org("org_pii_in").active(Direction.INPUT)


@pytest.mark.parametrize(("spec", "message"), [
    ({"default": {"action": "shout"}}, "valid: ['block', 'flag']"),
    ({"default": {"categories": {"spam": {}}}}, "valid: ['violence'"),
    ({"default": {"categories": {"hate": {"threshold": 1.5}}}}, "(0, 1]"),
    ({"default": {"inputs": True}}, "unknown keys ['inputs']"),
    ({"orgs": {"a": {"output": "yes"}}}, "policy.orgs.a.output: expected true or false"),
])
def test_invalid_policies_name_the_problem(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        PolicyBook.from_mapping(spec)
    assert message in str(err.value)


def test_loads_yaml_and_json_files(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("orgs:\n  acme:\n    action: flag\n")
    (tmp_path / "p.json").write_text('{"orgs": {"acme": {"action": "flag"}}}')
    for name in ("p.yaml", "p.json"):
        assert PolicyBook.from_file(tmp_path / name).for_org("acme").action is Action.FLAG


def test_the_shipped_example_policy_loads() -> None:
    path = Path(__file__).resolve().parents[3] / "services/safety/data/policies.example.json"
    assert PolicyBook.from_file(path).for_org("org_security_research").action is Action.FLAG
