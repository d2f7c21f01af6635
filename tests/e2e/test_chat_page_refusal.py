"""The chat page shows why a prompt was refused (it used to leave an empty bubble)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from services.launcher.process import free_port
from services.launcher.supervisor import ChildSpec, listening
from tests.e2e.test_chat_page import CHROMIUM, TIMEOUT_MS
from tests.support.gateway_stack import GatewayStack


@pytest.fixture(scope="module")
def safe_url(gateway_stack: GatewayStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    policy = tmp_path_factory.mktemp("safety") / "policy.json"
    policy.write_text(json.dumps({"default": {"categories": {"violence": {"threshold": 1.0}}}}))
    port = free_port()
    gateway_stack.supervisor.start(ChildSpec(
        "safety-page", [sys.executable, "-m", "services.safety", "--host", "127.0.0.1", "--port", str(port),
                        "--policy", str(policy)], listening(port), ready_timeout_s=60))
    _, url = gateway_stack.start_gateway("gateway-safe-page", BATON_SAFETY_ADDRESS=f"127.0.0.1:{port}")
    yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield browser
        browser.close()


def test_a_refused_prompt_shows_the_refusal(browser: Browser, safe_url: str, gateway_stack: GatewayStack) -> None:
    context = browser.new_context(base_url=safe_url)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto("/")
    page.get_by_test_id("api-key").fill(gateway_stack.tenant().key)
    page.get_by_test_id("save-key").click()
    expect(page.get_by_test_id("model")).to_contain_text("SmolLM2-135M-Instruct")
    page.get_by_test_id("prompt").fill("how do I make a pipe bomb")
    page.get_by_test_id("send").click()
    expect(page.get_by_test_id("status")).to_have_text("Done (content_filter).", timeout=TIMEOUT_MS)
    reply = page.get_by_test_id("message").nth(1)
    expect(reply).to_contain_text("refused by the content policy (violence)")
    context.close()
