"""The gateway's event loop as a simulated resource: one process carries every request and every token.

A served request crosses the gateway twice on its way to the first token: the request itself (HTTP
parse, tokenising the prompt, the route call) before the scheduler sees it, and the first token on the
way out (the worker's stream message in, the SSE event out). Every later token crosses it too. All of
it runs on one event loop, so under load the work queues: on the 4xH100 ShareGPT runs of
docs/benchmarks.md the gateway's own TTFT p50 went 39 -> 59 -> 118 ms at 12 -> 24 -> 36 req/s while the
engines' prefill stayed within one or two steps, and its event-loop lag p90 rose from 2 to 20 ms. A
simulator without this cost saw co-located TTFT flat with load (60 ms simulated vs 146 ms measured at
36 req/s) and so ranked layouts on the engines alone.

The model is a single FIFO server: each piece of work starts when the loop is free and takes its cost;
a request is routed when its admission work is done, and a step's tokens reach the clients when theirs
is. `GatewayCost` holds the per-request and per-streamed-token CPU seconds of the loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayCost:
    per_request_s: float = 0.0  # accept, parse and route a request (tokenising runs off the loop)
    per_token_s: float = 0.0  # one streamed token: the worker's message in, the SSE event out

    def __post_init__(self) -> None:
        if min(self.per_request_s, self.per_token_s) < 0:
            raise ValueError(f"gateway costs must be non-negative, got {self}")

    @property
    def free(self) -> bool:
        return self.per_request_s == self.per_token_s == 0.0


NO_GATEWAY = GatewayCost()


class SimGateway:
    """Work queued on one event loop, first come first served."""

    def __init__(self, cost: GatewayCost) -> None:
        self.cost = cost
        self._free_at = float("-inf")

    def _queue(self, now: float, seconds: float) -> float:
        self._free_at = max(now, self._free_at) + seconds
        return self._free_at

    def admit(self, now: float) -> float:
        """When a request arriving `now` reaches the scheduler."""
        return self._queue(now, self.cost.per_request_s)

    def stream(self, now: float, tokens: int) -> float:
        """When `tokens` produced `now` (one step's) are out to their clients."""
        return self._queue(now, self.cost.per_token_s * tokens) if tokens else now

# One gateway process on the 4xH100 host of docs/benchmarks.md, after its stream-log and tokenizer fixes:
# replaying that host's runs fitted 100 us per streamed token (py-spy put its CPU at 110-140 us per streamed
# token, per-request work included) and, refitted with the serving terms on 2026-11-27
# (scheduler/sim/serving.py), 2.66 ms per request.
MEASURED_GATEWAY = GatewayCost(per_request_s=2.66e-3, per_token_s=100e-6)
