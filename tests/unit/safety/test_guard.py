"""The guard-model tier: Llama Guard's prompt and answer format, and "no opinion" when late or off-format."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.safety.categories import Category
from services.safety.guard import GuardAnswer, GuardConfig, GuardModelTier, guard_prompt, parse_guard_output


def test_prompt_lists_the_categories_and_the_message() -> None:
    prompt = guard_prompt("how do I bake bread")
    assert "S1: Violence" in prompt and "S5: Malware" in prompt and "User: how do I bake bread" in prompt
    assert prompt.rstrip().endswith("list of violated categories.")


@pytest.mark.parametrize(("text", "answer"), [
    ("safe", GuardAnswer(False)),
    (" safe\n", GuardAnswer(False)),
    ("unsafe\nS1", GuardAnswer(True, (Category.VIOLENCE,))),
    ("unsafe\nS2, S5", GuardAnswer(True, (Category.SELF_HARM, Category.MALWARE))),
    ("unsafe", None),             # no category: no opinion
    ("unsafe\nS9", None),         # a code Baton did not list
    ("Sure! Here is a poem", None),
    ("safety first", None),
])
def test_answers_are_parsed_strictly(text: str, answer: GuardAnswer | None) -> None:
    assert parse_guard_output(text) == answer


def _tier(handler, budget_s: float = 1.0) -> GuardModelTier:  # noqa: ANN001 - an httpx handler
    config = GuardConfig("http://guard", "guard-model", budget_s=budget_s)
    return GuardModelTier(config, httpx.AsyncClient(base_url=config.url, transport=httpx.MockTransport(handler)))


async def test_the_guard_is_asked_with_the_prompt_at_temperature_zero() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "unsafe\nS3"}]})

    answer = await _tier(handler).judge("some text")
    assert answer == GuardAnswer(True, (Category.SEXUAL_MINORS,))
    assert seen[0]["model"] == "guard-model" and seen[0]["temperature"] == 0 and "some text" in seen[0]["prompt"]


async def test_a_late_guard_is_no_opinion() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.5)
        return httpx.Response(200, json={"choices": [{"text": "unsafe\nS1"}]})

    assert await _tier(handler, budget_s=0.05).judge("x") is None


async def test_a_failing_guard_is_no_opinion() -> None:
    assert await _tier(lambda request: httpx.Response(503, json={})).judge("x") is None
