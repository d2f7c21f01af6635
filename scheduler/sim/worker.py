"""A simulated worker: prefill batches and a continuous decode batch, timed by a `WorkerProfile`.

It follows the real request path closely enough for routing to matter: a decode worker admits a
sequence only when it can reserve KV blocks for prompt + max_tokens (decode-first: blocks before
prefill), prefill runs whole prompts in batches up to a token budget (or, with `max_prefill_chunk`, the
engine's chunked prefill: each step takes at most that many tokens of a prompt, prompts in arrival
order, within the step's token budget that the decodes share), a prefill on the decode
worker itself shares the step with the decode batch, and each step reports KV events and, when it is
a step sample of its kind (prefill, decode or mixed) that the next heartbeat carries to the scheduler,
as a real worker's does (services/worker/heartbeat.py), with the served time its engine loop would
time (the profile's part and the serving cost's `sampled_share`). Step times are the
profile's plus the serving cost the profile does not see (`SimWorkerSpec.serving`), times a noise
factor and the host's speed at the time (`SimWorkerSpec.host_speed`); a measured decode step table
(`SimWorkerSpec.decode_step_s`) may replace the profile's decode price. An abort (a client that gave
up) frees the sequence's blocks and queue places at once; a step already computing it finishes
without it. Not modelled: preemption, transfer contention on the link.
"""

from __future__ import annotations

import math
import random
from collections import deque

from scheduler.sim.prefix_cache import SimPrefixCache
from scheduler.sim.sequence import PrefillJob, SimSequence, StepOutcome, insert_by_priority, priority
from scheduler.sim.serving import StepShape
from scheduler.sim.spec import SimWorkerSpec
from scheduler.types import (
    DecodeSample,
    KVEvent,
    MixedSample,
    PrefillSample,
    StepSample,
    WorkerRole,
    WorkerSnapshot,
)


