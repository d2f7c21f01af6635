"""Input limits: oversized bodies are 413 unread, invalid Unicode is 400 (never 500), prompts too long by
their character count alone are refused before tokenizing, and a token-id prompt counts as one prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.errors import InvalidRequestError as EngineInvalidRequest
from services.billing.pricing import ModelPrice
from services.gateway.completions.prompt import PromptBuilder
from services.gateway.config import ServedModel
from services.gateway.errors import PromptTooLongError
from services.gateway.limits import BodySizeLimit
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, ConversationCreate
from tokenization.tokenizer import Tokenizer


async def _echo_length(request: Request) -> JSONResponse:
    return JSONResponse({"bytes": len(await request.body())})


def _client(max_bytes: int) -> httpx.AsyncClient:
    app = BodySizeLimit(Starlette(routes=[Route("/", _echo_length, methods=["POST"])]), max_bytes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_a_body_over_the_cap_is_413_and_one_under_it_arrives_whole() -> None:
    async with _client(1024) as client:
        refused = await client.post("/", content=b"x" * 1025)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
        assert (await client.post("/", content=b"x" * 1024)).json() == {"bytes": 1024}


async def test_a_chunked_body_is_cut_off_at_the_cap() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"y" * 300

    async with _client(1024) as client:
        assert (await client.post("/", content=chunks())).status_code == 413


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "hi \ud800"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["\ud83d"]},
])
def test_lone_surrogates_anywhere_in_a_chat_body_are_a_validation_error(body: dict) -> None:
    with pytest.raises(ValidationError, match="not valid Unicode"):
        ChatCompletionRequest.model_validate(body)


def test_lone_surrogates_in_a_conversation_title_are_refused_and_real_emoji_pass() -> None:
    with pytest.raises(ValidationError, match="title is not valid Unicode"):
        ConversationCreate.model_validate({"title": "a\ud800"})
    assert ConversationCreate.model_validate({"title": "caf\u00e9 \U0001f600"}).title.endswith("\U0001f600")


def test_a_token_id_prompt_of_many_ids_is_one_prompt() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": list(range(40))})
    assert request.prompts() == [list(range(40))]
    with pytest.raises(ValidationError, match="at most 16 prompts"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a"] * 17})


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_the_tokenizer_refuses_invalid_unicode_as_bad_input(tokenizer: Tokenizer) -> None:
    with pytest.raises(EngineInvalidRequest, match="not valid Unicode"):
        tokenizer.encode("hi \ud800")


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    builder = PromptBuilder(tokenizer, ServedModel("m", Path("."), 64, ModelPrice(Decimal(0), Decimal(0),
                                                                                     Decimal(0))), 16, 8)
    limit = 64 * builder.max_token_chars
    calls = []
    builder.tokenizer = type("Counting", (), {"encode": lambda self, *a, **k: calls.append(1) or [1]})()  # type: ignore[assignment]
    with pytest.raises(PromptTooLongError, match="at least 65 tokens"):
        builder.text("x" * (limit + 1), 4)
    with pytest.raises(PromptTooLongError):
        builder.chat([{"role": "user", "content": "x" * (limit + 1)}], 4)
    assert calls == []
