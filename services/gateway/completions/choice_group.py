"""n > 1 on one worker call: the choices of one prompt placed on the same worker share a `Generate`.

The worker then prefills the prompt once and shares its KV among the choices (under disaggregation:
one remote prefill, the choices forked on the decode worker; see docs/architecture.md). Each choice
still reads its own stream with `GenerationStream`'s face (iterate for `GenerationDelta`s, `abort()`),
so the runner treats it like any other: aborting one choice sends `Abort(its id)` and leaves the
others running; the call is cancelled once no choice is left. A failure of the call (the worker lost)
reaches every choice still open, and each is taken over on its own. Only first attempts are grouped:
a retry or a migration is a request of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from rpcgen.baton.v1 import worker_pb2 as wpb
from scheduler.types import WorkerFailure
from services.common.errors import BatonError
from services.gateway.completions.generation import (
    GenerateTarget,
    GenerationDelta,
    SamplingSpec,
    WorkerClient,
    WorkerLostError,
    delta_from_proto,
    error_from_status,
)
from services.gateway.completions.run_state import GenerationPlan
from services.gateway.routing.router_client import RouteSource, RoutingDecision

_End = BaseException | None  # a choice's queue ends with None (done) or the call's error


@dataclass(frozen=True)
class GroupMember:
    request_id: str
    sampling: SamplingSpec


class ChoiceStream:
    """One choice of a `ChoiceGroup` (the face of `GenerationStream`)."""

    def __init__(self, group: ChoiceGroup, request_id: str) -> None:
        self._group = group
        self.request_id = request_id
        self.queue: asyncio.Queue[GenerationDelta | _End] = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        self._group.start()
        while (item := await self.queue.get()) is not None:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finish_reason is not None:
                self.finished = True
            yield item
            if self.finished:
                return

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._group.leave(self)


class ChoiceGroup:
    """One `Generate` call carrying several choices of one prompt (`GenerateRequest.choices`)."""

    def __init__(self, client: WorkerClient, target: GenerateTarget, prompt_token_ids: list[int],
                 members: Sequence[GroupMember], tier: str) -> None:
        if len(members) < 2:
            raise ValueError("a choice group needs at least two choices")
        self._client = client
        self._target = target
        first = members[0]
        self._request = wpb.GenerateRequest(
            request_id=first.request_id, prompt_token_ids=prompt_token_ids, sampling=first.sampling.to_proto(),
            prefill_mode=target.prefill_mode, prefill_worker=target.prefill_address or "", tier=tier,  # type: ignore[arg-type]
            choices=[wpb.Choice(request_id=m.request_id, sampling=m.sampling.to_proto()) for m in members[1:]])
        self.streams = {m.request_id: ChoiceStream(self, m.request_id) for m in members}
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._pump: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Open the call (once, when the first choice starts reading)."""
        if self._call is None:
            self._call = self._client.stub(self._target.decode_address).Generate(
                self._request, metadata=self._client.call_metadata())
            self._pump = asyncio.ensure_future(self._route(self._call))

    def leave(self, stream: ChoiceStream) -> None:
        """A choice stops early: the worker aborts it alone, or the whole call once none is left."""
        address = self._target.decode_address
        if all(s.finished for s in self.streams.values()) and self._call is not None:
            self._call.cancel()
        self._client.send_abort(address, stream.request_id)

    async def _route(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Hand every response to its choice; the call's end (or failure) to every choice still open."""
        end: _End = None
        try:
            async for msg in call:
                stream = self.streams.get(msg.request_id)
                if stream is not None and not stream.finished:
                    stream.queue.put_nowait(delta_from_proto(msg))
            address = self._target.decode_address
            end = WorkerLostError(f"worker {address} ended the stream without finishing every choice", address,
                                  WorkerFailure.STREAM_BROKEN)
        except grpc.aio.AioRpcError as e:
            end = None if e.code() == grpc.StatusCode.CANCELLED else error_from_status(e, self._target.decode_address)
        except BatonError as e:
            end = e
        for stream in self.streams.values():
            stream.queue.put_nowait(end)  # read only by a choice that has not finished


def group_first_attempts(client: WorkerClient, plan: GenerationPlan, decisions: Sequence[RoutingDecision],
                         samplings: Sequence[SamplingSpec]) -> dict[str, ChoiceStream]:
    """The first-attempt streams of choices that share a prompt and were placed on the same worker
    target, by choice request id; a choice alone on its target is not in it (it calls on its own)."""
    if len(decisions) != len(plan.choices):
        return {}
    groups: dict[tuple[int, GenerateTarget], list[GroupMember]] = {}
    prompts: dict[int, list[int]] = {}
    for spec, decision, sampling in zip(plan.choices, decisions, samplings, strict=True):
        if decision.decode_address is None:
            continue
        target = GenerateTarget(decision.decode_address, decision.prefill_address,
                                local_prefill_decided=decision.source is RouteSource.SCHEDULER)
        prompts[id(spec.prompt)] = spec.prompt.token_ids
        groups.setdefault((id(spec.prompt), target), []).append(GroupMember(spec.request_id, sampling))
    streams: dict[str, ChoiceStream] = {}
    for (prompt, target), members in groups.items():
        if len(members) > 1:
            streams |= ChoiceGroup(client, target, prompts[prompt], members, plan.principal.tier).streams
    return streams
