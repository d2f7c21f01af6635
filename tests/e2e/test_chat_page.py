"""The web chat page at `/`, driven in Debian's Chromium by Playwright against the real stack.

Chromium comes from apt (`scripts/install-system-deps.sh`), never from `playwright install`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.support.gateway_stack import GatewayStack, Tenant

CHROMIUM = Path("/usr/bin/chromium")
TIMEOUT_MS = 60_000
DONE = re.compile(r"^Done \((stop|length)\)\.$")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM.exists(), "chromium is missing: run scripts/install-system-deps.sh"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, gateway_stack: GatewayStack) -> Iterator[Page]:
    context = browser.new_context(base_url=gateway_stack.url)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


def _send(page: Page, text: str) -> None:
    page.get_by_test_id("prompt").fill(text)
    page.get_by_test_id("send").click()
    expect(page.get_by_test_id("status")).to_have_text(DONE, timeout=TIMEOUT_MS)


def test_chat_stream_continue_and_delete(page: Page, gateway_stack: GatewayStack) -> None:
    tenant: Tenant = gateway_stack.tenant()
    page.goto("/")
    page.get_by_test_id("api-key").fill(tenant.key)
    page.get_by_test_id("save-key").click()
    expect(page.get_by_test_id("model")).to_contain_text("SmolLM2-135M-Instruct")
    page.get_by_test_id("max-tokens").fill("8")

    _send(page, "Name a colour.")
    messages = page.get_by_test_id("message")
    expect(messages).to_have_count(2)
    first_reply = messages.nth(1).inner_text()
    assert first_reply.strip()
    expect(page.get_by_test_id("conversation")).to_have_count(1)

    page.reload()  # the key is remembered; the conversation is stored server-side
    expect(page.get_by_test_id("conversation")).to_have_count(1)
    page.get_by_test_id("conversation").locator(".open").click()
    expect(messages).to_have_count(2)
    assert messages.nth(1).inner_text() == first_reply
    page.get_by_test_id("max-tokens").fill("8")
    _send(page, "And another one.")
    expect(messages).to_have_count(4)

    page.get_by_test_id("delete-conversation").click()
    expect(page.get_by_test_id("conversation")).to_have_count(0)
    expect(messages).to_have_count(0)


def test_a_wrong_key_is_reported(page: Page) -> None:
    page.goto("/")
    page.get_by_test_id("api-key").fill("bt-" + "x" * 43)
    page.get_by_test_id("save-key").click()
    expect(page.get_by_test_id("status")).to_contain_text("Key not accepted: invalid API key")
