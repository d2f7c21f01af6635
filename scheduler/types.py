"""Plain data in and out of the scheduler core: worker snapshots and step samples in, decisions out.

Nothing here knows about gRPC or clocks. The adapters convert protobuf messages into these types
(and back), and the replay simulator builds them directly, so the service and the simulator drive
exactly the same core. All times are float seconds on the scheduler's clock unless a field says ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# A worker's KV events, in the engine's words: defined once on the ground floor (tokenization/kv_blocks.py),
# named here with the rest of the scheduler's input types.
from tokenization.kv_blocks import KVEvent as KVEvent
from tokenization.kv_blocks import KVEventKind as KVEventKind
from tokenization.kv_blocks import KVTier as KVTier


class WorkerRole(StrEnum):
    PREFILL = "prefill"  # computes prompts and hands the KV to a decode worker
    DECODE = "decode"  # runs the continuous decode batch; may also prefill its own requests locally
    BOTH = "both"  # an aggregated worker: prefills and decodes its own requests

    @property
    def can_decode(self) -> bool:
        return self is not WorkerRole.PREFILL


class Tier(StrEnum):
    FREE = "free"
    PLUS = "plus"
    ENTERPRISE = "enterprise"

    @property
    def priority(self) -> int:
        """A worker's admission priority for the tier's requests: lower is admitted first (the engine's
        `SamplingParams.priority`). Requests without a tier (internal callers) get 0, like enterprise."""
        return _TIER_PRIORITY[self]


_TIER_PRIORITY = {Tier.ENTERPRISE: 0, Tier.PLUS: 1, Tier.FREE: 2}


class DecisionKind(StrEnum):
    ROUTE = "route"  # placed as asked
    QUEUE = "queue"  # held by the scheduler; a later `tick` answers with ROUTE/DEGRADE/REJECT
    DEGRADE = "degrade"  # placed, but only with the shorter `max_tokens` in the decision
    REJECT = "reject"  # not served; `reason` says why and `retry_after_s` when a retry may help


class Reason(StrEnum):
    """Machine-readable reasons; the gateway maps the reject ones to HTTP 429/503 bodies."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AFFINITY = "prefix_affinity"
    MAX_SLACK = "max_slack"
    CONVERSATION_AFFINITY = "conversation_affinity"
    BEST_EFFORT = "slo_unattainable_best_effort"  # even an idle worker misses the SLO; served anyway
    DEGRADED = "degraded_to_meet_slo"  # a shorter max_tokens
    DEGRADED_MODEL = "degraded_to_smaller_model"  # the request's model's fallback serves it
    OVERLOADED = "no_placement_meets_slo"
    BEHIND_QUEUE = "behind_queued_requests"  # same- or higher-tier requests are already waiting
    NO_WORKERS = "no_live_worker_for_model"
    TOO_LARGE = "request_exceeds_worker_kv_capacity"
    QUEUE_FULL = "admission_queue_full"
    QUEUE_TIMEOUT = "admission_queue_timeout"
    # Its admission wait ran out with no placement meeting its targets; a worker with a free slot and
    # KV room serves it anyway, slower than its targets (core/progress.py).
    SERVED_PAST_TARGETS = "served_past_slo_targets"


class SiteReason(StrEnum):
    """Why the prefill runs where it does; carried in the Route answer and counted in metrics."""

    NO_PREFILL_WORKER = "no_prefill_worker"  # co-located worker, or no prefill worker for the model
    SHORT_PROMPT = "short_prompt"  # fewer uncached tokens than the hop is worth
    DECODE_CACHE_HIT = "decode_cache_hit"  # most of the prompt is cached on the decode worker
    PREFILL_FLEET_BUSY = "prefill_fleet_busy"  # the best prefill worker's queue alone outlasts local
    LOCAL_CHEAPER = "local_cheaper"
    REMOTE_CHEAPER = "remote_cheaper"


