"""The gateway's event loops as a simulated resource: each process carries its requests and their tokens.

A served request crosses the gateway on its way to the first token (the HTTP request, tokenising, the
route call; then the worker's first stream message in and the SSE event out), and every later token
crosses it too. All of it runs on one event loop, so under load its work waits.

How it waits decides who pays. The loop does not serve tokens first come first served: each stream has at
most one message in the loop's ready queue at a time (the gateway reads a stream's next gRPC message only
after handling the last one; the rest wait in gRPC's buffers, which cost the loop nothing), so the loop
takes the open streams in turn. A measured 4xH100 ShareGPT run at 40 req/s showed it (docs/benchmarks.md,
machine L): the loop ~90% busy, one stream message per token (nothing coalesced), loop lag p99 ~50 ms, TTFT
p90 flat at ~445 ms from 34 to 46 req/s while TPOT p50 grew 24 -> 48 ms over ~13-ms decode steps. A single
FIFO queue of tokens (this model before) made the first token of a new request wait behind every token
queued, and at that load put TTFT p90 at 1.8-3.2 s with TPOT at half the measured one.

So the model is round robin over the open streams (first token out, last token not yet out):
- one round costs `per_token_s` per open stream: a stream gets at most one token out per round, so a
  stream's tokens leave no faster than the round allows, and when the engines produce tokens faster than
  the loop can take them (the round longer than a step) TPOT becomes the round;
- a token otherwise waits for the loop's backlog, at most one round (it queues behind one message per
  stream, not behind every token);
- a request's way in waits `admission_rounds` rounds (each await on its path, from the HTTP read to the
  route call's answer, puts it at the back of the ready queue) plus its own `per_request_s`.

Several gateway processes on one port (`processes`, services/gateway/replicas.py) are as many such loops;
the kernel hands each connection to one of them by a hash, so a request stays on one loop, taken here by a
hash of its id (`SimGateways.of`).
"""

from __future__ import annotations

import heapq
import zlib
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayCost:
    per_request_s: float = 0.0  # accept, parse and route a request (tokenising runs off the loop)
    per_token_s: float = 0.0  # one streamed token: the worker's message in, the SSE event out
    admission_rounds: float = 0.0  # loop rounds a request waits on its way in (its awaits on the loop)
    processes: int = 1  # gateway processes sharing the port: event loops, each with these costs

    def __post_init__(self) -> None:
        if min(self.per_request_s, self.per_token_s, self.admission_rounds) < 0:
            raise ValueError(f"gateway costs must be non-negative, got {self}")
        if self.processes < 1:
            raise ValueError(f"a gateway runs at least one process, got {self.processes}")

    @property
    def free(self) -> bool:
        return self.per_request_s == self.per_token_s == 0.0


NO_GATEWAY = GatewayCost()
_SHARE_WINDOW_S = 1.0  # the admission share of the loop is the last second's arrivals' work
_MAX_ADMISSION_SHARE = 0.9  # past this the loop is all admissions: rounds stretch 10x, not without bound


class SimGateway:
    """One event loop taking its open streams in turn; `now` never goes backwards between calls."""

    def __init__(self, cost: GatewayCost) -> None:
        self.cost = cost
        self._free_at = float("-inf")  # when the loop's queued work is done, were it served in order
        self._closing: list[float] = []  # when each open stream's last token is out
        self._open = 0
        self._admitted: deque[float] = deque()  # arrivals in the last _SHARE_WINDOW_S

    def round_s(self, now: float) -> float:
        """One turn of the loop over the streams open at `now`, stretched by the share of the loop the
        requests arriving take (their admission work is in the same ready queue)."""
        while self._closing and self._closing[0] <= now:
            heapq.heappop(self._closing)
            self._open -= 1
        while self._admitted and self._admitted[0] <= now - _SHARE_WINDOW_S:
            self._admitted.popleft()
        admission_share = min(len(self._admitted) * self.cost.per_request_s / _SHARE_WINDOW_S, _MAX_ADMISSION_SHARE)
        return self._open * self.cost.per_token_s / (1.0 - admission_share)

    def _wait(self, now: float, seconds: float, round_s: float) -> float:
        """Queue `seconds` of work; how long work arriving `now` waits (the backlog, at most a round)."""
        backlog = max(self._free_at - now, 0.0)
        self._free_at = max(now, self._free_at) + seconds
        return min(backlog, round_s)

    def admit(self, now: float) -> float:
        """When a request arriving `now` reaches the scheduler."""
        cost = self.cost
        self._admitted.append(now)
        round_s = self.round_s(now)
        return now + self._wait(now, cost.per_request_s, round_s) + cost.admission_rounds * round_s + cost.per_request_s

    def first_token(self, now: float) -> float:
        """When a first token produced `now` is out; the stream is open from then until `close`."""
        out = now + self._wait(now, self.cost.per_token_s, self.round_s(now)) + self.cost.per_token_s
        self._open += 1
        return out

    def next_token(self, last_out: float, now: float) -> float:
        """When a stream's token produced `now` is out, its previous one having gone out at `last_out`."""
        round_s = self.round_s(now)
        soonest = now + self._wait(now, self.cost.per_token_s, round_s) + self.cost.per_token_s
        return max(soonest, last_out + round_s)

    def close(self, last_out: float) -> None:
        """A stream's last token goes out at `last_out` (or its client left then): it leaves the rounds."""
        heapq.heappush(self._closing, last_out)


class SimGateways:
    """The gateway's processes: request `request_id` is served by loop `of(request_id)` all its life."""

    def __init__(self, cost: GatewayCost) -> None:
        self.loops = [SimGateway(cost) for _ in range(cost.processes)]

    def of(self, request_id: str) -> SimGateway:
        if len(self.loops) == 1:
            return self.loops[0]
        return self.loops[zlib.crc32(request_id.encode()) % len(self.loops)]


# One gateway process on the 4xH100 hosts of docs/benchmarks.md: 34 ShareGPT and random 2k/128 runs of five
# machines replayed through this model (2026-11-28), grid-searched on their TTFT and TPOT p50/p90: 140 us
# per token and 4 rounds fit best (2.66 ms per request held). 140 us is also what those hosts' loop CPU
# measures per streamed token (lab/experiments/gateway_cost.py); a faster host measured 86.
MEASURED_GATEWAY = GatewayCost(per_request_s=2.66e-3, per_token_s=140e-6, admission_rounds=4.0)
