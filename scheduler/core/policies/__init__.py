"""Routing policies, built by name (`make_policy("goodput")`) for configs and the replay CLI."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.core.policies.base import Policy
from scheduler.core.policies.goodput import GoodputConfig, GoodputPolicy
from scheduler.core.policies.least_loaded import LeastLoadedPolicy
from scheduler.core.policies.prefix_aware import PrefixAwarePolicy
from scheduler.core.policies.round_robin import RoundRobinPolicy

_REGISTRY: dict[str, Callable[[], Policy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
    GoodputPolicy.name: GoodputPolicy,
}
POLICY_NAMES = tuple(_REGISTRY)


def make_policy(name: str) -> Policy:
    """A policy with its default configuration; construct the class directly to configure it."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    return factory()


__all__ = [
    "POLICY_NAMES",
    "GoodputConfig",
    "GoodputPolicy",
    "LeastLoadedPolicy",
    "Policy",
    "PrefixAwarePolicy",
    "RoundRobinPolicy",
    "make_policy",
]
