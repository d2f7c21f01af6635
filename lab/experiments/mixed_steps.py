"""What the client's token timings tell the simulator that the workers' step samples cannot.

Mixed steps: what a step carrying a prompt's prefill and the running decodes (one forward pass) costs.

Workers report their mixed steps now (services/worker/heartbeat.py), but the policy runs recorded
before that did not; and the client sees them too: when a request's first token comes out of a batching
worker, every request decoding there got its next token from the same step, so the gap that ends
then is that mixed step's duration (plus the way out, a few ms). With the prefill part priced by the
fitted profile and the decode part by the decode table, the gaps give the share of the decode part a
mixed step pays: gap ~= prefill + share * decode, by least squares with the prefill's coefficient
fixed at 1. On the three quiet repeats (exp1 runs, 355 mixed steps) the median gap was 335 ms where
prefill + decode said 430 ms; the share came out near 0.3 in every repeat.

First-token overhead: the client's TTFT of a request that found its worker idle is the prefill plus
what lies outside the scheduler's view (the gateway before the route, the token's way out); the
median excess over the fitted prefill, 36-61 ms on the three repeats, is added to simulated TTFT.

Requests are paired with the scheduler's routes per tier, in order of arrival, matching prompt and
output lengths; token times go on the scheduler's clock (route time + the client's TTFT and gaps: the
gateway's few ms before the route are left out, the same for every request).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.records import RequestRecord

_SAME_STEP_S = 0.02  # a decoding request's token this soon after a first token came from the same step
_MIN_MIXED_STEPS = 10


@dataclass(frozen=True)
class ServedRequest:
    """One request as the client saw it and as the scheduler placed it."""

    worker_id: str
    prompt_tokens: int
    routed_at: float  # scheduler clock
    token_times: tuple[float, ...]  # first token, then every later one; scheduler clock (see pair_requests)


@dataclass(frozen=True)
class MixedStep:
    seconds: float  # the gap a decoding request saw across the step
    prompts: tuple[int, ...]  # prompt tokens of each request whose first token the step produced
    batch: int  # requests decoding in it


def pair_requests(routes: Sequence[Mapping], records: Sequence[RequestRecord], *,
                  templated: bool = False) -> list[ServedRequest]:
    """Tapped routes (one tier's, in arrival order) with the bench records of the same requests.

    A record pairs with the earliest pending route of its lengths. Refused routes (no decode worker)
    stay candidates, so a refused request's record takes its own route, not that of a later request
    of the same lengths. `templated`: the client sent chat messages and counted its prompt before the
    gateway's chat template, which adds tokens per message (+14 to +47 on the multi-turn workload), so
    a record pairs with the earliest pending route of its max_tokens and at least its prompt length.
    """
    pending = sorted(routes, key=lambda r: r["t"])
    served = []
    for record in sorted(records, key=lambda r: r.send_time):
        match = next((r for r in pending if _same_request(r["request"], record, templated)), None)
        if match is None:
            continue
        pending.remove(match)
        if not match["decision"].get("decode") or not record.ok or record.ttft is None:
            continue
        # On the scheduler's clock (the route's time + what the client measured from its send), so
        # that two benches' requests (exp3's two tiers, each bench its own clock) line up.
        times = [match["t"] + record.ttft]
        for gap in record.chunk_gaps:
            times.append(times[-1] + gap)
        served.append(ServedRequest(match["decision"]["decode"], record.prompt_len, match["t"], tuple(times)))
    return served


def _same_request(request: Mapping, record: RequestRecord, templated: bool) -> bool:
    if request["max_tokens"] != record.max_tokens:
        return False
    prompt = request["prompt_tokens"]
    return prompt >= record.prompt_len if templated else prompt == record.prompt_len


def mixed_steps(requests: Sequence[ServedRequest], worker_id: str) -> list[MixedStep]:
    """The mixed steps the client can time on one worker: first tokens out together (one step may
    prefill several queued prompts), and the gaps of the requests decoding across them."""
    mine = sorted((r for r in requests if r.worker_id == worker_id), key=lambda r: r.token_times[0])
    groups: list[list[ServedRequest]] = []
    for r in mine:
        if groups and r.token_times[0] - groups[-1][0].token_times[0] < _SAME_STEP_S:
            groups[-1].append(r)
        else:
            groups.append([r])
    steps = []
    for group in groups:
        first = group[0].token_times[0]
        gaps = [b - a for other in mine if other not in group
                for a, b in zip(other.token_times, other.token_times[1:], strict=False)
                if a < first <= b + _SAME_STEP_S / 4 and b - first < _SAME_STEP_S]
        if gaps:
            steps.append(MixedStep(float(np.median(gaps)), tuple(r.prompt_tokens for r in group), len(gaps)))
    return steps


def decode_share(steps: Sequence[MixedStep], prefill_s: Callable[[Sequence[int]], float],
                 decode_s: Callable[[int], float]) -> float | None:
    """Least-squares share of the decode part in `seconds ~= prefill + share * decode`, within [0, 1];
    None with too few steps to say."""
    if len(steps) < _MIN_MIXED_STEPS:
        return None
    excess = np.array([s.seconds - prefill_s(s.prompts) for s in steps])
    decode = np.array([decode_s(s.batch) for s in steps])
    return float(np.clip((excess * decode).sum() / (decode * decode).sum(), 0.0, 1.0))


def first_token_overhead(requests: Sequence[ServedRequest], prefill_s: Callable[[str, int], float]) -> float | None:
    """Median of TTFT minus the prompt's prefill for requests routed to an idle worker (nothing else
    in flight there): what the client's TTFT holds beyond the engine's step. None with too few."""
    excess = [r.token_times[0] - r.routed_at - prefill_s(r.worker_id, r.prompt_tokens) for r in requests
              if not any(o is not r and o.worker_id == r.worker_id and o.routed_at <= r.routed_at <= o.token_times[-1]
                         for o in requests)]
    return max(float(np.median(excess)), 0.0) if len(excess) >= _MIN_MIXED_STEPS else None
