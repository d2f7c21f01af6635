"""Mixed-step costs from the client's token gaps (lab/experiments/mixed_steps.py)."""

from __future__ import annotations

import pytest

from lab.experiments.mixed_steps import (
    MixedStep,
    ServedRequest,
    decode_share,
    first_token_overhead,
    mixed_steps,
    pair_requests,
)
from loadtest.records import RequestRecord


def _route(t: float, prompt: int, max_tokens: int, worker: str | None) -> dict:
    return {"t": t, "request": {"prompt_tokens": prompt, "max_tokens": max_tokens},
            "decision": {"decode": worker}}


def _record(send: float, prompt: int, max_tokens: int, ttft: float, gaps: list[float],
            ok: bool = True) -> RequestRecord:
    return RequestRecord("r", 0, 0, send, prompt, max_tokens, ok=ok, ttft=ttft, chunk_gaps=gaps)


def test_requests_pair_with_routes_by_order_and_lengths_on_the_scheduler_clock() -> None:
    routes = [_route(100.0, 50, 16, "a"), _route(100.5, 60, 16, "b"), _route(101.0, 70, 16, None)]
    records = [_record(0.0, 60, 16, 0.3, [0.1]), _record(0.0, 50, 16, 0.2, [0.1, 0.1]),
               _record(1.0, 70, 16, 0.2, [0.1]), _record(2.0, 99, 16, 0.2, [])]
    served = pair_requests(routes, records)
    assert [(s.worker_id, s.prompt_tokens) for s in served] == [("b", 60), ("a", 50)]  # rejected and unknown: out
    assert served[1].routed_at == 100.0
    assert served[1].token_times == pytest.approx((100.2, 100.3, 100.4))


def test_a_refused_requests_record_takes_its_own_route_not_a_later_one_of_the_same_lengths() -> None:
    routes = [_route(100.0, 50, 16, None), _route(101.0, 50, 16, "a")]  # the first was refused (503)
    records = [_record(0.0, 50, 16, 0.2, [], ok=False), _record(1.0, 50, 16, 0.3, [0.1])]
    served = pair_requests(routes, records)
    assert [(s.worker_id, s.routed_at) for s in served] == [("a", 101.0)]
    assert served[0].token_times == pytest.approx((101.3, 101.4))


def test_chat_records_pair_with_the_next_route_of_their_max_tokens_whose_prompt_the_template_lengthened() -> None:
    routes = [_route(100.0, 302, 16, "a"), _route(100.5, 361, 16, "b"), _route(101.0, 302, 16, "b")]
    records = [_record(0.0, 288, 16, 0.2, []), _record(0.5, 336, 16, 0.2, []), _record(1.0, 288, 16, 0.2, [])]
    assert pair_requests(routes, records) == []  # the client's counts never equal the templated ones
    served = pair_requests(routes, records, templated=True)
    assert [(s.worker_id, s.routed_at) for s in served] == [("a", 100.0), ("b", 100.5), ("b", 101.0)]


def test_a_failed_request_is_paired_but_not_timed() -> None:
    assert pair_requests([_route(0.0, 50, 16, "a")], [_record(0.0, 50, 16, 0.2, [], ok=False)]) == []


def test_first_tokens_out_together_are_one_mixed_step_timed_by_the_decoding_requests_gap() -> None:
    decoding = ServedRequest("a", 40, -0.3, (0.0, 0.14, 0.28, 0.68, 0.82))  # 0.28 -> 0.68: the mixed step
    new = [ServedRequest("a", 50, 0.3, (0.675, 0.8)), ServedRequest("a", 60, 0.3, (0.68, 0.81))]
    elsewhere = ServedRequest("b", 70, 0.2, (0.5, 0.58, 0.66, 0.74))
    steps = mixed_steps([decoding, *new, elsewhere], "a")
    assert steps == [MixedStep(pytest.approx(0.40), (50, 60), 1)]


def test_the_decode_share_is_what_the_gaps_leave_over_the_prefill() -> None:
    steps = [MixedStep(0.3 + 0.25 * 0.1 * b, (64,), b) for b in range(1, 12)]
    share = decode_share(steps, lambda prompts: 0.3, lambda batch: 0.1 * batch)
    assert share == pytest.approx(0.25)
    assert decode_share(steps[:3], lambda prompts: 0.3, lambda batch: 0.1 * batch) is None  # too few to say
    assert decode_share(steps, lambda prompts: 1.0, lambda batch: 0.1 * batch) == 0.0  # clipped, not negative


def test_the_first_token_overhead_is_the_median_excess_of_requests_that_found_their_worker_idle() -> None:
    idle = [ServedRequest("b", 50, 10.0 * i, (10.0 * i + 0.34 + 0.01 * (i % 3),)) for i in range(12)]
    busy = ServedRequest("b", 50, 0.1, (5.0, 5.1))  # routed while the first request was in flight: queued
    overhead = first_token_overhead([*idle, busy], lambda worker, prompt: 0.3)
    assert overhead == pytest.approx(0.05)
    assert first_token_overhead(idle[:5], lambda worker, prompt: 0.3) is None  # too few to say
    assert first_token_overhead(idle, lambda worker, prompt: 1.0) == 0.0  # never negative
