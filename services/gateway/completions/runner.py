"""`CompletionRunner`: safety pre-check, placement, the n generations, and everything at the end.

Order for one request (the HTTP layer has authenticated, tokenized and admitted it already):
1. `precheck`: the safety pre-filter on every text the model will read (all roles, stored history),
   completed before anything else: a refusal or an outage means no scheduler or worker call.
2. `place`: one routing decision per choice (each choice is its own request to the scheduler). A
   REJECT is a 503 with Retry-After, and releases the choices already placed.
3. `Generation.run`: the choices stream concurrently; each delta goes through the safety output
   filter (a HALT aborts that worker stream and finishes the choice with `content_filter`), then to
   `emit`. Setting `abort` (client gone, shutdown) cancels every choice: the worker call is cancelled
   and `Abort` is sent, so its KV blocks are freed. A choice whose worker is lost is retried or
   migrated to another worker (services/gateway/completions/migration.py), invisibly to the client.
4. `Generation.finish`: always runs, also after an abort. One usage event per generation that reached
   a worker (finish reason stop/length/abort/content_filter/error, timings), recorded in the usage
   outbox before the response ends (`record_usage`; a stream awaits it before `[DONE]`), the rate-limit lease
   settled with the real token count, the scheduler told, the conversation appended, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from scheduler.types import SLO, RequestSummary, Tier
from services.billing.events import UsageEvent
from services.common.errors import BatonError
from services.gateway.completions.choice_group import group_first_attempts
from services.gateway.completions.generation import (
    GenerateTarget,
    GenerationDelta,
    SamplingSpec,
    WorkerClient,
    WorkerLostError,
)
from services.gateway.completions.migration import (
    Attempt,
    MigrationOutcome,
    MigrationPolicy,
    first_attempt,
    next_attempt,
)
from services.gateway.completions.output_gate import OutputGate
from services.gateway.completions.run_state import ChoiceEvent, ChoiceSpec, ChoiceState, GenerationPlan
from services.gateway.completions.safety_gate import UNAVAILABLE_TIER, InputDecision, SafetyGate, SafetyVerdict
from services.gateway.errors import OverloadedError, UpstreamError
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing.router_client import RouterClient, RouteSource, RoutingDecision
from services.gateway.tenancy.backends import Admission, UsageSink
from services.gateway.tracing import tracer
from tokenization.finish_reason import FinishReason

if TYPE_CHECKING:
    from services.gateway.db.conversations import ConversationStore, Role

log = logging.getLogger(__name__)
Emit = Callable[[ChoiceEvent], None]


class CompletionRunner:
    def __init__(self, workers: WorkerClient, router: RouterClient, safety: SafetyGate | None,
                 usage: UsageSink, rate_limiter: Admission, conversations: ConversationStore | None,
                 metrics: GatewayMetrics, slos: dict[str, SLO], migration: MigrationPolicy) -> None:
        self.workers = workers
        self.router = router
        self.safety = safety
        self.usage = usage
        self.rate_limiter = rate_limiter
        self.conversations = conversations
        self.metrics = metrics
        self.slos = slos
        self.migration = migration
        self._background: set[asyncio.Task[None]] = set()

    def spawn_close(self, gate: OutputGate) -> None:
        """Close a safety filter in the background (a cancelled choice must not wait on it)."""
        task = asyncio.get_running_loop().create_task(gate.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def precheck(self, plan: GenerationPlan, history: tuple[str, ...], new: tuple[str, ...]) -> InputDecision:
        """The input check of every text the model will read (`history`: stored turns, checked once
        per text thanks to the gate's cache; `new`: this request's messages of every role)."""
        if self.safety is None:
            return InputDecision(None)
        return await self.safety.check_texts(plan.principal.org_id, history, new, plan.completion_id)

    async def place(self, plan: GenerationPlan) -> list[RoutingDecision]:
        """One routing decision per choice, in the order of `plan.choices`. The choices of one prompt
        (n > 1) are placed together: one Route for all of them (`RequestSummary.num_choices`), whose
        decision each takes under its own request id, so the worker prefills the prompt once for the
        group and no choice is placed while a sibling waits or is refused."""
        placed: dict[str, RoutingDecision] = {}
        try:
            for group in _prompt_groups(plan.choices):
                lead = group[0]
                attempt = first_attempt(lead.request_id, lead.prompt.token_ids, lead.sampling)
                summary = replace(self.summary(plan, lead, attempt), num_choices=len(group),
                                  max_tokens=max(spec.sampling.max_tokens for spec in group))
                decision = await self.router.route(summary)
                if not decision.is_placed or decision.decode_address is None:
                    self.metrics.refusals.labels("scheduler_reject").inc()
                    raise OverloadedError(f"no capacity for this request now ({decision.reason or 'rejected'})",
                                          decision.retry_after_s)
                for spec in group:
                    placed[spec.request_id] = replace(decision, request_id=spec.request_id)
                if decision.model and decision.model != plan.model:  # degraded to a smaller model:
                    plan = replace(plan, model=decision.model)  # the other prompts ask for it too
        except BaseException:
            for decision in placed.values():
                await self.router.finished(decision.request_id)
            raise
        return [placed[spec.request_id] for spec in plan.choices]

    def summary(self, plan: GenerationPlan, spec: ChoiceSpec, attempt: Attempt) -> RequestSummary:
        """What the scheduler is told about one attempt of a choice. A migration's prompt starts with
        the original one, so the original's block hashes are a valid (shorter) prefix of its own."""
        return RequestSummary(
            request_id=attempt.request_id, num_prompt_tokens=len(attempt.prompt_token_ids),
            prefix_hashes=tuple(spec.prompt.prefix_hashes), tier=Tier(plan.principal.tier),
            slo=self.slos[plan.principal.tier], max_tokens=attempt.sampling.max_tokens, model=plan.model,
            conversation_id=str(plan.conversation_id) if plan.conversation_id else None)

    def start(self, plan: GenerationPlan, decisions: list[RoutingDecision], watch: bool = False) -> Generation:
        return Generation(self, plan, decisions, watch)


