"""`/v1/responses` (OpenAI's Responses API, text in and out) on top of the chat completion service.

A response runs as a chat completion (same admission, safety, routing, billing): `instructions`
becomes a leading system message, `input` (a string or a list of messages) the user turn(s), and with
`previous_response_id` the stored turns of that response come first. `instructions` are not carried
over to the next response, as OpenAI documents.

Storage (`store`, default true) uses the conversation store: a response *is* a conversation whose id
gives the response id (`resp_<uuid hex>`); it holds the whole history (copied from the previous
response, then this input and the output), so any stored response can be continued, and deleting it
never breaks another. In open mode (`BATON_AUTH_MODE=none`) there is no database: responses are
served but not stored (`store: false` in the body), and `previous_response_id` is a 501.

Streaming follows the documented event sequence: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
`response.completed` (or `response.incomplete` when max_output_tokens cut it, `error` then
`response.failed` when the worker failed mid-stream), each with a `sequence_number` counting from 0.
A failed response keeps no turns (continuing it starts afresh). Its conversation row is created only
once the request is admitted, so a refused request (429, 400) leaves no empty response behind.

Cancel (`POST /v1/responses/{id}/cancel`): a streamed response runs as a stream whose id *is* the
response id, so the stream cancel of services/gateway/service.py stops it at once, from any replica. The
stream then ends with `response.cancelled` (OpenAI defines no streaming event for it), the response's
status is `cancelled`, it keeps no turns, and the tokens generated so far are billed. The cancel answers
the response object; through a replica other than the one running it, the fields echoed from the
request (instructions, metadata, sampling) are not known there and come back empty. A finished
response (or a non-streamed one: it finishes within its request) is a 400; an unknown id or another API
key's is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import NotFoundError
from services.gateway.auth import Principal
from services.gateway.errors import BadRequestError, FeatureDisabledError
from services.gateway.schemas import ChatCompletionRequest, ResponsesRequest
from services.gateway.service import ClientGone, CompletionService, JsonOutcome
from services.gateway.streams import StreamOwner, StreamSource

Body = dict[str, Any]
_PREFIX = "resp_"
SETTLE_TIMEOUT_S = 10.0  # a cancelled response's last events are written within a step or two


def _is_response_id(value: str) -> bool:
    try:
        return value.startswith(_PREFIX) and response_id_to_uuid(value).hex == value.removeprefix(_PREFIX)
    except BadRequestError:
        return False


def response_id_to_uuid(response_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(hex=response_id.removeprefix(_PREFIX))
    except ValueError as e:
        raise BadRequestError(f"{response_id!r} is not a response id", "previous_response_id") from e


@dataclass
class ResponseDraft:
    """One response as it is built; `body()` is the `response` object at any point."""

    request: ResponsesRequest
    response_id: str
    stored: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    status: str = "in_progress"
    usage: Body | None = None
    incomplete: str | None = None
    error: Body | None = None  # {"code", "message"} once the worker failed mid-stream

    @property
    def item_id(self) -> str:
        return "msg_" + self.response_id.removeprefix(_PREFIX)

    def part(self) -> Body:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def item(self, status: str) -> Body:
        content = [self.part()] if status == "completed" or self.text else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def body(self) -> Body:
        r = self.request
        done = self.status != "in_progress"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": r.model, "instructions": r.instructions, "previous_response_id": r.previous_response_id,
            "store": self.stored, "output": [self.item("completed")] if done else [],
            "usage": self.usage, "error": self.error, "metadata": r.metadata or {},
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "max_output_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
        }

    def absorb(self, chunk: Body) -> tuple[str, str | None]:
        """Fold one chat completion chunk in: (its new text, its finish reason); an error chunk fails it."""
        if "error" in chunk:
            self.status = "failed"
            self.error = {"code": chunk["error"].get("code") or "server_error",
                          "message": chunk["error"].get("message") or ""}
            return "", None
        self.usage = _usage(chunk.get("usage")) or self.usage
        text, finish = "", None
        for choice in chunk.get("choices", []):
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
        self.text += text
        return text, finish

    def finish(self, finish_reason: str | None) -> None:
        if self.status == "failed":
            return
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.incomplete = "max_output_tokens" if finish_reason == "length" else None
        if finish_reason == "content_filter":
            self.status, self.incomplete = "incomplete", "content_filter"
        if finish_reason == "abort":  # cancelled (or the gateway shut down under it)
            self.status = "cancelled"


def _usage(usage: Body | None) -> Body | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


@dataclass
class _Running:
    """A streamed response running on this replica, for a cancel to answer its final object."""

    draft: ResponseDraft
    owner: StreamOwner
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class ResponseFinishedError(BadRequestError):
    def __init__(self, response_id: str) -> None:
        super().__init__(f"response {response_id} has already finished; only a streamed response in progress "
                         "can be cancelled", "response_id", "response_already_finished")


class ResponsesService:
    """One per gateway process (it tracks the streamed responses running here)."""

    def __init__(self, completions: CompletionService) -> None:
        self.completions = completions
        self._running: dict[str, _Running] = {}

    async def create(self, body: ResponsesRequest, principal: Principal, client_gone: ClientGone
                     ) -> Body | AsyncIterator[str]:
        store_available = self.completions.tenancy.conversations is not None
        history = await self._history(body, principal, store_available)
        new = body.input_messages()
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = ChatCompletionRequest.model_validate({
            "model": body.model, "messages": system + history + new, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
            "stream_options": {"include_usage": True} if body.stream else None, "user": body.user})
        response_id = _PREFIX + uuid.uuid4().hex  # the stream's id too: a cancel finds it by this id
        outcome = await self.completions.chat(chat, principal, client_gone, completion_id=response_id)
        draft = await self._draft(body, response_id, principal, stored=body.store and store_available)
        if isinstance(outcome, JsonOutcome):
            choice = outcome.body["choices"][0]  # type: ignore[index]
            draft.text = choice["message"]["content"] or ""
            draft.usage = _usage(outcome.body["usage"])  # type: ignore[arg-type]
            draft.finish(choice["finish_reason"])
            await self._store(draft, principal, history + new)
            return draft.body()
        return self._events(draft, outcome.event_log, principal, history + new)

    async def cancel(self, response_id: str, principal: Principal) -> Body:
        """Stop a streamed response now and answer its final object (see the module docstring)."""
        owner = StreamOwner.of(principal)
        if not _is_response_id(response_id):  # never another API's stream, whatever its owner
            raise NotFoundError(f"response {response_id} not found")
        try:
            running = await self.completions.cancel(response_id, principal)
        except NotFoundError:
            if await self._is_stored(response_id, principal):  # a finished, non-streamed one
                raise ResponseFinishedError(response_id) from None
            raise NotFoundError(f"response {response_id} not found") from None
        here = self._running.get(response_id)
        if here is not None and here.owner == owner:
            with contextlib.suppress(TimeoutError):  # a client not reading its stream holds the last events
                async with asyncio.timeout(SETTLE_TIMEOUT_S):
                    await here.settled.wait()
            if here.settled.is_set() and here.draft.status != "cancelled":
                raise ResponseFinishedError(response_id)
            return here.draft.body() | {"status": "cancelled"}
        if not running:
            raise ResponseFinishedError(response_id)
        return await self._remote_body(response_id, principal)

    async def _remote_body(self, response_id: str, principal: Principal) -> Body:
        """The cancelled response run by another replica (or by no reader here), folded from its stream up
        to its end; one that ended otherwise before the cancel landed is a 400 as a finished one is."""
        source = (await self.completions.resume(response_id, -1, principal)).event_log
        draft = ResponseDraft(ResponsesRequest.model_construct(model="", input=""), response_id,
                              stored=await self._is_stored(response_id, principal))
        finish = None
        with contextlib.suppress(TimeoutError):  # the abort was sent: a slow end still ends cancelled
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                async for item in source.follow(-1, self.completions.config.stream.keepalive_s):
                    if item is None or item.data == "[DONE]":
                        continue
                    chunk = json.loads(item.data)
                    draft.request.model = chunk.get("model", draft.request.model)
                    draft.created_at = chunk.get("created", draft.created_at)
                    finish = draft.absorb(chunk)[1] or finish
        draft.finish(finish or "abort")
        if draft.status != "cancelled":
            raise ResponseFinishedError(response_id)
        return draft.body()

    async def _is_stored(self, response_id: str, principal: Principal) -> bool:
        if self.completions.tenancy.conversations is None:
            return False
        try:
            await self.completions.tenancy.conversation_store().get(
                principal.org_id, response_id_to_uuid(response_id), user=principal.user_id)
        except (NotFoundError, BadRequestError):
            return False
        return True

    async def _draft(self, body: ResponsesRequest, response_id: str, principal: Principal, *,
                     stored: bool) -> ResponseDraft:
        """A new response; when stored, a new conversation of the same id holds its turns."""
        if stored:
            await self.completions.tenancy.conversation_store().create(
                principal.org_id, principal.user_id, title="response", conversation_id=response_id_to_uuid(response_id))
        return ResponseDraft(body, response_id, stored=stored)

    async def _history(self, body: ResponsesRequest, principal: Principal, store_available: bool) -> list[Body]:
        if body.previous_response_id is None:
            return []
        if not store_available:
            raise FeatureDisabledError("previous_response_id (stored responses)", self.completions.tenancy.mode)
        messages = await self.completions.tenancy.conversation_store().messages(
            principal.org_id, response_id_to_uuid(body.previous_response_id), user=principal.user_id)
        return [{"role": m.role, "content": m.content} for m in messages]

    async def _store(self, draft: ResponseDraft, principal: Principal, turns: list[Body]) -> None:
        if not draft.stored or draft.status in ("failed", "cancelled"):
            return
        store = self.completions.tenancy.conversation_store()
        conversation_id = response_id_to_uuid(draft.response_id)
        for message in [*turns, {"role": "assistant", "content": draft.text}]:
            await store.append(principal.org_id, conversation_id, message["role"], message["content"])

    async def _events(self, draft: ResponseDraft, event_log: StreamSource, principal: Principal,
                      turns: list[Body]) -> AsyncIterator[str]:
        running = _Running(draft, StreamOwner.of(principal))
        self._running[draft.response_id] = running
        try:
            async for text in self._render(draft, event_log, principal, turns):
                yield text
        finally:
            self._running.pop(draft.response_id, None)
            running.settled.set()

    async def _render(self, draft: ResponseDraft, event_log: StreamSource, principal: Principal,
                      turns: list[Body]) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(seq)} | fields
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        where = {"item_id": draft.item_id, "output_index": 0}
        yield event("response.created", response=draft.body())
        yield event("response.in_progress", response=draft.body())
        yield event("response.output_item.added", output_index=0, item=draft.item("in_progress"))
        yield event("response.content_part.added", **where, content_index=0, part=draft.part())
        finish = None
        event_log.attach()
        completed = False
        try:
            async for item in event_log.follow(-1, self.completions.config.stream.keepalive_s):
                if item is None or item.data == "[DONE]":
                    continue
                chunk = json.loads(item.data)
                delta, finish_now = draft.absorb(chunk)
                finish = finish_now or finish
                if draft.error is not None and "error" in chunk:
                    yield event("error", **draft.error, param=None)
                if delta:
                    yield event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
            completed = True
        finally:
            event_log.detach(disconnected=not completed, resumable=False)  # no event ids: nobody resumes it
        draft.finish(finish)
        yield event("response.output_text.done", **where, content_index=0, text=draft.text, logprobs=[])
        yield event("response.content_part.done", **where, content_index=0, part=draft.part())
        yield event("response.output_item.done", output_index=0, item=draft.item("completed"))
        await self._store(draft, principal, turns)
        yield event(_TERMINAL.get(draft.status, "response.incomplete"), response=draft.body())


_TERMINAL = {"completed": "response.completed", "failed": "response.failed", "cancelled": "response.cancelled"}
