"""What rank 0 broadcasts to its followers over the control group: one typed message per call.

A message names what to run by its class, never by a method name in a string, so a misspelt call is
an error where it is written (and a type error under mypy), not an AttributeError on a follower.

- `ExecuteStep`, `PipelineRound`, `RandomizeKVCache`: collective `ModelRunner` calls every rank runs with the same
  arguments (they make the same collective calls on every rank, or the group deadlocks).
- `ServiceRequest`: a request for the follower's rank service (e.g. the NIXL agent of its KV shard,
  kvtransfer/nixl/shards.py), whose reply is gathered to rank 0. The request's own type is the rank
  service's business: each service defines its request classes and dispatches on them in `handle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.batch import BatchPlan
from engine.model_runner import ModelRunner


@dataclass(frozen=True)
class ExecuteStep:
    plan: BatchPlan  # slimmed of the live token views: followers never sample


@dataclass(frozen=True)
class PipelineRound:
    """One round of the overlapped pipeline (engine/parallel/pipeline_rounds.py); an empty plan is a bubble."""

    plan: BatchPlan  # slimmed like ExecuteStep's


@dataclass(frozen=True)
class RandomizeKVCache:
    seed: int


@dataclass(frozen=True)
class ServiceRequest:
    request: object  # one of the rank service's own request types


CollectiveCommand = ExecuteStep | PipelineRound | RandomizeKVCache
FollowerCommand = CollectiveCommand | ServiceRequest


def run_collective(runner: ModelRunner, command: CollectiveCommand) -> None:
    """A follower's side of a collective call (rank 0 runs its own side with its full arguments)."""
    if isinstance(command, ExecuteStep):
        runner.execute(command.plan)
    elif isinstance(command, PipelineRound):
        runner.pipeline_round(command.plan)
    else:
        runner.randomize_kv_cache(command.seed)


class RankService(Protocol):
    """A follower's companion object, built in its process by a `RankServiceFactory`. `handle` runs
    on the follower's main thread, one request at a time in broadcast order, and must end on its own
    (bounded): rank 0 holds the control group until every follower has replied."""

    def handle(self, request: object) -> object:
        """The reply to one request; raise on a request type this service does not serve."""
        ...

    def close(self) -> None:
        ...
