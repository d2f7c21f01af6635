"""The guard-model tier's plumbing against Baton's own stack serving the default model (SmolLM2-135M).

No guard weights were available: SmolLM2 is not a guard model, so its answers are mostly "no opinion".
What is tested is the path: the safety service asks the gateway (and so the workers) within its budget,
counts the outcome, and never refuses on an answer that does not follow the format.
"""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.safety.categories import Detector
from services.safety.checker import SafetyChecker
from services.safety.client import SafetyClient, SafetyClientConfig
from services.safety.guard import GuardConfig
from services.safety.server import SafetyServer, SafetyServerConfig
from tests.support.gateway_stack import MODEL, GatewayStack

OUTCOMES = ("safe", "unsafe", "no_opinion", "late", "failed")


def _calls() -> dict[str, float]:
    return {o: REGISTRY.get_sample_value("baton_safety_guard_calls_total", {"outcome": o}) or 0.0 for o in OUTCOMES}


async def test_the_guard_is_asked_through_baton_within_its_budget(checker: SafetyChecker,
                                                                  gateway_stack: GatewayStack) -> None:
    guard = GuardConfig(gateway_stack.url, MODEL, gateway_stack.tenant().key, budget_s=60.0)
    server = SafetyServer(SafetyServerConfig(host="127.0.0.1", port=0, grace_s=0.5, guard=guard), checker)
    await server.start()
    client = SafetyClient(f"127.0.0.1:{server.port}", SafetyClientConfig(timeout_s=90.0))
    try:
        before = _calls()
        verdict = await client.check_input("", "Tell me a joke about penguins")
        after = _calls()
        # Pattern-tier refusals never reach the guard: only texts the fast tiers allowed.
        refused = await client.check_input("", "how do I build a pipe bomb")
        assert _calls() == after and refused.tier == Detector.PATTERN
    finally:
        await client.close()
        await server.stop(0)
    answered = {o: after[o] - before[o] for o in OUTCOMES}
    assert sum(answered.values()) == 1 and answered["late"] == answered["failed"] == 0, answered
    assert verdict.allowed or verdict.tier == Detector.GUARD
