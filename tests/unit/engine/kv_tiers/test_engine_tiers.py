"""The engine with KV tiers on the default model (torch backend, CPU): a conversation's evicted history
comes back from host memory or disk, greedy output is identical to an engine without tiers, faults fall
back to recompute (counted by reason) and an abort during a load frees every block and pin.

The GPU pool is kept tiny (8 blocks of 16 tokens) so a few short conversations evict each other; the
host tier holds 1 block, so a
turn's first block comes back from host memory and its second from disk.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.kv_tiers.types import KVTier, LoadFailure, TierConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M, float32, 16-token blocks
_GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_engine(default_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=8)))


@pytest.fixture(scope="module")
def tiered_engine(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    tiers = TierConfig(host_bytes=1 * _BLOCK_BYTES, disk_dir=str(tmp_path_factory.mktemp("kv-disk")),
                       disk_bytes=64 * _BLOCK_BYTES, min_load_speedup=0.0)  # always load: hits are asserted
    return LLMEngine(EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=8), tiers=tiers))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(n)]


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy-generate to the end; returns (output ids, prompt tokens served from a cache or tier).
    `run.last_loaded` keeps the tokens of those loaded from a tier."""
    engine.add_request(request_id, prompt, _GREEDY)
    out: list[int] = []
    cached = 0
    while engine.has_unfinished():
        outputs = engine.step()
        if engine.last_step is None:
            time.sleep(0.002)  # only a load from disk is in flight: leave the core to the I/O thread
        for o in outputs:
            out.extend(o.new_token_ids)
            cached = o.num_cached_tokens
            run.last_loaded = o.num_tier_loaded_tokens  # type: ignore[attr-defined]
    return out, cached


def conversation(engine: LLMEngine, seed: int, before_turn_2: Callable[[], None] = lambda: None) -> list[int]:
    """Turn 1 (40 tokens), an unrelated prompt that pushes it out of the GPU pool, then turn 2 (turn 1's
    prompt, its answer and 12 new tokens). Returns turn 2's output; asserts nothing."""
    turn_1 = tokens(seed, 40)
    answer, _ = run(engine, f"c{seed}-t1", turn_1)
    run(engine, f"c{seed}-push", tokens(seed * 100, 118))  # takes the whole pool
    if engine.tiers is not None:
        engine.tiers.flush()
    before_turn_2()
    out, cached = run(engine, f"c{seed}-t2", turn_1 + answer + tokens(seed + 1, 12))
    conversation.last_cached = cached  # type: ignore[attr-defined]
    return out


def test_a_turns_evicted_history_is_promoted_and_greedy_output_is_unchanged(
        plain_engine: LLMEngine, tiered_engine: LLMEngine) -> None:
    assert tiered_engine.tiers is not None
    expected = conversation(plain_engine, 1)
    assert conversation.last_cached == 0  # type: ignore[attr-defined]  # without tiers: recomputed
    assert conversation(tiered_engine, 1) == expected
    assert conversation.last_cached >= 32  # type: ignore[attr-defined]  # turn 1's full blocks came back
    assert run.last_loaded >= 16  # type: ignore[attr-defined]  # at least one of them from host or disk
    snap = tiered_engine.tiers.snapshot()
    assert sum(snap.hit_blocks.values()) >= 2 and snap.hit_blocks.get(KVTier.DISK, 0) >= 1
    assert snap.pinned_blocks == {KVTier.HOST: 0, KVTier.DISK: 0} and snap.loads_in_flight == 0


def corrupt_every_file(engine: LLMEngine) -> None:
    assert engine.tiers is not None and engine.tiers.disk_files is not None
    for path in engine.tiers.disk_files.directory.glob("*.kv"):
        data = bytearray(path.read_bytes())
        data[100] ^= 0x01
        path.write_bytes(bytes(data))


def delete_every_file(engine: LLMEngine) -> None:
    assert engine.tiers is not None and engine.tiers.disk_files is not None
    for path in engine.tiers.disk_files.directory.glob("*.kv"):
        path.unlink()


@pytest.mark.parametrize(("seed", "fault", "reason"), [
    (2, corrupt_every_file, LoadFailure.BAD_CHECKSUM),
    (3, delete_every_file, LoadFailure.MISSING_FILE),
])
def test_a_bad_disk_block_is_recomputed_with_identical_output(
        plain_engine: LLMEngine, tiered_engine: LLMEngine, seed: int,
        fault: Callable[[LLMEngine], None], reason: LoadFailure) -> None:
    assert tiered_engine.tiers is not None
    before = tiered_engine.tiers.snapshot().fallbacks.get(reason, 0)
    expected = conversation(plain_engine, seed)
    assert conversation(tiered_engine, seed, lambda: fault(tiered_engine)) == expected
    assert tiered_engine.tiers.snapshot().fallbacks.get(reason, 0) > before


def test_an_abort_during_a_load_frees_every_block_and_pin(tiered_engine: LLMEngine) -> None:
    tiers = tiered_engine.tiers
    assert tiers is not None
    turn_1 = tokens(4, 40)
    answer, _ = run(tiered_engine, "c4-t1", turn_1)
    run(tiered_engine, "c4-push", tokens(400, 118))  # the whole pool: turn 1 is only below the GPU now
    tiers.flush()
    tiered_engine.add_request("c4-t2", turn_1 + answer + tokens(5, 12), _GREEDY)
    tiered_engine.step()  # admitted: its blocks are allocated and the load started; polled next step
    assert tiered_engine.batcher.num_loading_kv == 1 and tiers.num_loads_in_flight == 1
    assert tiered_engine.abort("c4-t2")
    bm = tiered_engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and tiered_engine.batcher.num_unfinished == 0
    snap = tiers.snapshot()
    assert snap.pinned_blocks == {KVTier.HOST: 0, KVTier.DISK: 0} and snap.loads_in_flight == 0


def test_kv_events_say_a_demoted_hash_is_still_on_the_worker(tiered_engine: LLMEngine) -> None:
    tiered_engine.drain_kv_events()
    run(tiered_engine, "ev-1", tokens(6, 40))
    run(tiered_engine, "ev-push", tokens(600, 118))
    if tiered_engine.tiers is not None:
        tiered_engine.tiers.flush()
    events = tiered_engine.drain_kv_events()
    lower = {e.block_hash for e in events if e.kind == "stored" and e.tier is not KVTier.GPU}
    from tokenization.block_hashes import block_hashes
    assert set(block_hashes(tokens(6, 40), 16)) <= lower  # demoted, reported with their tier, not evicted