class WorkerFailure(StrEnum):
    """How a gateway saw a worker fail mid-request (its report makes the worker unroutable)."""

    UNAVAILABLE = "unavailable"  # the call was refused or the worker was unreachable
    STREAM_BROKEN = "stream_broken"  # the stream ended without finishing


@dataclass(frozen=True)
class SLO:
    ttft_ms: float  # time to first token, from arrival at the scheduler
    tpot_ms: float  # mean time per output token after the first

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError(
                f"SLO targets must be positive, got ttft_ms={self.ttft_ms} tpot_ms={self.tpot_ms}"
            )


@dataclass(frozen=True)
class WorkerSnapshot:
    """What a worker reports in each heartbeat. Counts are the worker's own view at `heartbeat_at`."""

    worker_id: str
    role: WorkerRole
    model: str
    address: str
    queue_depth: int  # sequences accepted but not yet running (waiting for blocks or for prefill)
    running_seqs: int  # sequences in the decode batch (prefill workers: prompts being computed)
    free_blocks: int  # KV blocks allocatable now (cached-but-unreferenced blocks count as free)
    total_blocks: int
    block_size: int  # tokens per KV block
    inflight_prefill_tokens: int  # prompt tokens queued or being prefilled here, not yet done
    heartbeat_at: float  # the worker's send time; informational, liveness uses the receipt time
    running_context_tokens: int = 0  # sum of context lengths in the decode batch (drives step time)
    # Batch slots (the engine's max_num_seqs): sequences beyond it wait inside the worker for one to
    # finish, however fast a step is. 0: unknown (an older worker), treated as unlimited.
    max_num_seqs: int = 0
    # The prompts `inflight_prefill_tokens` belongs to, mid-prefill ones included (`queue_depth` counts
    # only those not started). 0: unknown (an older worker): `queue_depth` stands in.
    inflight_prefill_requests: int = 0
    # Tokens the running sequences may still generate (their max_tokens minus those out): when their
    # slots free. 0 with sequences running: unknown (an older worker), their progress is guessed.
    running_remaining_tokens: int = 0
    # Decode worker: sequences holding their blocks while a prefill worker computes their prompt (they
    # take a batch slot when their KV lands, and count toward max_num_seqs already).
    waiting_for_remote_kv: int = 0
    # The longest slice of a prompt the engine prefills in one step (chunked prefill): a prompt rides
    # that many steps' worth of the decoding batch's time. 0: unknown (an older worker), whole prompts.
    max_prefill_chunk: int = 0
    # Requests taken on since the worker started, each counted once this snapshot's load shows it: the
    # registry drops that many reservations (scheduler/core/registry.py). None: not reported (an older
    # worker), reservations expire by age.
    requests_received: int | None = None

    def __post_init__(self) -> None:
        counts = (self.queue_depth, self.running_seqs, self.free_blocks, self.inflight_prefill_tokens)
        extras = (self.running_context_tokens, self.max_num_seqs, self.inflight_prefill_requests,
                  self.running_remaining_tokens, self.waiting_for_remote_kv, self.requests_received or 0)
        if min(counts) < 0 or min(extras) < 0:
            raise ValueError(f"worker {self.worker_id}: load counts must be non-negative")
        if self.block_size <= 0 or not 0 <= self.free_blocks <= self.total_blocks:
            raise ValueError(
                f"worker {self.worker_id}: need block_size > 0 and 0 <= free_blocks <= total_blocks, got "
                f"block_size={self.block_size} free={self.free_blocks} total={self.total_blocks}"
            )


