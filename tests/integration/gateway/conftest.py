"""Gateway tests run against the real stack (tests/support/gateway_stack.py): a real `both` worker on
the default model, the billing consumer and the gateway as subprocesses; clients are the official
`openai` SDK and httpx. Each test gets its own organisation and key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.support.gateway_stack import GatewayStack, Tenant


@pytest.fixture
def stack(gateway_stack: GatewayStack) -> GatewayStack:
    return gateway_stack


@pytest.fixture
def tenant(stack: GatewayStack) -> Tenant:
    return stack.tenant()


@pytest.fixture
def client(stack: GatewayStack, tenant: Tenant) -> Iterator[OpenAI]:
    with stack.openai(tenant.key) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """On a failure, show the gateway's and the worker's log tails."""
    outcome = yield
    report = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("stack")
    if report.when == "call" and report.failed and stack is not None:
        for name in ("gateway", "worker-both"):
            report.sections.append((f"log tail of {name}", stack.log_tail(name)))
