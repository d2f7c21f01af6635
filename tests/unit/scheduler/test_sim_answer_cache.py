"""A conversation's answers in the replay: `link_turns` reads each turn's answer blocks from its next turn,
and a simulated worker caches them when the turn finishes, as the engine caches every computed block."""

from __future__ import annotations

import random

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.sequence import SimSequence
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain, link_turns
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, KVEventKind, Tier, WorkerRole

BLOCK = 16
SYSTEM = extend_chain((), 2, label=1)  # a shared system prompt's two blocks


def _turn(t: float, hashes: tuple[int, ...], prompt: int, output: int, conversation: str | None = None) -> Arrival:
    return Arrival(t, f"r{t}", prompt, output, hashes, Tier.ENTERPRISE, conversation_id=conversation)


def test_a_turn_gets_the_blocks_its_answer_completes_from_the_next_turn_of_its_conversation() -> None:
    first = _turn(0.0, extend_chain(SYSTEM, 1, label=2), prompt=56, output=30)  # 3 full blocks, 8 tokens over
    second = _turn(5.0, extend_chain(first.prefix_hashes, 4, label=3), prompt=120, output=10)
    other = _turn(1.0, extend_chain(SYSTEM, 1, label=9), prompt=50, output=10)  # shares the system prompt only
    linked = {a.request_id: a for a in link_turns([second, other, first], BLOCK)}
    # 56 + 30 - 1 = 85 computed tokens = 5 full blocks: the answer completes blocks 4 and 5
    assert linked["r0.0"].output_hashes == second.prefix_hashes[3:5]
    assert linked["r5.0"].output_hashes == () and linked["r1.0"].output_hashes == ()  # nothing follows them


def test_a_prompt_of_shared_blocks_only_links_to_no_conversation() -> None:
    system_only = _turn(0.0, SYSTEM, prompt=40, output=16)
    a = _turn(1.0, extend_chain(SYSTEM, 2, label=2), prompt=70, output=16)
    b = _turn(2.0, extend_chain(SYSTEM, 2, label=3), prompt=70, output=16)
    assert [x.output_hashes for x in link_turns([system_only, a, b], BLOCK)] == [(), (), ()]


def test_conversation_ids_link_turns_and_a_rewritten_history_gets_nothing() -> None:
    first = _turn(0.0, extend_chain(SYSTEM, 1, label=2), prompt=56, output=30, conversation="c")
    rewritten = _turn(3.0, extend_chain(SYSTEM, 5, label=7), prompt=120, output=10, conversation="c")
    assert link_turns([first, rewritten], BLOCK)[0].output_hashes == ()
    with pytest.raises(ValueError, match="block_size"):
        link_turns([first], 0)


def test_a_finished_turn_leaves_its_answer_blocks_cached_for_the_next_turn() -> None:
    first = _turn(0.0, extend_chain(SYSTEM, 1, label=2), prompt=56, output=30)
    second = _turn(5.0, extend_chain(first.prefix_hashes, 2, label=3), prompt=90, output=2)
    first = link_turns([first, second], BLOCK)[0]
    assert len(first.output_hashes) == 2  # (56 + 30 - 1) // 16 = 5 computed full blocks, 3 of them the prompt's
    worker = SimWorker(SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile(), max_batch=2), random.Random(0), 0.0)
    seq = SimSequence(first, SLO(1000, 100), 30, 30, decode_worker="w", prefill_worker=None)
    worker.admit(seq)
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)
    now = 0.0
    while seq.finished_at is None:
        assert worker.start_step(now) is not None
        now += 0.01
        worker.finish_step(now)
    assert worker.cache.match(second.prefix_hashes).blocks == 5  # the prompt's 3 blocks and the answer's 2
    _, _, events = worker.heartbeat(now)
    stored = [e.block_hash for e in events if e.kind is KVEventKind.STORED]
    assert stored[-2:] == list(first.output_hashes)  # the scheduler's prefix index hears of them

