"""The synchronous engine: `add_request` / `step` / `abort`.

One step is three calls (nano-vllm's shape): the batcher plans, the model runner runs, the batcher
records the sampled tokens; then this class decides which requests finished (EOS, stop ids, stop
strings, max_tokens, context window: engine/tracked_request.py) and turns the step into per-request
output deltas (engine/step_outputs.py). A new request is checked and its state built by
engine/request_intake.py. Not thread-safe: `AsyncEngine` drives it from one thread.

Speculative decoding (engine/speculative): a request's `num_draft_tokens` (None: the config's default)
lets its decodes verify n-gram drafts, so one step may yield several tokens for it; they are checked
for stops one by one and cut after the first that finishes the request. Held (prefill-only) requests
never draft: speculation starts on the decode side, after the first token.

Held requests (prefill side of disaggregation): `add_request(..., hold_for_s=T)` prefills the prompt,
samples the first token, finishes the request (one output, like max_tokens=1) but keeps its blocks
under a lease of T seconds so a KV transfer can read them (engine/held_leases.py). `release_held`
frees them; so does `release_expired_holds` once the lease runs out. Dangerous window: a NIXL WRITE
may still be reading held blocks, so the owner must release only once its transfer is terminal and
must pick a lease longer than the transfer's deadline (an expiry under a live WRITE would let a new
prefill overwrite the source mid-copy; it is logged as an error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from engine.batch import BatchPlan, SampledToken, StepResult, TokenLogprobs
from engine.batcher import Batcher
from engine.block_manager import BlockManager, KVEvent
from engine.choices import ChoiceFork
from engine.chunk_stream import ChunkStreams, OnPrefilled
from engine.config import EngineConfig, ModelConfig
from engine.engine_view import EngineView
from engine.errors import InvalidRequestError
from engine.held_leases import HeldLeases
from engine.kv_integrity import head_slice_checksums
from engine.kv_tiers.presence import TieredKVEvents
from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.tier_stats import TierStatsSnapshot
from engine.loader import load_model
from engine.outputs import HeldBlocks, RequestOutput
from engine.parallel.launcher import RankServiceFactory, create_model_runner
from engine.request_intake import RequestIntake
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import NgramProposer
from engine.step_outputs import read_step_tokens, request_output
from engine.step_stats import SpeculationStats, StepStats
from engine.structured.masks import GrammarCompiler
from engine.tracked_request import TrackedRequest
from tokenization.tokenizer import Tokenizer

_R = TypeVar("_R")  # what a step run returns (a StepResult, or a pipeline round's finished plan)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic,
                 rank_service: RankServiceFactory | None = None) -> None:
        """`rank_service`: with tensor parallelism, a picklable factory of each follower rank's
        companion object (engine.parallel.launcher); ignored with one rank."""
        self.config = config
        self._clock = clock
        loaded = load_model(config.model, config.load_format, config.dtype, config.device,
                            seed=config.seed, cache_dir=config.cache_dir)
        self.model_config: ModelConfig = loaded.model_config
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self.runner = create_model_runner(config, self.model_config, loaded.weights, rank_service)
        if self.tokenizer is not None:  # grammar masks (structured outputs) need the tokenizer
            self.runner.sampler.grammar = GrammarCompiler(self.tokenizer)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.tiers = (TieredKVStore(config.tiers, self.runner.kv_cache, config.cache.block_size)
                      if config.tiers.enabled and config.cache.enable_prefix_caching else None)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, demoter=self.tiers)
        self._tier_events = (TieredKVEvents(self.block_manager.is_cached, self.tiers.lower_tier_of)
                             if self.tiers is not None else None)
        spec = config.speculative
        self.view = EngineView(self.runner, self.block_manager)  # what a worker reads (engine_view.py)
        self.batcher = Batcher(config.batcher, self.block_manager, self.max_model_len,
                               NgramProposer(spec.ngram_min, spec.ngram_max), loader=self.tiers,
                               pipeline_depth=self.runner.pipeline_depth)
        self.spec_stats = SpeculationStats()
        self._intake = RequestIntake(self.model_config, self.tokenizer, self.max_model_len, spec.num_draft_tokens)
        self._requests: dict[str, TrackedRequest] = {}
        self._held = HeldLeases(self.block_manager, clock)
        self._chunk_streams = ChunkStreams(self.runner.kv_cache, config.cache.block_size)
        self.last_step: StepStats | None = None  # what the latest step ran; None if it ran nothing

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, hold_for_s: float | None = None, checksum_hold: bool = False, checksum_slices: int = 1,
                    choice_samplings: tuple[SamplingParams, ...] = (),
                    on_prefilled: OnPrefilled | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (and changes nothing) on bad input.

        `hold_for_s`: prefill only (see the module docstring): one output with the first token and
        `held` set, then the blocks stay held under `request_id` until `release_held` or the lease
        expires. `checksum_hold`: `held.checksums` are computed right after the step that finished the
        prefill (on the engine's stream, so ordered after its KV writes; one small read-back);
        `checksum_slices` > 1: per head slice, as a decode worker of that TP size holds the blocks.
        `choice_samplings` (held only; n > 1): the first token is also sampled under each of these, from
        the same logits, and returned in the held output's `choice_first`. `on_prefilled` (held only):
        KV streaming, told after each step which blocks a chunk filled (engine/chunk_stream.py).
        """
        if hold_for_s is not None and not hold_for_s > 0:
            raise InvalidRequestError(f"hold_for_s must be > 0, got {hold_for_s}")
        if choice_samplings and (hold_for_s is None
                                 or not all(isinstance(p, SamplingParams) for p in choice_samplings)):
            raise InvalidRequestError("choice_samplings need a held prefill and a SamplingParams each")
        if checksum_slices < 1 or self.runner.kv_spec.num_kv_heads % checksum_slices:
            raise InvalidRequestError(f"checksum_slices {checksum_slices} does not divide the KV heads")
        if request_id in self._held:
            raise InvalidRequestError(f"duplicate request id {request_id!r} (its blocks are still held)")
        if on_prefilled is not None and hold_for_s is None:
            raise InvalidRequestError("on_prefilled streams a held prefill's blocks: it needs hold_for_s")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        self._requests[request_id].hold_for_s = hold_for_s
        self._requests[request_id].checksum_hold = checksum_hold
        self._requests[request_id].checksum_slices = checksum_slices
        seq.choice_samplings = tuple(choice_samplings)
        if on_prefilled is not None:
            self._chunk_streams.add(request_id, on_prefilled)
        try:
            self.batcher.add(seq)
        except Exception:
            del self._requests[request_id]
            self._chunk_streams.drop(request_id)
            raise

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> tuple[list[int], int]:
        """Decode side of disaggregation: allocate blocks that a remote prefill will write into.

        Returns (block ids, prompt tokens already cached here). The request is not scheduled until
        `commit_remote`; `abort` releases its blocks at any time.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            return self.batcher.reserve_remote(seq)
        except Exception:
            self._requests.pop(request_id, None)
            raise

    def commit_remote(self, request_id: str, first_token_id: int, first_logprobs: TokenLogprobs | None = None,
                      forks: tuple[ChoiceFork, ...] = ()) -> list[RequestOutput]:
        """The remote prefill's KV has landed: the sequence joins the decode batch with its first token.

        `forks` (n > 1): sibling choices that share the landed prompt blocks by reference (copy on write
        of the partly filled last one), each joining with its own first token. Raises
        InvalidRequestError, committing nothing, when a fork's id or settings are bad.
        """
        tracked = self._requests[request_id]
        prompt = tracked.seq.prompt_token_ids
        for fork in forks:
            self._intake.check(fork.request_id, prompt, fork.params, self._requests)
        if len({f.request_id for f in forks} | {request_id}) != len(forks) + 1:
            raise InvalidRequestError(f"duplicate choice ids among the forks of {request_id!r}")
        self.batcher.commit_remote(request_id, first_token_id)
        emits = [(tracked, SampledToken(first_token_id, first_logprobs))]
        for fork in forks:  # before any output: a parent finished by its first token frees its blocks
            seq = self._new_sequence(fork.request_id, prompt, fork.params)
            self.batcher.fork(request_id, seq, fork.first.token_id)
            emits.append((self._requests[fork.request_id], fork.first))
        return [self._emit(t, [sampled]) for t, sampled in emits]

    def abort(self, request_id: str) -> bool:
        """Abort at any state; every block of the request is released. Returns whether it existed.

        A request already finished into a hold is not touched: its blocks may be under a live WRITE,
        so only `release_held` (after the transfer is terminal) or the lease frees them.
        """
        tracked = self._requests.pop(request_id, None)
        self._chunk_streams.drop(request_id)
        existed = self.batcher.abort(request_id)
        return existed or tracked is not None

    # ---- held blocks (prefill side) -------------------------------------------------------------
    def held_blocks(self, request_id: str) -> HeldBlocks | None:
        return self._held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a held request's blocks (its transfer is terminal). Returns whether it was held."""
        return self._held.release(request_id)

    def release_expired_holds(self) -> list[str]:
        """Free holds whose lease ran out; returns their ids (each one is an owner's bug or crash)."""
        return self._held.release_expired()

    @property
    def num_held_blocks(self) -> int:
        return self._held.num_blocks

    def has_unfinished(self) -> bool:
        """Requests not finished, or batches still in flight (an aborted request's plan must still
        leave the pipeline, so the stepping goes on until it has)."""
        return bool(self._requests) or self.batcher.num_in_flight > 0

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams) -> Sequence:
        """Check a new request (engine/request_intake.py) and track it; returns its sequence."""
        self._intake.check(request_id, prompt, params, self._requests)
        tracked = self._intake.track(request_id, prompt, params)
        self._requests[request_id] = tracked
        return tracked.seq

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: plan, run, record. Under an overlapped pipeline (`runner.pipeline_depth` > 1) one
        round instead: the new plan enters the pipeline and the outputs are those of the plan that left."""
        self.last_step = None
        if self.tiers is not None:
            self.tiers.between_steps()  # the last step's demotion copies as one batch; disk writes reaped
        plan = self.batcher.schedule()
        if self.runner.pipeline_depth > 1:
            return self._pipeline_round(plan)
        if plan.is_empty:
            return []
        self._mark_started(plan)
        start = time.perf_counter()
        result = self._dropping_on_failure(self.runner.execute, plan)
        return self._record(plan, result, time.perf_counter() - start)

    def _pipeline_round(self, plan: BatchPlan) -> list[RequestOutput]:
        """Submit `plan` (a bubble when empty but batches are in flight, so that they move on) and
        record the plan that left the pipeline, if one did. The batcher planned `plan` without the
        sequences of the plans still in flight (engine/batcher.py)."""
        if plan.is_empty and not self.batcher.num_in_flight:
            return []
        self._mark_started(plan)
        start = time.perf_counter()
        done = self._dropping_on_failure(self.runner.pipeline_round, plan)
        if done is None or self.batcher.discard_dropped(done.plan):  # dropped: a failed step's, planned again
            return []
        return self._record(done.plan, done.result, time.perf_counter() - start)

    def _dropping_on_failure(self, run: Callable[[BatchPlan], _R], plan: BatchPlan) -> _R:
        """`run(plan)`; if it raises, every plan in flight is dropped (its tokens are scheduled again)."""
        try:
            return run(plan)
        except BaseException:
            self.batcher.drop_in_flight()
            raise

    def _mark_started(self, plan: BatchPlan) -> None:
        now = self._clock()
        for chunk in plan.chunks:
            tracked = self._requests.get(chunk.request_id)
            if tracked is not None and tracked.started_at is None:
                tracked.started_at = now

    def _record(self, plan: BatchPlan, result: StepResult, seconds: float) -> list[RequestOutput]:
        """The run plan's tokens into the batcher, and its outputs; `seconds` the step's (or round's) time."""
        drafts = SpeculationStats.of_step(plan, result)
        self.spec_stats.add(drafts)
        self.last_step = StepStats.of(plan, seconds, drafts)
        if self.tiers is not None:  # the recompute side of the load-or-recompute decision
            self.tiers.cost.observe_prefill(self.last_step.prefill_tokens, seconds)
        self.batcher.postprocess(plan, result)
        self._chunk_streams.after_step(plan)
        outputs = []
        for request_id, sampled in result.sampled.items():
            tracked = self._requests.get(request_id)
            if tracked is not None:
                outputs.append(self._emit(tracked, [*result.accepted.get(request_id, ()), sampled],
                                          result.choices.get(request_id, ())))
        return outputs

    def _emit(self, tracked: TrackedRequest, sampled: list[SampledToken],
              choice_first: tuple[SampledToken, ...] = ()) -> RequestOutput:
        """One output for the tokens a step appended to a request (the batcher already holds them),
        cut after the first one that finishes it (engine/step_outputs.py); a finished request is
        forgotten, a held prefill's blocks go under a lease."""
        tokens = read_step_tokens(tracked, sampled, self.batcher.max_num_tokens)
        held = None
        if tracked.hold_for_s is not None:
            held = self._hold(tracked)
        elif tokens.finish_reason is not None:
            self.batcher.finish(tracked.seq.request_id, tokens.finish_reason)
            del self._requests[tracked.seq.request_id]
        return request_output(tracked.seq, tokens, held, choice_first)

    def _hold(self, tracked: TrackedRequest) -> HeldBlocks:
        """Finish a prefill-only request, keeping its blocks under a lease."""
        seq = tracked.seq
        assert tracked.hold_for_s is not None
        block_ids = tuple(self.batcher.detach(seq.request_id))
        del self._requests[seq.request_id]
        self._chunk_streams.drop(seq.request_id)
        checksums = (tuple(head_slice_checksums(self.runner.kv_cache, block_ids, tracked.checksum_slices))
                     if tracked.checksum_hold else None)
        now = self._clock()
        held = HeldBlocks(block_ids, seq.num_prompt_tokens, seq.num_cached_tokens, now + tracked.hold_for_s,
                          checksums, started_at=tracked.started_at or now, finished_at=now)
        self._held.hold(seq.request_id, held)
        return held

    # ---- KV events and tiers ----------------------------------------------------------------------
    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last drain; with tiers, one per hash whose fastest tier changed."""
        events = self.block_manager.drain_events()
        if self.tiers is None or self._tier_events is None:
            return events
        return self._tier_events.translate(events, self.tiers.drain_changed_hashes())

    def tier_stats(self) -> TierStatsSnapshot | None:
        return self.tiers.snapshot() if self.tiers is not None else None

    def shutdown(self) -> None:
        """Stop tensor-parallel follower processes, if any (a single-process runner has none)."""
        if self.tiers is not None:
            self.tiers.close()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # ---- conveniences ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests, CLI); returns each prompt's generated token ids."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