@dataclass(frozen=True)
class RequestSummary:
    """Everything the scheduler needs about a request; the prompt itself never reaches it."""

    request_id: str
    num_prompt_tokens: int
    prefix_hashes: tuple[int, ...]  # chained 64-bit hashes of the prompt's full blocks, in order
    tier: Tier
    slo: SLO
    max_tokens: int
    model: str = ""  # empty: any model (single-model clusters)
    conversation_id: str | None = None
    # Seconds already spent in the scheduler's admission queue; counts against the TTFT target.
    waited_s: float = 0.0
    # Choices of the prompt placed together (the OpenAI `n`): one prefill, `num_choices` decoding
    # sequences of up to `max_tokens` each, on one decode worker, answered by one decision.
    num_choices: int = 1

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0 or self.max_tokens <= 0 or self.num_choices <= 0:
            raise ValueError(
                f"request {self.request_id}: num_prompt_tokens, max_tokens and num_choices must be positive, "
                f"got {self.num_prompt_tokens}, {self.max_tokens} and {self.num_choices}"
            )

    @property
    def output_tokens(self) -> int:
        """The most tokens its choices may generate together."""
        return self.max_tokens * self.num_choices


@dataclass(frozen=True)
class RouteDecision:
    request_id: str
    kind: DecisionKind
    decode_worker_id: str | None = None
    # None together with a decode worker means "prefill locally on the decode worker".
    prefill_worker_id: str | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    # The part of predicted_tpot_ms that the decode worker's prefill share adds (its stretch): kept so
    # that a run can tell an over-predicted step from an over-predicted share (docs/benchmarks.md, pass M).
    predicted_stretch_ms: float | None = None
    reason: Reason | None = None  # None: the answer needs no reason (never for QUEUE or REJECT)
    retry_after_s: float | None = None  # REJECT only: when a retry may succeed; None = don't retry
    max_tokens: int | None = None  # DEGRADE only: the cap the gateway must apply instead of the asked one
    # DEGRADE only: the model that serves it instead of the asked one (its fallback); empty: as asked.
    model: str = ""
    cached_blocks: int = 0  # leading prompt blocks the decode worker already holds
    # Placed only: why the prompt is prefilled where it is (core/prefill_site.py); None when the policy
    # does not site by cost (the baselines' fixed threshold).
    prefill_reason: SiteReason | None = None

    @property
    def is_placed(self) -> bool:
        return self.kind in (DecisionKind.ROUTE, DecisionKind.DEGRADE)

    def __post_init__(self) -> None:
        if self.is_placed and self.decode_worker_id is None:
            raise ValueError(f"decision {self.kind} for {self.request_id} needs a decode worker")


class SwitchState(StrEnum):
    DRAINING = "draining"  # no new placements; waiting for the work in flight to finish
    SWITCHING = "switching"  # drained: the worker is told its new role in its heartbeat answers
    DONE = "done"  # the worker reported the new role


@dataclass(frozen=True)
class RoleSwitch:
    worker_id: str
    from_role: WorkerRole
    to_role: WorkerRole
    state: SwitchState


@dataclass(frozen=True)
class PrefillSample:
    """One prefill step's measured duration, for the cost-model fit."""

    tokens: int  # prompt tokens computed in the step (cached tokens excluded)
    seconds: float
    # Sum over the step's sequences of new*(new + 2*cached): the attention work. None means one
    # uncached sequence, i.e. tokens**2. Batching several prompts makes (sum)**2 overestimate it.
    attention_tokens_sq: int | None = None


@dataclass(frozen=True)
class DecodeSample:
    """One decode step's measured duration, for the cost-model fit."""

    batch_size: int
    context_tokens: int  # sum of the batch's context lengths
    seconds: float


@dataclass(frozen=True)
class MixedSample:
    """One step that carried prefill chunks and the running decodes in one forward pass: what it
    says is how much of a decode step's price such a step pays on top of its prefill part."""

    prefill_tokens: int
    attention_tokens_sq: int  # as PrefillSample's, over the step's prefill chunks
    batch_size: int  # sequences that decoded
    context_tokens: int  # their total context
    seconds: float


StepSample = PrefillSample | DecodeSample | MixedSample
