"""`/v1/responses` (OpenAI's Responses API: text and function tools) on top of the chat completion service.

A response runs as a chat completion (same admission, safety, routing, billing): `instructions`
becomes a leading system message, `input` (a string or a list of messages) the user turn(s), and with
`previous_response_id` the stored turns of that response come first. `instructions` are not carried
over to the next response, as OpenAI documents. Function `tools` / `tool_choice` /
`parallel_tool_calls` are the chat path's (tools.py: same prompt, grammar and parser): a call comes
out as a `function_call` output item, and goes back in as a `function_call` input item with its
`function_call_output` (an assistant turn with `tool_calls`, then a `tool` turn).

Storage (`store`, default true) uses the conversation store: a response *is* a conversation whose id
gives the response id (`resp_<uuid hex>`); it holds the whole history (copied from the previous
response, then this input and the output), so any stored response can be continued, and deleting it
never breaks another. Calls and their outputs are stored as text spelled the way the model's tool
family reads them (`storable_turns`), which is what the prompt holds anyway. In open mode
(`BATON_AUTH_MODE=none`) there is no database: responses are served but not stored (`store: false` in
the body), and `previous_response_id` is a 501.

Streaming follows the documented event sequence: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
`response.completed` (or `response.incomplete` when max_output_tokens cut it, `error` then
`response.failed` when the worker failed mid-stream), each with a `sequence_number` counting from 0.
The message item opens with its first text; each tool call is a `function_call` item streamed whole:
`response.output_item.added`, `response.function_call_arguments.delta` / `.done`,
`response.output_item.done` (a call-only answer has no message item).
A failed response keeps no turns (continuing it starts afresh). Its conversation row is created only
once the request is admitted, so a refused request (429, 400) leaves no empty response behind.

Cancel (`POST /v1/responses/{id}/cancel`): a streamed response runs as a stream whose id *is* the
response id, so the stream cancel of services/gateway/completions/service.py stops it at once, from any replica. The
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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from services.common.errors import NotFoundError
from services.gateway.completions.response_draft import RESPONSE_ID_PREFIX, ResponseDraft, response_usage
from services.gateway.completions.service import ClientGone, CompletionService, JsonOutcome
from services.gateway.completions.tools import ToolFamily, family_for_template, history_messages
from services.gateway.errors import BadRequestError, FeatureDisabledError, validation_message
from services.gateway.schemas import ChatCompletionRequest, ChatMessage, ResponsesRequest
from services.gateway.streams.replay_log import StreamOwner, StreamSource
from services.gateway.tenancy.auth import Principal
from tokenization.finish_reason import FinishReason

Body = dict[str, Any]
_PREFIX = RESPONSE_ID_PREFIX
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
        chat = _chat_request({
            "model": body.model, "messages": system + history + new, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
            "stream_options": {"include_usage": True} if body.stream else None, "user": body.user,
            **body.chat_tools()})
        response_id = _PREFIX + uuid.uuid4().hex  # the stream's id too: a cancel finds it by this id
        outcome = await self.completions.chat(chat, principal, client_gone, completion_id=response_id)
        draft = await self._draft(body, response_id, principal, stored=body.store and store_available)
        if isinstance(outcome, JsonOutcome):
            choice = outcome.body["choices"][0]  # type: ignore[index]
            draft.absorb_message(choice["message"])
            draft.usage = response_usage(outcome.body["usage"])  # type: ignore[arg-type]
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
        draft.finish(finish or FinishReason.ABORT)
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
        answer = {"role": "assistant", "content": draft.text or None, "tool_calls": draft.calls or None}
        template = self.completions.models.get(draft.request.model).prompts.tokenizer.chat_template
        for message in storable_turns([*turns, answer], family_for_template(template)):
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
        events = _EventWriter(draft)
        yield events.write("response.created", response=draft.body())
        yield events.write("response.in_progress", response=draft.body())
        finish = None
        event_log.attach()
        completed = False
        try:
            async for item in event_log.follow(-1, self.completions.config.stream.keepalive_s):
                if item is None or item.data == "[DONE]":
                    continue
                chunk = json.loads(item.data)
                calls_before = len(draft.calls)
                delta, finish_now = draft.absorb(chunk)
                finish = finish_now or finish
                if draft.error is not None and "error" in chunk:
                    yield events.write("error", **draft.error, param=None)
                for text in events.text_delta(delta):
                    yield text
                for index in range(calls_before, len(draft.calls)):
                    for text in events.call(index):
                        yield text
            completed = True
        finally:
            event_log.detach(disconnected=not completed, resumable=False)  # no event ids: nobody resumes it
        draft.finish(finish)
        for text in events.message_done():
            yield text
        await self._store(draft, principal, turns)
        yield events.write(_TERMINAL.get(draft.status, "response.incomplete"), response=draft.body())


class _EventWriter:
    """The streamed `response.*` events of one draft, numbered from 0. The message item opens with its
    first text (or at the end, empty, when there was neither text nor a call); each tool call is one
    `function_call` item, whole: added, its arguments in one delta, done."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.seq = 0
        self.message_open = False

    def write(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> Body:
        return {"item_id": self.draft.item_id, "output_index": self.draft.message_index()}

    def text_delta(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = [] if self.message_open else self._open_message()
        return [*out, self.write("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                 logprobs=[])]

    def _open_message(self) -> list[str]:
        self.message_open = True
        draft = self.draft
        return [self.write("response.output_item.added", output_index=draft.message_index(),
                           item=draft.item("in_progress") | {"content": []}),
                self.write("response.content_part.added", **self._where(), content_index=0,
                           part=draft.part() | {"text": ""})]

    def call(self, index: int) -> list[str]:
        draft = self.draft
        item, where = draft.call_item(index), {"item_id": draft.call_item(index)["id"],
                                               "output_index": draft.call_index(index)}
        return [self.write("response.output_item.added", output_index=where["output_index"],
                           item=draft.call_item(index, "in_progress")),
                self.write("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self.write("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self.write("response.output_item.done", output_index=where["output_index"], item=item)]

    def message_done(self) -> list[str]:
        draft = self.draft
        if not self.message_open and not draft.has_message:
            return []
        out = [] if self.message_open else self._open_message()
        where = self._where()
        return [*out, self.write("response.output_text.done", **where, content_index=0, text=draft.text, logprobs=[]),
                self.write("response.content_part.done", **where, content_index=0, part=draft.part()),
                self.write("response.output_item.done", output_index=where["output_index"],
                           item=draft.item("completed"))]


def _chat_request(fields: Body) -> ChatCompletionRequest:
    """The chat completion a response runs as; what the response's own schema let through but the chat
    schema refuses (a tool description too long for it, say) is a 400 as well, never a 500."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e)
        raise BadRequestError(message, param) from e


def storable_turns(messages: list[Body], family: ToolFamily) -> list[Body]:
    """Chat messages as conversation rows (role + text): tool calls and results spelled as the model's
    tool family reads them, which is what they become in the prompt anyway, so a continued response
    sees the same prompt. (Llama 3's `ipython` turn is stored as a `tool` turn and read back as one.)"""
    spelled = history_messages([ChatMessage.model_validate(m) for m in messages], family)
    return [{"role": "tool" if m["role"] == "ipython" else m["role"], "content": m["content"]} for m in spelled]


_TERMINAL = {"completed": "response.completed", "failed": "response.failed", "cancelled": "response.cancelled"}
