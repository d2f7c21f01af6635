"""What a served step costs beyond the model runner: the part `baton profile` does not time.

`baton profile` times `runner.execute(plan)` alone (services/profiler/measure.py); a worker's step
samples carry the served step (engine/async_engine.py), so the scheduler's fits learn this cost from
them while its prior, the profile, does not know it. A served worker
also runs, every step, the batcher's bookkeeping and, per sequence in the batch, the token's way out:
read back, stop checks, the output event and its gRPC stream message, all Python on the worker's
process. On the 4xH100 run of docs/benchmarks.md ("Four GPUs") the decode worker of 3P1D (decode
steps only, no prefill on it) spent, over the profile's decode step, 1.24 ms + 117 us per sequence
(median inter-token gap per batch size, batch 8-128, contexts of 250 and 2,100 tokens alike: the
excess does not grow with context, only with the batch). A simulator without this term had
every step up to ~2x too short at 128 sequences, so decode-bound layouts looked twice as
roomy as served. `lab/experiments/serving_cost.py` fits both terms from a run.

Prefill costs more again when served: on the same runs the prefill workers' `prefill_compute` phase
(first chunk scheduled -> first token) was ~2x the profile's steps for short prompts at no queue
(ShareGPT: 41-48 ms p50 for one ~22 ms step) and ~1.5x for 2k prompts (147 ms mean for four 512-token
chunks). One term per step cannot give both (the runs alone ask for 19 and 12 ms), so there are two:
per step that carries prefill tokens (`per_prefill_step_s`) and per prompt whose last chunk is in the
step (`per_prefill_done_s`: its first token is sampled and its blocks handed over). Both are fitted
by replaying the measured runs (`lab/experiments/prefill_serving_cost.py`). Where the time goes
inside the worker was not measured (no per-step records on the prefill workers).

Tried and not kept: the per-step part as a higher prefill floor instead (hidden behind steps long
enough to keep the GPU busy, as kernel-launch CPU time would be). Fitted the same way (floor +11.8
ms, +7.8 ms per prompt), it followed the loaded runs' `prefill_compute` better (mean |error| 8 vs
21 ms) but their attainment and TTFT worse (mean |error| 0.089 vs 0.072, TTFT p50 101 vs 74 ms),
and it put a saturated prefill worker at ~13.6 2k-prompts/s where 2P2D at 36 req/s measured <= 12.4.

The two prefill terms price the hand-off path, so they apply to remote prefills only: a step that
carries prefill for another worker, and each prompt whose KV is handed over. A prompt prefilled on its
own decode worker pays neither (the workers' per-kind step histograms, docs/benchmarks.md: mixed steps
of a 512-token chunk and ~40 decodes took 24-36 ms on co-located workers, about the profile's
prefill + decode; charging them the terms too made co-located TPOT 33 ms where 19 were measured at
30 req/s of 2k prompts).

Decode steps over long contexts cost more served than profiled (`per_context_token_s`): the single
decode worker of 3P1D at 20 req/s of 2k prompts (~54 sequences of ~2.1k tokens) stepped in 14.7 ms mean
against the profile's 12.0 ms; ShareGPT's ~300-token contexts showed no such excess.

Refitted 2026-11-27 after the gateway stopped stalling its event loop (its stream log, then the tokenizer
holding the GIL; docs/benchmarks.md, "After the tokenizer fix"). Client token gaps had carried the
gateway's stalls, so the terms above, fitted from them, had priced the gateway as worker time. Coordinate
descent over all terms and the gateway's, replaying the 48 runs of that day's 4xH100 repeat (attainment and
log TTFT/TPOT errors, each run alike), moved per step 1.24 -> 0.3 ms, per sequence 117 -> 156 us, per
context token 25 -> 12.5 ns, and the per-step prefill term 8.7 -> 0 ms (the per-prompt hand-off term kept
its 10.9 ms); mean |error| of attainment 0.159 -> 0.104 over those runs, and of the per-GPU capacity the
planner predicts for the measured layouts 18% -> 10%. In-sample: the same runs judged it.

What the samples see (`sampled_share`): since 2026-11-29 a worker's step samples time its engine loop's
whole period per step (engine/async_engine.py), not the forward pass alone, so the simulated workers
report the profile's part plus this share of the serving cost. On 1xH200 at TPOT <= 20 ms (c1, 16 runs
past the knee) the loop added 0.5-1.9 ms per decode step to the forward pass, less than these terms
price, yet replaying those runs matched best with the whole cost in the samples: simulated attainment
0.71-0.82 against 0.83-0.95 measured on ShareGPT, TPOT p50 16 ms both; with shares of 0-0.75 the
simulated scheduler admitted past the knee (TPOT p50 18-32 ms, attainment 0.10-0.79). Share 0
replays runs of workers from before the change (forward-only samples).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingCost:
    per_step_s: float = 0.0  # every step
    per_seq_s: float = 0.0  # per sequence in the step (decoding, or a prefill chunk that samples)
    per_prefill_step_s: float = 0.0  # on top, for a step that carries prefill for another worker
    per_prefill_done_s: float = 0.0  # on top, per prompt whose prefill ends in the step and is handed over
    per_context_token_s: float = 0.0  # per context token of the decoding sequences
    # The share of this cost inside the engine loop's served step, so in the worker's step samples (the
    # module docstring, "What the samples see").
    sampled_share: float = 1.0

    def __post_init__(self) -> None:
        if min(self.per_step_s, self.per_seq_s, self.per_prefill_step_s, self.per_prefill_done_s,
               self.per_context_token_s) < 0:
            raise ValueError(f"serving costs must be non-negative, got {self}")
        if not 0.0 <= self.sampled_share <= 1.0:
            raise ValueError(f"the sampled share must be within [0, 1], got {self.sampled_share}")

    def step_s(self, step: StepShape) -> float:
        sequences = step.decoding + step.prompts_done
        base = self.per_step_s + self.per_seq_s * sequences if sequences > 0 else 0.0
        return (base + self.per_context_token_s * step.context_tokens
                + (self.per_prefill_step_s if step.remote_prefill else 0.0) + self.per_prefill_done_s * step.handed_off)


@dataclass(frozen=True)
class StepShape:
    """What a simulated step holds, as far as its serving cost goes."""

    decoding: int = 0  # sequences decoding one token
    context_tokens: int = 0  # their context
    prompts_done: int = 0  # prompts whose prefill ends here (they sample their first token)
    remote_prefill: bool = False  # the step carries prefill tokens of prompts decoded on another worker
    handed_off: int = 0  # of prompts_done, those whose KV goes to another worker


NONE = ServingCost()
# The 4xH100 host of docs/benchmarks.md (Llama-3.1-8B shape, TP=1), as refitted on 2026-11-27 (module
# docstring), against that host's profile refitted with its prefill floor (15.9 ms floor, then 4.36 ms +
# 15.6 us/token + 3.2 ns/token^2: docs/benchmarks.md); against a floorless profile they would differ.
MEASURED_H100 = ServingCost(per_step_s=0.3e-3, per_seq_s=156e-6, per_prefill_step_s=0.0, per_prefill_done_s=10.9e-3,
                            per_context_token_s=1.25e-8)
