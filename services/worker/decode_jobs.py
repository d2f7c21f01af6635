"""What a decode worker's Generate takes and yields: the job (prompt, sampling, n > 1 choices, where to
prefill) and its events (outputs, the prefill path taken), and the coalescing of events a slow caller
has let pile up (services/worker/decode_service.py runs the jobs)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from services.worker.remote_prefill import FallbackReason


class PrefillMode(StrEnum):
    AUTO = "auto"  # conditional disaggregation (DisaggPolicy)
    REMOTE = "remote"
    LOCAL = "local"


class PrefillPath(StrEnum):
    REMOTE = "remote"
    LOCAL = "local"
    LOCAL_FALLBACK = "local_fallback"


@dataclass(frozen=True)
class JobChoice:
    """Another choice of an n > 1 request: the same prompt, its own id and sampling."""

    request_id: str
    params: SamplingParams


@dataclass(frozen=True)
class GenerateJob:
    request_id: str  # choice 0's
    prompt: list[int]
    params: SamplingParams  # choice 0's
    mode: PrefillMode = PrefillMode.AUTO
    prefill_worker: str = ""  # preferred prefill worker (host:port); empty: any configured
    traceparent: str = ""  # W3C trace context of the caller, forwarded to the prefill worker
    choices: tuple[JobChoice, ...] = ()  # n > 1: choices 1..n-1, sharing the prompt's prefill

    @property
    def choice_ids(self) -> tuple[str, ...]:
        return (self.request_id, *(c.request_id for c in self.choices))

    @property
    def choice_params(self) -> tuple[SamplingParams, ...]:
        return (self.params, *(c.params for c in self.choices))


@dataclass(frozen=True)
class GenerateEvent:
    output: RequestOutput
    prefill_path: PrefillPath | None = None  # on the first event only
    fallback_reason: FallbackReason | None = None  # on the first event of a fallen-back request
    request_id: str = ""  # the choice's caller id (n > 1: whose response this is); empty: the job's


def coalesce(event: GenerateEvent, backlog: deque[GenerateEvent | BaseException | None]) -> GenerateEvent:
    """`event` merged with the outputs queued right behind it: a caller that fell behind gets one
    message with several tokens instead of a backlog of one-token messages. Stops at an error or the
    end marker, which stay in `backlog` for the caller's loop."""
    while (backlog and isinstance(nxt := backlog[0], GenerateEvent) and not event.output.finished
           and nxt.request_id == event.request_id):
        backlog.popleft()
        event = GenerateEvent(_join(event.output, nxt.output), event.prefill_path, event.fallback_reason,
                              event.request_id)
    return event


def _join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.new_text + b.new_text,
                         a.logprobs + b.logprobs, b.finish_reason, b.num_prompt_tokens or a.num_prompt_tokens,
                         b.num_cached_tokens or a.num_cached_tokens,
                         b.num_tier_loaded_tokens or a.num_tier_loaded_tokens, error=b.error or a.error)
