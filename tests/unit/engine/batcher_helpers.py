"""Helpers shared by the batcher tests: a small batcher and a fake runner step that samples TOKEN."""

from __future__ import annotations

from engine.batch import BatchPlan, SampledToken, StepResult
from engine.batcher import Batcher
from engine.block_manager import BlockManager
from engine.config import BatcherConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
TOKEN = 7  # what the fake runner samples


def make(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 64, chunk: int = 16,
         max_model_len: int = 64, caching: bool = True, pipeline_depth: int = 1) -> Batcher:
    bm = BlockManager(num_blocks, BS, caching)
    return Batcher(BatcherConfig(max_num_seqs, budget, chunk), bm, max_model_len, pipeline_depth=pipeline_depth)


def seq(rid: str, n: int, start: int = 100) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(range(start, start + n)), sampling=SamplingParams())


def run(plan: BatchPlan, token: int = TOKEN) -> StepResult:
    return StepResult({c.request_id: SampledToken(token) for c in plan.chunks if c.needs_sample})


def step(b: Batcher) -> BatchPlan:
    plan = b.schedule()
    b.postprocess(plan, run(plan))
    return plan


def shape(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_pos, c.num_tokens, c.needs_sample) for c in plan.chunks]


def held(b: Batcher, request_id: str) -> Sequence:
    """The batcher's sequence for a request that must still be there."""
    s = b.get(request_id)
    assert s is not None
    return s


def free_blocks(b: Batcher) -> int:
    return b.block_manager.num_free_blocks
