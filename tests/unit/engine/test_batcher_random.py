"""The batcher under random traffic, driven by a fake runner that keeps a token-per-slot stand-in for
the KV cache: every chunk must find the right tokens already cached before its start position (prefix
reuse, preemption and remote prefill included) and never write into a block another table shares;
block accounting and KV events stay consistent and every block comes back.
"""

from __future__ import annotations

import random

import pytest
from batcher_helpers import BS, held, make

from engine.batch import BatchPlan, SampledToken, ScheduledChunk, StepResult
from engine.batcher import Batcher
from engine.block_manager import BlockManager, KVEventKind
from engine.errors import OutOfBlocksError
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


# ---- randomized property test ---------------------------------------------------------------------
class FakeKVRunner:
    """Samples random tokens and keeps the token id stored at each KV slot, checking every read."""

    def __init__(self, bm: BlockManager, rng: random.Random) -> None:
        self.bm, self.rng = bm, rng
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id whose K/V is there

    def write(self, block_ids: tuple[int, ...] | list[int], start: int, tokens: list[int]) -> None:
        for i, tok in enumerate(tokens):
            block = block_ids[(start + i) // BS]
            assert self.bm.ref_count(block) == 1, "a chunk wrote into a shared block"
            self.slots[(block, (start + i) % BS)] = tok

    def check(self, chunk: ScheduledChunk) -> None:
        tokens = list(chunk.prompt_token_ids) + list(chunk.output_token_ids)
        assert list(chunk.token_ids) == tokens[chunk.start_pos:chunk.context_len]
        assert len(chunk.block_ids) * BS >= chunk.context_len
        for pos in range(chunk.start_pos):
            assert self.slots.get((chunk.block_ids[pos // BS], pos % BS)) == tokens[pos]

    def execute(self, plan: BatchPlan) -> StepResult:
        for c in plan.chunks:
            self.check(c)
            self.write(c.block_ids, c.start_pos, list(c.token_ids))
        return StepResult({c.request_id: SampledToken(self.rng.randrange(1, 6))
                           for c in plan.chunks if c.needs_sample})


def check_accounting(b: Batcher, live: set[str]) -> None:
    bm = b.block_manager
    refs: dict[int, int] = {}
    for rid in live:
        for block in held(b, rid).block_ids:
            refs[block] = refs.get(block, 0) + 1
    assert all(bm.ref_count(block) == n for block, n in refs.items())
    assert bm.num_free_blocks == bm.num_total_blocks - len(refs)


def check_events(bm: BlockManager, registered: set[int]) -> None:
    for event in bm.drain_events():
        if event.kind is KVEventKind.STORED:
            assert event.block_hash not in registered
            registered.add(event.block_hash)
        else:
            registered.remove(event.block_hash)
    assert len(registered) == bm.num_cached_blocks


class RandomDriver:
    """Random add / reserve / commit / abort / step / finish traffic against one small pool."""

    def __init__(self, seed: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.b = make(num_blocks=10, max_num_seqs=4, budget=12, chunk=5, max_model_len=max_model_len)
        self.runner = FakeKVRunner(self.b.block_manager, self.rng)
        self.live: set[str] = set()
        self.remote: list[str] = []
        self.registered: set[int] = set()
        self.preemptions = 0
        self.next_id = 0

    def new_seq(self) -> Sequence:
        self.next_id += 1
        prefix = [1, 2, 3, 4, 5, 6, 7, 8][:self.rng.randrange(9)]  # shared prefixes exercise the cache
        tail = [self.rng.randrange(1, 6) for _ in range(self.rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=self.rng.choice([1, 3, 8, 40]))
        return Sequence(request_id=f"r{self.next_id}", prompt_token_ids=prefix + tail, sampling=params)

    def reserve(self) -> None:
        s = self.new_seq()
        try:
            block_ids, cached = self.b.reserve_remote(s)
        except OutOfBlocksError:
            return
        self.runner.write(block_ids, cached, s.prompt_token_ids[cached:])  # the remote prefill's WRITE
        self.live.add(s.request_id)
        self.remote.append(s.request_id)

    def commit(self) -> None:
        rid = self.remote.pop(self.rng.randrange(len(self.remote)))
        self.b.commit_remote(rid, self.rng.randrange(1, 6))

    def abort(self, rid: str) -> None:
        assert self.b.abort(rid)
        self.live.discard(rid)
        if rid in self.remote:
            self.remote.remove(rid)

    def step(self) -> None:
        plan = self.b.schedule()
        assert plan.num_tokens <= 12 and len(plan.chunks) <= 4
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        self.preemptions += len(plan.preempted)
        result = self.runner.execute(plan)
        if self.live and self.rng.random() < 0.1:  # an abort lands while the step runs
            self.abort(self.rng.choice(sorted(self.live)))
        for s in self.b.postprocess(plan, result):
            if s.num_output_tokens >= s.sampling.max_tokens or s.num_tokens >= self.b.max_num_tokens:
                self.b.finish(s.request_id, FinishReason.LENGTH)
                self.live.discard(s.request_id)

    def random_op(self) -> None:
        r = self.rng.random()
        if r < 0.25:
            s = self.new_seq()
            self.b.add(s)
            self.live.add(s.request_id)
        elif r < 0.35:
            self.reserve()
        elif r < 0.45 and self.remote:
            self.commit()
        elif r < 0.5 and self.live:
            self.abort(self.rng.choice(sorted(self.live)))
        else:
            self.step()
        check_accounting(self.b, self.live)
        check_events(self.b.block_manager, self.registered)


@pytest.mark.parametrize("max_model_len", [24, 64])  # 64: the 40-slot pool is the limit
def test_random_traffic_keeps_block_accounting_and_returns_every_block(max_model_len: int) -> None:
    preemptions = 0
    for seed in range(40):
        d = RandomDriver(seed, max_model_len)
        for _ in range(150):
            d.random_op()
        while d.remote:
            d.commit()
        for _ in range(500):  # everything still queued runs to completion: no sequence is stuck
            if not d.b.has_work():
                break
            d.step()
            check_accounting(d.b, d.live)
        assert d.b.num_unfinished == 0 and not d.live
        assert d.b.block_manager.num_free_blocks == 10
        assert all(d.b.block_manager.ref_count(i) == 0 for i in range(10))
        check_events(d.b.block_manager, d.registered)
        preemptions += d.preemptions
    assert preemptions > 0  # the pool is small enough that the preemption path really ran
