"""What a served step costs beyond the model runner: the part `baton profile` does not time.

`baton profile` times `runner.execute(plan)` alone (services/profiler/measure.py). A served worker
also runs, every step, the batcher's bookkeeping and, per sequence in the batch, the token's way out:
read back, stop checks, the output event and its gRPC stream message, all Python on the worker's
process. On the 4xH100 run of docs/benchmarks.md ("Four GPUs") the decode worker of 3P1D (decode
steps only, no prefill on it) spent, over the profile's decode step, 1.24 ms + 117 us per sequence
(median inter-token gap per batch size, batch 8-128, contexts of 250 and 2,100 tokens alike: the
excess does not grow with context, only with the batch). A simulator without this term had
every step up to ~2x too short at 128 sequences, so decode-bound layouts looked twice as
roomy as served. `loadtest/experiments/serving_cost.py` fits both terms from a run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingCost:
    per_step_s: float = 0.0  # every step
    per_seq_s: float = 0.0  # per sequence in the step (decoding, or a prefill chunk that samples)

    def __post_init__(self) -> None:
        if self.per_step_s < 0 or self.per_seq_s < 0:
            raise ValueError(f"serving costs must be non-negative, got {self}")

    def step_s(self, sequences: int) -> float:
        return self.per_step_s + self.per_seq_s * sequences if sequences > 0 else 0.0


NONE = ServingCost()
# The 4xH100 host of docs/benchmarks.md (Llama-3.1-8B shape, TP=1): see the module docstring.
MEASURED_H100 = ServingCost(per_step_s=1.24e-3, per_seq_s=117e-6)