def _prompt_groups(choices: tuple[ChoiceSpec, ...] | list[ChoiceSpec]) -> list[list[ChoiceSpec]]:
    """The choices grouped by the prompt they continue (one group per prompt, in order)."""
    groups: dict[int, list[ChoiceSpec]] = {}
    for spec in choices:
        groups.setdefault(id(spec.prompt), []).append(spec)
    return list(groups.values())


class Generation:
    """The running choices of one plan. `run` once, then `finish` once (also after errors)."""

    def __init__(self, runner: CompletionRunner, plan: GenerationPlan, decisions: list[RoutingDecision],
                 watch: bool = False) -> None:
        """`plan`'s input check has passed (`CompletionService._screen`) before a Generation exists."""
        self.runner = runner
        self.plan = plan
        self.decisions = decisions
        self.watch = watch  # the prompt scored in the safety classifier's uncertain band
        self.states = [ChoiceState(spec) for spec in plan.choices]
        self._usage_recorded = False
        # n > 1: choices of one prompt on one worker share a call, so the prompt is prefilled once.
        samplings = [_capped(s.sampling, d) for s, d in zip(plan.choices, decisions, strict=False)]  # none if refused
        self._grouped = group_first_attempts(runner.workers, plan, decisions, samplings)

    @property
    def error(self) -> BatonError | None:
        return next((s.error for s in self.states if s.error is not None), None)

    async def run(self, emit: Emit | None, abort: asyncio.Event) -> None:
        metrics = self.runner.metrics
        metrics.inflight.inc(len(self.states))
        tasks = [asyncio.create_task(self._run_choice(slot, state, emit)) for slot, state in enumerate(self.states)]
        watcher = asyncio.create_task(abort.wait())

        def on_abort(_: object) -> None:
            if abort.is_set():
                for task in tasks:
                    task.cancel()
        watcher.add_done_callback(on_abort)
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for state, outcome in zip(self.states, outcomes, strict=True):
                if isinstance(outcome, Exception):  # a bug: _run_choice handles expected failures
                    log.error("choice %s failed unexpectedly", state.spec.request_id, exc_info=outcome)
                    state.error = UpstreamError(f"generation failed: {outcome!r}")
                    state.finish(FinishReason.ERROR)
        finally:
            watcher.cancel()
            for unclaimed in self._grouped.values():  # a choice cancelled before it called: leave the group
                unclaimed.abort()
            metrics.inflight.dec(len(self.states))
            for state in self.states:
                if state.finish_reason is None:
                    state.finish(FinishReason.ABORT)  # a resumed stream sees how an aborted choice ended
                    if emit is not None:
                        emit(ChoiceEvent(state.spec.index, "", (), (), FinishReason.ABORT))

    async def _run_choice(self, slot: int, state: ChoiceState, emit: Emit | None) -> None:
        """Stream the choice from its worker; a lost worker's choice is taken over by another one."""
        spec = state.spec
        attempt = first_attempt(spec.request_id, spec.prompt.token_ids, _capped(spec.sampling, self.decisions[slot]))
        base, lost = attempt.sampling, set[str]()
        out = _Output()
        try:
            while True:
                try:
                    await self._stream_attempt(self.decisions[slot], state, attempt, out, emit)
                    return
                except WorkerLostError as e:
                    lost.add(e.address)
                    self.runner.router.report_lost(e.address, e.reason, str(e))
                    attempt = await self._take_over(slot, state, attempt, base, frozenset(lost), e)
        except BatonError as e:
            state.error = e
            state.finish(FinishReason.ERROR)
        finally:
            if out.gate.output_filter is not None:
                self.runner.spawn_close(out.gate)

    async def _stream_attempt(self, decision: RoutingDecision, state: ChoiceState, attempt: Attempt,
                              out: _Output, emit: Emit | None) -> None:
        """One worker call, to the choice's finish; raises WorkerLostError when the worker is lost."""
        spec, plan = state.spec, self.plan
        assert decision.decode_address is not None
        target = GenerateTarget(decision.decode_address, decision.prefill_address,
                                local_prefill_decided=decision.source is RouteSource.SCHEDULER)
        with tracer.start_as_current_span("gateway.generate", attributes={
                "baton.request_id": spec.request_id, "baton.decode_worker": target.decode_address,
                "baton.prompt_tokens": len(attempt.prompt_token_ids), "baton.attempt": attempt.number}):
            grouped = self._grouped.pop(attempt.request_id, None) if attempt.number == 0 else None
            stream = grouped or self.runner.workers.generate(target, attempt.request_id, attempt.prompt_token_ids,
                                                             attempt.sampling, plan.principal.tier)
            messages = 0  # counted here, added to the metric once: the loop runs per streamed message
            try:
                async for delta in stream:
                    messages += 1
                    if attempt.continuation is not None:
                        delta = attempt.continuation.translate(delta)
                    if not out.opened:  # the first response: open the output filter (once per choice)
                        out.opened = True
                        if self.runner.safety is not None:
                            out.gate = OutputGate(await self.runner.safety.open_output_filter(
                                plan.principal.org_id, spec.request_id, self.watch))
                    if await self._on_delta(state, delta, out.gate, emit):
                        return
            finally:
                stream.abort()  # no-op after a finish; else cancels the call and frees the KV
                self.runner.metrics.worker_messages.inc(messages)

    async def _take_over(self, slot: int, state: ChoiceState, lost_attempt: Attempt, base: SamplingSpec,
                         lost: frozenset[str], error: WorkerLostError) -> Attempt:
        """Place the choice again, away from the lost workers: a retry before its first token, a
        migration (prompt + tokens so far) after. Raises `error` when the limit is reached or no
        worker is left, which ends the choice with the clean error the client sees."""
        runner, spec = self.runner, state.spec
        metrics = runner.metrics.migrations
        if lost_attempt.number >= runner.migration.max_migrations:
            metrics.labels(MigrationOutcome.LIMIT_EXCEEDED.value).inc()
            log.error("choice %s: %s; not moved again (limit %d)", spec.request_id, error,
                      runner.migration.max_migrations)
            raise error
        await runner.router.finished(self.decisions[slot].request_id)
        attempt = next_attempt(lost_attempt, spec.request_id, spec.prompt.token_ids, base, state.token_ids,
                               runner.migration.tokenizer)
        decision = await runner.router.route(runner.summary(self.plan, spec, attempt), lost)
        self.decisions[slot] = decision  # released by `finish`, whatever happens next
        if not decision.is_placed or decision.decode_address is None:
            metrics.labels(MigrationOutcome.NO_WORKER.value).inc()
            log.error("choice %s: %s; no other worker to move to (%s)", spec.request_id, error, decision.reason)
            raise error
        outcome = MigrationOutcome.MIGRATED if attempt.migrated else MigrationOutcome.RETRIED
        metrics.labels(outcome.value).inc()
        log.warning("choice %s: %s; %s to %s after %d tokens", spec.request_id, error, outcome.value,
                    decision.decode_address, len(state.token_ids))
        return replace(attempt, sampling=_capped(attempt.sampling, decision))

    async def _on_delta(self, state: ChoiceState, delta: GenerationDelta, gate: OutputGate,
                        emit: Emit | None) -> bool:
        """Account one worker response and pass it on; True when the choice is finished."""
        if delta.num_prompt_tokens:
            state.worker_answered = True
            state.prompt_tokens, state.cached_tokens = delta.num_prompt_tokens, delta.num_cached_tokens
        if delta.token_ids and state.first_token_at is None:
            state.first_token_at = time.monotonic()
        state.token_ids.extend(delta.token_ids)  # billed even when the filter withholds their text
        # Text goes out at once; the gate's filter checks it behind (the final chunk waits for it).
        text, halt = await gate.admit(delta.text, len(delta.token_ids), final=delta.finish_reason is not None)
        if halt is not None:
            self._halt(state, halt, emit)
            return True
        state.text_parts.append(text)
        state.logprobs.extend(delta.logprobs)
        if delta.finish_reason == FinishReason.ERROR:
            state.error = UpstreamError(f"the worker failed the generation: {delta.error}")
        if emit is not None and (text or delta.finish_reason or delta.logprobs):
            emit(ChoiceEvent(state.spec.index, text, delta.token_ids, delta.logprobs, delta.finish_reason))
        if delta.finish_reason is not None:
            state.finish(delta.finish_reason)
            return True
        return False

    def _halt(self, state: ChoiceState, verdict: SafetyVerdict, emit: Emit | None) -> None:
        self.runner.metrics.refusals.labels("output_filter").inc()
        if verdict.tier == UNAVAILABLE_TIER:  # output configured to fail closed, and the check failed
            state.refusal = "the output was stopped: the safety service could not check it"
        else:
            state.refusal = f"the output was stopped by the content policy ({verdict.category or 'unsafe'})"
        state.finish(FinishReason.CONTENT_FILTER)
        if emit is not None:
            emit(ChoiceEvent(state.spec.index, "", (), (), FinishReason.CONTENT_FILTER, state.refusal))

    async def record_usage(self) -> None:
        """Make each billed choice's usage durable (once; `finish` calls it too). A stream awaits it
        before its final `[DONE]`, so a request a client saw complete is never unbilled."""
        if self._usage_recorded:
            return
        self._usage_recorded = True
        for state in self.states:
            state.finish(FinishReason.ABORT)
            if state.worker_answered or state.token_ids:
                await self._record_usage(state)

    async def finish(self) -> None:
        """Bill, settle, release, store. Errors here are logged, never raised: the response is out."""
        runner, plan = self.runner, self.plan
        await self.record_usage()
        actual = 0
        for state in self.states:
            billed = state.worker_answered or bool(state.token_ids)
            if billed:
                actual += state.prompt_tokens + len(state.token_ids)
            runner.metrics.observe_generation(
                plan.model, state.finish_reason or FinishReason.ABORT, state.prompt_tokens if billed else 0,
                state.cached_tokens, len(state.token_ids),
                None if state.first_token_at is None else state.first_token_at - plan.started_at,
                (state.finished_at or time.monotonic()) - plan.started_at)
        for decision in self.decisions:
            await runner.router.finished(decision.request_id)
        try:
            await runner.rate_limiter.reconcile(plan.lease, actual)
        except Exception as e:  # Redis down: the estimate stays charged, which errs on the safe side
            log.warning("rate-limit reconcile for %s failed: %s", plan.completion_id, e)
        await self._store_conversation()

    async def _record_usage(self, state: ChoiceState) -> None:
        plan = self.plan
        ttft = None if state.first_token_at is None else (state.first_token_at - plan.started_at) * 1000
        end = state.finished_at or time.monotonic()
        try:
            await self.runner.usage.record(UsageEvent(
                request_id=state.spec.request_id, org_id=plan.principal.org_id, api_key_id=plan.principal.key_id,
                model=plan.model, prompt_tokens=state.prompt_tokens,
                cached_tokens=min(state.cached_tokens, state.prompt_tokens), completion_tokens=len(state.token_ids),
                finish_reason=state.finish_reason or FinishReason.ABORT, ttft_ms=ttft,
                e2e_ms=(end - plan.started_at) * 1000,
                created_at=datetime.now(UTC)))
        except BatonError as e:
            log.error("usage event %s not recorded: %s", state.spec.request_id, e)

    async def _store_conversation(self) -> None:
        plan, store = self.plan, self.runner.conversations
        if store is None or plan.conversation_id is None or not any(s.worker_answered for s in self.states):
            return
        org = plan.principal.org_id
        first = self.states[0]
        try:
            last = len(plan.conversation_messages) - 1
            for i, message in enumerate(plan.conversation_messages):
                role: Role = message["role"]  # type: ignore[assignment]
                await store.append(
                    org, plan.conversation_id, role, message["content"],
                    prompt_tokens=first.prompt_tokens if i == last else None)
            if first.text:
                await store.append(org, plan.conversation_id, "assistant", first.text,
                                                       completion_tokens=len(first.token_ids))
        except BatonError as e:  # deleted meanwhile: the reply was served, nothing to store it in
            log.info("conversation %s not appended: %s", plan.conversation_id, e)


@dataclass
class _Output:
    """A choice's output side, kept across its attempts: the safety filter is opened once, at the
    first response of whichever worker answers first."""

    gate: OutputGate = field(default_factory=lambda: OutputGate(None))
    opened: bool = False


def _capped(sampling: SamplingSpec, decision: RoutingDecision) -> SamplingSpec:
    """`sampling` with the scheduler's lower max_tokens, when it degraded the request."""
    if decision.max_tokens is not None and decision.max_tokens < sampling.max_tokens:
        return replace(sampling, max_tokens=decision.max_tokens)
    return sampling
