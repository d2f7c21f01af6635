"""`CompletionService`: what `/v1/chat/completions` and `/v1/completions` do, below the HTTP layer.

It turns a validated request into a `GenerationPlan` (model check, conversation history, prompt and
context window, sampling per choice), admits it (monthly budget, usage backlog, RPM/TPM lease), then
hands it to the `CompletionRunner` and returns an outcome for the route to render: a JSON body, or
an `EventLog` to stream. It raises typed errors only; the routes render them.

Streams run in a task of their own that writes the log; the response follows the log (so a client
can resume with Last-Event-ID, through any replica when the relay has Redis) and a client that hangs
up only detaches from it (streams.py: the generation runs on for the grace period). `cancel` aborts a
stream at once, wherever it runs. Non-streaming requests run in the request's task and are aborted
when `client_gone` returns (the client hung up).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from opentelemetry import trace

from services.common.errors import UsageBacklogFullError
from services.gateway.completions.catalog import ModelCatalog
from services.gateway.completions.constraints import guided_for_format, guided_for_tools
from services.gateway.completions.formatting import ChatFormatter, Formatter, ResponseMeta, TextFormatter, json_data
from services.gateway.completions.generation import SamplingSpec, derive_seed
from services.gateway.completions.prompt import PreparedPrompt, TemplateMessage
from services.gateway.completions.run_state import ChoiceEvent, ChoiceSpec, GenerationPlan
from services.gateway.completions.runner import CompletionRunner, Generation
from services.gateway.completions.tools import ToolPlan, family_for_template, history_messages
from services.gateway.config import GatewayConfig
from services.gateway.errors import BadRequestError, error_body
from services.gateway.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from services.gateway.streams.relay import LocalOnly, StreamRelay
from services.gateway.streams.replay_log import EventLog, StreamHub, StreamOwner, StreamSource
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.ratelimit import RateLimitLease
from tokenization.finish_reason import FinishReason

if TYPE_CHECKING:
    from services.gateway.completions.safety_gate import InputDecision
    from services.gateway.routing.router_client import RoutingDecision
    from services.gateway.tenancy.backends import TenantServices

log = logging.getLogger(__name__)
ClientGone = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class JsonOutcome:
    body: dict[str, object]
    headers: dict[str, str]


@dataclass(frozen=True)
class StreamOutcome:
    event_log: StreamSource
    after_seq: int
    headers: dict[str, str]


Outcome = JsonOutcome | StreamOutcome


@dataclass(frozen=True)
class _Request:
    """What chat and text requests share once their prompts are built."""

    kind: str  # "chat" | "text"
    prompts: list[PreparedPrompt]
    n: int
    sampling: SamplingSpec  # max_tokens of the first prompt; each choice uses its prompt's own
    stream: bool
    include_usage: bool
    want_logprobs: bool
    safety_texts: tuple[str, ...]  # every new text the model reads (all roles), for the input check
    echo: bool = False
    user: str | None = None
    conversation_id: uuid.UUID | None = None
    conversation_messages: tuple[TemplateMessage, ...] = ()
    safety_history: tuple[str, ...] = ()  # a continued conversation's stored turns (checked too, cached)
    tools: ToolPlan | None = None  # chat with callable tools: output parsed into tool_calls
    model: str = ""  # the served model's name, as the request asked

    @property
    def safety_chars(self) -> int:
        """The characters of the new texts the input check reads (the size label of its latency)."""
        return sum(len(t) for t in self.safety_texts)


class CompletionService:
    def __init__(self, config: GatewayConfig, models: ModelCatalog, runner: CompletionRunner,
                 tenancy: TenantServices, streams: StreamHub, relay: StreamRelay | None = None) -> None:
        self.config = config
        self.models = models
        self.runner = runner
        self.tenancy = tenancy
        self.rate_limiter = tenancy.admission
        self.budget = tenancy.budget
        self.streams = streams
        self.relay = relay or LocalOnly(streams.config)
        self._producers: set[asyncio.Task[None]] = set()
        self._logs: set[EventLog] = set()

    # ---- the two endpoints -------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, principal: Principal, client_gone: ClientGone,
                   completion_id: str | None = None) -> Outcome:
        """`completion_id`: the id to answer under (and stream as) instead of a new `chatcmpl-` one."""
        model = self.models.get(body.model)
        template = model.prompts.tokenizer.chat_template
        tools = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls, template)
        guided = guided_for_format(body.response_format)
        if tools is not None and guided is not None:
            raise BadRequestError("response_format cannot be combined with tools (unless tool_choice is none)",
                                  "response_format")
        if tools is not None:
            guided = await asyncio.to_thread(guided_for_tools, tools.grammar())
        new = history_messages(body.messages, tools.family if tools else family_for_template(template))
        history = await self._history(principal, body.conversation_id)
        shown_history, shown_new = (history, new) if tools is None else \
            ((tools.with_tools(history), new) if history else (history, tools.with_tools(new)))
        # Templating and tokenizing are CPU work: off the event loop, so one long prompt stalls no stream.
        prompt = await asyncio.to_thread(model.prompts.chat, shown_new, body.requested_max_tokens(), shown_history)
        sampling = replace(self._sampling(body, body.logprobs_count()), guided=guided)
        request = _Request(
            "chat", [prompt], body.n, sampling, body.stream,
            body.include_usage, body.logprobs, tuple(m["content"] for m in new),
            user=body.user, conversation_id=body.conversation_id, conversation_messages=tuple(new),
            safety_history=tuple(m["content"] for m in history), tools=tools, model=model.name)
        return await self._serve(request, principal, client_gone, completion_id)

    async def text(self, body: CompletionRequest, principal: Principal, client_gone: ClientGone) -> Outcome:
        model = self.models.get(body.model)
        if body.suffix:
            raise BadRequestError("suffix (insertion) is not supported by this model", "suffix")
        if body.n * len(body.prompts()) > MAX_CHOICES:
            raise BadRequestError(f"n times the number of prompts may be at most {MAX_CHOICES}", "n")
        prompts = [await asyncio.to_thread(model.prompts.text, p, body.requested_max_tokens()) for p in body.prompts()]
        request = _Request("text", prompts, body.n, self._sampling(body, body.logprobs), body.stream,
                           body.include_usage, body.logprobs is not None, tuple(p.text for p in prompts),
                           echo=body.echo, user=body.user, model=model.name)
        return await self._serve(request, principal, client_gone)

    async def resume(self, stream_id: str, after_seq: int, principal: Principal) -> StreamOutcome:
        """The stream's events after `after_seq`, then the live rest: from this replica's log when it
        holds it, else through the relay (404 unknown or not the caller's, 410 trimmed: before the head)."""
        owner = StreamOwner.of(principal)
        event_log = self.streams.owned(stream_id, owner)
        if event_log is not None:
            event_log.events_after(after_seq)  # 410 now, before the 200 head, if they are gone
            source: StreamSource = event_log
        else:
            source = await self.relay.open_remote(stream_id, owner, after_seq)
        self.runner.metrics.replays.inc()
        return StreamOutcome(source, after_seq, {})

    async def cancel(self, stream_id: str, principal: Principal) -> bool:
        """Abort a running stream now, wherever it runs; False when it had already finished."""
        owner = StreamOwner.of(principal)
        event_log = self.streams.owned(stream_id, owner)
        if event_log is None:
            return await self.relay.cancel_remote(stream_id, owner)
        if event_log.finished:
            return False
        event_log.abort_requested.set()
        return True

    # ---- building and admitting --------------------------------------------------------------

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, logprobs: int | None) -> SamplingSpec:
        return SamplingSpec(max_tokens=1, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop=tuple(body.stop_list()), presence_penalty=body.presence_penalty,
                            frequency_penalty=body.frequency_penalty, logprobs=logprobs,
                            num_draft_tokens=body.speculative.num_draft_tokens if body.speculative else None,
                            ignore_eos=body.ignore_eos, top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0,
                            repetition_penalty=body.repetition_penalty or 1.0,
                            stop_token_ids=tuple(body.stop_token_ids or ()))

    async def _history(self, principal: Principal, conversation_id: uuid.UUID | None) -> list[TemplateMessage]:
        if conversation_id is None:
            return []
        messages = await self.tenancy.conversation_store().messages(principal.org_id, conversation_id,
                                                                    user=principal.user_id)
        return [{"role": m.role, "content": m.content} for m in messages]

    def _plan(self, request: _Request, principal: Principal, lease: RateLimitLease,
              started_at: float, completion_id: str | None = None) -> GenerationPlan:
        if completion_id is None:
            completion_id = ("chatcmpl-" if request.kind == "chat" else "cmpl-") + secrets.token_urlsafe(18)
        choices = []
        for p, prompt in enumerate(request.prompts):
            for i in range(request.n):
                index = p * request.n + i
                request_id = completion_id if len(request.prompts) * request.n == 1 else f"{completion_id}-{index}"
                sampling = replace(request.sampling, max_tokens=prompt.max_tokens,
                                   seed=derive_seed(request.sampling.seed, index))
                choices.append(ChoiceSpec(index, request_id, prompt, sampling))
        return GenerationPlan(completion_id, int(time.time()), request.model, principal, tuple(choices),
                              lease, started_at, request.conversation_id, request.conversation_messages)

    async def _admit(self, request: _Request, principal: Principal) -> RateLimitLease:
        await self.budget.check(principal.org_id)
        pending = self.runner.usage.pending
        if pending >= self.config.usage_backlog_limit:  # fail closed rather than serve unbillable work
            raise UsageBacklogFullError(f"{pending} usage events await the broker; try again later")
        estimate = sum(len(p.token_ids) + p.max_tokens for p in request.prompts) * request.n
        return await self.rate_limiter.acquire(principal, estimate)

    async def _serve(self, request: _Request, principal: Principal, client_gone: ClientGone,
                     completion_id: str | None = None) -> Outcome:
        started_at = time.monotonic()
        span = trace.get_current_span()
        span.set_attribute("baton.org_id", str(principal.org_id))
        if request.user:
            span.set_attribute("enduser.id", request.user)  # OpenAI's `user`: recorded, not interpreted
        lease = await self._admit(request, principal)
        plan = self._plan(request, principal, lease, started_at, completion_id)
        headers = plan.lease.headers()
        try:
            screened = await self._screen(plan, request)
            if self.runner.safety is not None:
                headers = {**headers, **screened.timing_headers()}
            decisions = [] if screened.refusal is not None else await self.runner.place(plan)
            plan = await self._answered_by(plan, decisions)
        except BaseException:
            await self.rate_limiter.reconcile(plan.lease, 0)
            raise
        refusal = screened.refusal
        formatter = self._formatter(request, plan)
        generation = self.runner.start(plan, decisions, screened.watch)
        if refusal is not None:
            await self.rate_limiter.reconcile(plan.lease, 0)
            for state in generation.states:
                state.refusal = f"the request was refused by the content policy ({refusal.category or 'unsafe'})"
                state.finish(FinishReason.CONTENT_FILTER)
            self.runner.metrics.refusals.labels("input_filter").inc()
            if not request.stream:
                return JsonOutcome(formatter.response(generation.states, False), headers)
            return self._refusal_stream(plan, generation, formatter, request.include_usage, headers)
        if request.stream:
            return self._stream(plan, generation, formatter, request.include_usage, headers)
        return await self._collect(generation, formatter, request.want_logprobs, client_gone, headers)

    async def _screen(self, plan: GenerationPlan, request: _Request) -> InputDecision:
        """The input check, completed before placement and before any worker call.

        Why not overlapped with prefill, as it was (to hide the check's 10-30 ms from TTFT): a prompt
        that safety has not cleared then ran its prefill anyway, and a check that missed its deadline
        surfaced as an in-stream error of a request already admitted. A 1,000-word prompt's check took
        longer than its prefill, so the overlap bought nothing there and cost 7 s of worker time per
        refused or failed check. Now the check's time is added to TTFT, in full and visibly
        (`Server-Timing: safety;dur=`), an outage is a 503 with Retry-After before any stream opens,
        and a refused prompt costs no scheduler slot and no GPU time. Overlapping the check with the
        scheduler call alone (which costs no worker time) was not kept: that call takes ~1 ms, and a
        refused prompt would have held a slot of a saturated cluster meanwhile.
        """
        decision = await self.runner.precheck(plan, request.safety_history, request.safety_texts)
        if self.runner.safety is not None:
            self.runner.metrics.observe_safety_check(decision.seconds, request.safety_chars)
        return decision

    async def _answered_by(self, plan: GenerationPlan, decisions: list[RoutingDecision]) -> GenerationPlan:
        """The plan as its workers will answer it: the model a degraded placement switched to (the
        response's and the bill's `model` say which), once the gateway checked it can serve it."""
        served = next((d.model for d in decisions if d.model and d.model != plan.model), None)
        if served is None:
            return plan
        try:
            self.models.fallback(plan.model, served, (c.prompt for c in plan.choices))
        except BaseException:
            for decision in decisions:
                await self.runner.router.finished(decision.request_id)
            raise
        return replace(plan, model=served)

    def _formatter(self, request: _Request, plan: GenerationPlan) -> Formatter:
        meta = ResponseMeta(plan.completion_id, plan.created, plan.model, request.n, request.include_usage,
                            tuple(p.text for p in request.prompts) if request.echo else (),
                            str(request.conversation_id) if request.conversation_id else None)
        tokens = self.models.get(plan.model).tokens
        return ChatFormatter(meta, tokens, request.tools) if request.kind == "chat" else TextFormatter(meta, tokens)

    # ---- responding --------------------------------------------------------------------------

    async def _collect(self, generation: Generation, formatter: Formatter, want_logprobs: bool,
                       client_gone: ClientGone, headers: dict[str, str]) -> JsonOutcome:
        abort = asyncio.Event()
        watcher = asyncio.ensure_future(client_gone())
        watcher.add_done_callback(lambda f: None if f.cancelled() else abort.set())
        try:
            await generation.run(None, abort)
        finally:
            watcher.cancel()
            await generation.finish()
        if generation.error is not None:
            raise generation.error
        return JsonOutcome(formatter.response(generation.states, want_logprobs), headers)

    def _stream(self, plan: GenerationPlan, generation: Generation, formatter: Formatter, include_usage: bool,
                headers: dict[str, str]) -> StreamOutcome:
        event_log = self._open_log(plan)
        self._spawn(self._produce(generation, formatter, include_usage, event_log), event_log)
        return StreamOutcome(event_log, -1, headers)

    def _refusal_stream(self, plan: GenerationPlan, generation: Generation, formatter: Formatter,
                        include_usage: bool, headers: dict[str, str]) -> StreamOutcome:
        event_log = self._open_log(plan)
        for state in generation.states:
            event_log.append(json_data(formatter.chunk(
                ChoiceEvent(state.spec.index, "", (), (), FinishReason.CONTENT_FILTER, state.refusal))))
        self._finish_log(event_log, formatter, generation, include_usage)
        return StreamOutcome(event_log, -1, headers)

    def _open_log(self, plan: GenerationPlan) -> EventLog:
        event_log = self.streams.open(plan.completion_id, StreamOwner.of(plan.principal))
        self.relay.publish(event_log)
        return event_log

    async def _produce(self, generation: Generation, formatter: Formatter, include_usage: bool,
                       event_log: EventLog) -> None:
        try:
            def emit(event: ChoiceEvent) -> None:
                event_log.append(json_data(formatter.chunk(event)))

            await generation.run(emit, event_log.abort_requested)
            error = generation.error
            if error is not None:
                event_log.append(json_data(error_body(error.http_status, str(error), error.code)))
            await generation.record_usage()  # the usage is durable before the client sees [DONE]
            self._finish_log(event_log, formatter, generation, include_usage)
        finally:
            event_log.finish()
            await generation.finish()

    @staticmethod
    def _finish_log(event_log: EventLog, formatter: Formatter, generation: Generation, include_usage: bool) -> None:
        if include_usage:
            event_log.append(json_data(formatter.usage_chunk(generation.states)))
        event_log.append("[DONE]")
        event_log.finish()

    def _spawn(self, coroutine: Awaitable[None], event_log: EventLog) -> None:
        task = asyncio.ensure_future(coroutine)
        self._producers.add(task)
        self._logs.add(event_log)

        def done(t: asyncio.Future[None]) -> None:
            self._producers.discard(t)  # type: ignore[arg-type]
            self._logs.discard(event_log)
            if not t.cancelled() and t.exception() is not None:
                log.error("stream %s failed", event_log.stream_id, exc_info=t.exception())
        task.add_done_callback(done)

    @property
    def active_streams(self) -> int:
        return len(self._producers)

    async def close(self, timeout_s: float) -> None:
        """Shutdown: let running streams finish for `timeout_s`, then abort the rest (KV freed, billed)."""
        if self._producers:
            await asyncio.wait(set(self._producers), timeout=timeout_s)
        for event_log in list(self._logs):
            event_log.abort_requested.set()
        if self._producers:
            await asyncio.wait(set(self._producers), timeout=5.0)

