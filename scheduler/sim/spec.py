"""What a simulated worker is: its profile (the simulated truth), its limits and what a served step
costs beyond the profile. scheduler/sim/worker.py runs one."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.host import STEADY, HostSpeed
from scheduler.sim.serving import NONE, ServingCost
from scheduler.types import WorkerRole


@dataclass(frozen=True)
class SimWorkerSpec:
    worker_id: str
    role: WorkerRole
    profile: WorkerProfile  # the simulated truth; the scheduler may start from it or from defaults
    total_blocks: int = 8192
    block_size: int = 16
    max_batch: int = 128  # sequences holding blocks here at once (prefilling, in transfer or decoding)
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step; one longer prompt runs alone
    # Chunked prefill: a prompt's tokens per step (the engine's `max_prefill_chunk`), and then the
    # step budget above is shared with the decode batch as the engine's is. None: whole prompts.
    max_prefill_chunk: int | None = None
    cache_blocks: int = 4096  # prefix-cache capacity
    # The host-memory KV tier (`--host-kv-gib`): blocks evicted from the cache above land here and a hit
    # loads them back at `host_load_s_per_block` each (block bytes / host-to-GPU bandwidth). 0: no tier.
    host_cache_blocks: int = 0
    host_load_s_per_block: float = 0.0
    model: str = "sim"
    # What a served step costs beyond `profile` (the model runner's time; scheduler/sim/serving.py).
    # Part of the simulated truth only: the scheduler is seeded with `profile`, as a real one is.
    serving: ServingCost = NONE
    # The profile the scheduler starts from, when not `profile` (replaying a run whose scheduler was
    # seeded with another one: its siting decisions then follow that run's). None: `profile`.
    scheduler_seed: WorkerProfile | None = None
    # Measured seconds of a pure decode step by batch size (index = batch - 1), in place of the
    # profile's linear decode price up to its length. Part of the simulated truth only. A real CPU
    # worker's decode step is not linear in the batch (lab/experiments/simulate.py says why
    # this exists); empty: the profile prices every decode step.
    decode_step_s: tuple[float, ...] = ()
    # The share of the decode part's price that a step also carrying prefill pays: 1.0 prices a mixed
    # step as prefill + decode. On a CPU worker one forward pass carries both, and the decodes add
    # much less than a decode step of their own (policy_compare measures ~0.3 from token gaps).
    mixed_decode_share: float = 1.0
    # The host's speed over the replay: a factor on every step's time (scheduler/sim/host.py). Part of
    # the simulated truth only, and the samples the scheduler learns from carry it, as a real worker's do.
    host_speed: HostSpeed = STEADY

    def __post_init__(self) -> None:
        if any(not s > 0 for s in self.decode_step_s):
            raise ValueError(f"decode step times must be positive, got {self.decode_step_s}")
        if not 0.0 <= self.mixed_decode_share <= 1.0:
            raise ValueError(f"mixed_decode_share must be in [0, 1], got {self.mixed_decode_share}")

    def decode_truth_s(self, batch: int, context_tokens: int) -> float:
        """What a pure decode step of `batch` sequences holding `context_tokens` takes here."""
        if 0 < batch <= len(self.decode_step_s):
            return self.decode_step_s[batch - 1]
        return self.profile.decode_step_s(batch, context_tokens)