class SimWorker:
    def __init__(self, spec: SimWorkerSpec, rng: random.Random, noise: float) -> None:
        self.spec = spec
        self.cache = SimPrefixCache(spec.cache_blocks, spec.host_cache_blocks)
        self._rng = rng
        self._noise = noise
        self._free_blocks = spec.total_blocks
        self._waiting: deque[SimSequence] = deque()  # accepted, waiting for blocks or a batch slot
        self._holding = 0  # sequences holding blocks here
        self._prefill_queue: deque[PrefillJob] = deque()
        self._running: list[SimSequence] = []
        self._step: tuple[list[tuple[PrefillJob, int]], list[SimSequence]] | None = None  # (job, tokens)
        self._samples: list[StepSample] = []
        self._landed: list[SimSequence] = []  # remote KV that arrived mid-step, committed when it ends
        self._awaiting_kv: set[SimSequence] = set()  # holding blocks here while a prefill worker computes
        self._received = 0  # requests taken on, as a real worker counts them (services/worker/intake.py)

    @property
    def busy(self) -> bool:
        return self._step is not None

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    # ---- decode side ---------------------------------------------------------------------------

    def admit(self, seq: SimSequence) -> None:
        self._received += 1
        insert_by_priority(self._waiting, seq, lambda other: priority(other) > priority(seq))

    def allocate_waiting(self) -> list[SimSequence]:
        """Reserve blocks for waiting sequences in queue order (the engine's: by the tier's priority, then
        first come first served); returns those now ready to prefill."""
        ready: list[SimSequence] = []
        while self._waiting and self._holding < self.spec.max_batch:
            seq = self._waiting[0]
            hit = self.cache.match(seq.arrival.prefix_hashes)
            cached_blocks = hit.blocks
            tokens = seq.arrival.prompt_tokens + seq.max_tokens
            needed = max(math.ceil(tokens / self.spec.block_size) - cached_blocks, 0)
            if needed > self._free_blocks:
                break  # FIFO: later sequences wait too, or a big one would starve
            self._waiting.popleft()
            self._free_blocks -= needed
            self._holding += 1
            seq.reserved_blocks = needed
            seq.decode_cached_tokens = min(
                cached_blocks * self.spec.block_size, seq.arrival.prompt_tokens - 1
            )
            seq.decode_load_s = hit.host_blocks * self.spec.host_load_s_per_block
            if seq.prefill_worker is not None:
                self._awaiting_kv.add(seq)
            ready.append(seq)
        return ready

    def join(self, seq: SimSequence, now: float) -> SimSequence | None:
        """The KV is here and the first token is out: start decoding. Returns seq if it is done."""
        self._awaiting_kv.discard(seq)
        seq.first_token_at = now
        seq.generated = 1
        self.cache.store(seq.arrival.prefix_hashes)
        if seq.generated >= seq.output_tokens:
            self._release(seq, now)
            return seq
        self._running.append(seq)
        return None

    def land(self, seq: SimSequence, now: float) -> SimSequence | None:
        """A remote prefill's KV is here. The engine commits it between steps (the decode worker's
        notice_to_commit phase), so mid-step it waits for the step to end; the client sees the first
        token at the commit. Returns seq if it is done at once."""
        if seq.aborted:
            return None
        if self._step is None:
            return self.join(seq, now)
        self._landed.append(seq)
        return None

    def _release(self, seq: SimSequence, now: float) -> None:
        seq.finished_at = now
        self.cache.store(seq.arrival.output_hashes)  # the answer's full blocks: cached as the engine does
        self._free(seq)

    def _free(self, seq: SimSequence) -> None:
        self._free_blocks += seq.reserved_blocks
        self._holding -= 1

    def abort(self, seq: SimSequence) -> None:
        """The gateway aborted `seq` (its client left). Call it on the sequence's decode worker and on its
        prefill worker, in either order, at the same time: each drops it from its queues, and the decode
        worker frees its blocks and marks it aborted, which the steps and transfers in flight then skip."""
        in_step = self._step is not None and any(job.seq is seq for job, _ in self._step[0])
        self._prefill_queue = deque(j for j in self._prefill_queue if j.seq is not seq or in_step)
        if seq.decode_worker != self.worker_id or seq.aborted:
            return
        self._awaiting_kv.discard(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq.finished_at is None:  # it holds blocks here: prefilling, in transfer or decoding
            if seq in self._running:
                self._running.remove(seq)
            self._free(seq)
        seq.aborted = True

    # ---- prefill side --------------------------------------------------------------------------

    def enqueue_prefill(self, seq: SimSequence) -> None:
        """Queue a prompt here, computing only what this worker's (or the decode's) cache lacks."""
        prompt = seq.arrival.prompt_tokens
        if seq.decode_worker == self.worker_id:
            cached, load_s = seq.decode_cached_tokens, seq.decode_load_s
        else:
            self._received += 1  # a prefill worker's job: its own request here (its own tiers consulted)
            hit = self.cache.match(seq.arrival.prefix_hashes)
            cached = min(hit.blocks * self.spec.block_size, prompt - 1)
            load_s = hit.host_blocks * self.spec.host_load_s_per_block
        job = PrefillJob(seq, prompt - cached, cached, load_s=load_s)
        # A prompt part-way through its chunks is the engine's running prefill: it keeps its place.
        insert_by_priority(self._prefill_queue, job,
                            lambda other: not other.done_tokens and priority(other.seq) > priority(seq))

    # ---- steps ---------------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Plan one step from the queues; returns its duration, or None when there is nothing to do."""
        assert self._step is None, "a worker runs one step at a time"
        decoding = list(self._running)
        jobs = self._take_prefill_slices(len(decoding))
        if not jobs and not decoding:
            return None
        for job, _ in jobs:
            if job.seq.prefill_started_at is None:
                job.seq.prefill_started_at = now
        speed = self.spec.host_speed.at(now)
        tokens = sum(t for _, t in jobs)
        attention = sum(t * (t + 2 * (j.cached_tokens + j.done_tokens)) for j, t in jobs)
        prefill_s = self.spec.profile.prefill_step_s(tokens, attention) * self._jitter() * speed if jobs else 0.0
        # Host-tier loads of the prompts starting now. The engine copies them on a side stream while the
        # batch runs on; charging them to the step is the conservative simplification (an 8k-token
        # history of an 8B model is ~1 GB, ~20 ms over PCIe 5), and a real worker's step timing does
        # not include them, so the sample below does not either.
        load_s = sum(j.load_s for j, _ in jobs if j.done_tokens == 0)
        context = sum(s.context for s in decoding)
        decode_s = 0.0
        if decoding:
            decode_s = self.spec.decode_truth_s(len(decoding), context) * self._jitter() * speed
            if jobs:
                decode_s *= self.spec.mixed_decode_share
        done = [j for j, t in jobs if t >= j.remaining]  # their first token is sampled now
        handed_off = sum(1 for j in done if j.seq.decode_worker != self.worker_id)
        remote = any(j.seq.decode_worker != self.worker_id for j, _ in jobs)
        shape = StepShape(len(decoding), context, len(done), remote, handed_off)
        serving = self.spec.serving
        serving_s = serving.step_s(shape) * self._jitter() * speed
        # The sample is the served step as a real worker's engine loop times it: the part of the serving
        # cost inside that loop included, the rest (seen by clients only) not.
        sampled = prefill_s + decode_s + serving_s * serving.sampled_share
        self._samples.append(self._sample(tokens, attention, len(decoding), context, sampled))
        self._step = (jobs, decoding)
        return prefill_s + decode_s + serving_s + load_s

    @staticmethod
    def _sample(tokens: int, attention: int, decoding: int, context: int, seconds: float) -> StepSample:
        if tokens and decoding:
            return MixedSample(tokens, attention, decoding, context, seconds)
        if tokens:
            return PrefillSample(tokens, seconds, attention)
        return DecodeSample(decoding, context, seconds)

    def finish_step(self, now: float) -> StepOutcome:
        assert self._step is not None, "finish_step without start_step"
        jobs, decoding = self._step
        self._step = None
        outcome = StepOutcome()
        for seq in decoding:
            if seq.aborted:  # already out of the batch and freed
                continue
            seq.generated += 1
            outcome.streamed.append(seq)
            if seq.generated >= seq.output_tokens:
                self._running.remove(seq)
                self._release(seq, now)
                outcome.finished.append(seq)
        for job, tokens in jobs:
            job.done_tokens += tokens
            if job.seq.aborted:
                if job in self._prefill_queue:  # a chunked prompt's place
                    self._prefill_queue.remove(job)
                continue
            if job.remaining > 0:
                continue
            job.seq.prefilled_at = now
            if self.spec.max_prefill_chunk is not None:
                self._prefill_queue.remove(job)
            self.cache.store(job.seq.arrival.prefix_hashes)
            if job.seq.decode_worker != self.worker_id:
                outcome.prefilled.append(job)
                continue
            outcome.first_tokens.append(job.seq)
            done = self.join(job.seq, now)
            if done is not None:
                outcome.finished.append(done)
        landed, self._landed = [s for s in self._landed if not s.aborted], []
        outcome.first_tokens.extend(landed)
        outcome.finished.extend(seq for seq in landed if self.join(seq, now) is not None)
        return outcome

    def transfer_s(self, tokens: int) -> float:
        return self.spec.profile.transfer_s(tokens) * self._jitter()

    def _take_prefill_slices(self, decoding: int) -> list[tuple[PrefillJob, int]]:
        """This step's prefill work: (job, tokens). Whole prompts leave the queue now; chunked ones
        stay queued until their last chunk is computed."""
        chunk = self.spec.max_prefill_chunk
        budget = self.spec.max_prefill_tokens
        jobs: list[tuple[PrefillJob, int]] = []
        if chunk is None:
            while self._prefill_queue and (not jobs or self._prefill_queue[0].new_tokens <= budget):
                job = self._prefill_queue.popleft()
                budget -= job.new_tokens
                jobs.append((job, job.new_tokens))
            return jobs
        budget -= decoding  # one token per decoding sequence, as the engine counts them
        for job in self._prefill_queue:
            if budget <= 0:
                break
            tokens = min(chunk, job.remaining, budget)
            budget -= tokens
            jobs.append((job, tokens))
        return jobs

    def _jitter(self) -> float:
        return max(0.5, self._rng.gauss(1.0, self._noise))

    # ---- reporting -----------------------------------------------------------------------------

    def heartbeat(self, now: float) -> tuple[WorkerSnapshot, list[StepSample], list[KVEvent]]:
        """The snapshot, samples and KV events a real worker would send now."""
        in_step = [job for job, _ in self._step[0]] if self._step is not None else []
        jobs = {*self._prefill_queue, *in_step}
        queued_tokens = sum(j.remaining for j in jobs)
        # Like the engine's pending prefill tokens: prompts waiting for a slot here count too.
        local_waiting = [s for s in self._waiting if s.prefill_worker is None]
        queued_tokens += sum(s.arrival.prompt_tokens for s in local_waiting)
        # Like the engine's: sequences holding blocks for a remote prefill are counted apart from its queue.
        awaiting_kv = len(self._awaiting_kv)
        not_running = len(self._waiting) + self._holding - len(self._running) - awaiting_kv
        if self.spec.role is WorkerRole.PREFILL:  # like the engine's waiting queue: not started yet
            not_running = sum(1 for j in self._prefill_queue if not j.done_tokens and j not in in_step)
        snapshot = WorkerSnapshot(
            worker_id=self.worker_id,
            role=self.spec.role,
            model=self.spec.model,
            address=f"sim://{self.worker_id}",
            queue_depth=not_running,
            running_seqs=len(in_step) if self.spec.role is WorkerRole.PREFILL else len(self._running),
            free_blocks=self._free_blocks,
            total_blocks=self.spec.total_blocks,
            block_size=self.spec.block_size,
            inflight_prefill_tokens=queued_tokens,
            heartbeat_at=now,
            running_context_tokens=sum(s.context for s in self._running),
            # max_tokens, like a real engine: it cannot know where a sequence's EOS falls
            running_remaining_tokens=sum(max(s.max_tokens - s.generated, 0) for s in self._running),
            max_num_seqs=self.spec.max_batch,
            max_prefill_chunk=self.spec.max_prefill_chunk or 0,
            inflight_prefill_requests=len(jobs) + len(local_waiting),
            waiting_for_remote_kv=awaiting_kv,
            requests_received=self._received,
        )
        samples, self._samples = self._samples, []
        return snapshot, samples, self.cache.drain_events()
