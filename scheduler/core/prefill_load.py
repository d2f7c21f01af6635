"""How busy a worker's engine recently was with prefills: what a decoding request should expect.

A worker that prefills prompts locally (a `both` worker, or a decode worker taking a short prompt)
folds each prompt into its decode steps, so every sequence in its batch waits for the prefills of the
prompts that arrive during its life. Measured on the CPU policy runs (docs/benchmarks.md), a request's
TPOT on the batching worker rose by 26-62 ms per placement per second made there during its life, and
the predicted TPOT, priced from plain decode steps, was 30-70 ms short on average.

The scheduler cannot know future arrivals, so it takes the recent past as the forecast: two
exponentially weighted rates per worker, of the predicted compute of the prompts placed there
(seconds per second, W) and of the prompts themselves (per second, N). If a fraction `share` of the
engine's time goes to them, the decode steps get the rest, and a token takes `step / (1 - share)`;
so does every step of a wait for a decode slot.

What a prompt takes from a decoding batch is what it adds to the step it is folded into: the step
costs the prefill plus the part `s` of a decode step that a mixed step pays (cost_model.py: mixed
steps), so a prompt adds its prefill less `(1 - s) * step`, and the share is `W - N * (1 - s) * step`,
`step` being the decoding batch's own (`prefill_share`). Counting the whole prefill on top of a whole
decode step over-predicted the batching worker's TPOT by ~20% on the CPU policy runs
(docs/benchmarks.md, pass N), where a mixed step pays ~0.3 of the decode part. Each prefill's fixed
part counts: counting only the per-token part read a share of 0.00-0.15 on the batching worker when
~35% of its time went to prefills, because the online fit put nearly all of a short CPU prompt's
cost in the fixed term. The step is the batch's that asks, not the one running when the prompt was
placed: a prompt placed on an idle worker was counted at its whole prefill, though every prompt that
arrives while a request decodes is folded into that request's steps (pass Q: the share then
forecast ~1.2-1.45x the mixed steps' measured excess). One step is counted per prompt: a long prompt
chunked over k steps saves the decode part k times, so its share is over-counted (the scheduler does
not know the workers' chunk size).

That forecast is the prior. Once a worker has reported mixed steps, what a prompt costs its decoding
batch is measured instead (`FoldedCost`): each mixed step's time less the decode step its batch would
have run (the decode fit at that batch and context), summed over the recent past, per chunk of the
prompts placed there beside a decoding batch (the engine prefills at most `max_prefill_chunk` tokens of
a prompt per step, which the worker reports). The share is that cost times the rate of chunks placed.
The forecast misses what a step of each kind costs on the GPU, in opposite directions by workload
(1xH200, c1 co-located, TPOT <= 20 ms; docs/benchmarks.md, "Folded prefill cost"): a mixed step runs
eagerly while the decode step alone replays a CUDA graph, so its decodes cost 1.0-1.7 decode steps,
not the at most 1 the fit allows; a 2,048-token prompt rides ~2.4 mixed steps, not one; and several
short prompts share one step's fixed cost, not one each. The stretch it forecast was about half what
the 2k-token prompts' mixed steps added, and 1.3-1.6x what the ShareGPT prompts' did. A measured cost
carries all of it (the chunking, the eager floor, the decodes' extra cost, the host's work around a
mixed step). Per chunk, because per chunk it hardly depends on the workload: 10-18 ms on both
workloads of those runs, where a token cost 25-30 us of 2k-token prompts and 100-156 us of ShareGPT's,
and a prompt 50-60 ms and 11-19 ms. Measured per token, the stretch was right for the 2k-token prompts
but a third of the truth for the ShareGPT load that followed them: the cost of the previous minute's
long prompts, their tokens many, outweighed the new ones' for most of a run.
"""

from __future__ import annotations

import math

# A share this high means prefills alone nearly saturate the engine: its queue grows and the TTFT
# prediction sees that; capping keeps one noisy estimate from pricing TPOT at infinity.
MAX_PREFILL_SHARE = 0.8


class DecayingRate:
    """Work per second, exponentially weighted over `time_constant_s`, over the time observed since
    `since` (a steady stream of `x` seconds of work every `1/r` seconds reads `x * r`).

    The weights are normalised by the time observed, as a mean over a short history should be: a
    plain exponential average that starts at zero reads `1 - exp(-t/tau)` of the rate `t` seconds
    into a stream (0.05-0.15 of it in the first seconds of a burst). A burst is what the forecast
    is for: on the CPU policy runs the first requests of a load, placed on a worker whose share read
    ~0.1 while it spent about half its time prefilling, all missed their TPOT target
    (docs/benchmarks.md, pass P). `restart` starts a new history (the cluster was idle: the past
    says nothing about the load now arriving); less than `min_window_s` of it counts as that much,
    so the first placement of a burst does not read as an unbounded rate.
    """

    def __init__(self, time_constant_s: float, since: float, min_window_s: float) -> None:
        if time_constant_s <= 0 or min_window_s <= 0:
            raise ValueError("time_constant_s and min_window_s must be > 0")
        self._tau = time_constant_s
        self._min_window_s = min_window_s
        self._sum = DecayingSum(time_constant_s)
        self._since = since

    def restart(self, now: float) -> None:
        """Forget the history: the rate is observed from `now` on."""
        self._sum = DecayingSum(self._tau)
        self._since = now

    def add(self, amount: float, now: float) -> None:
        self._sum.add(amount / self._tau, now)

    def value(self, now: float) -> float:
        observed = max(now - self._since, self._min_window_s)
        return self._sum.value(now) / -math.expm1(-observed / self._tau)


class DecayingSum:
    """A sum whose terms fade as exp(-age / `time_constant_s`); an earlier clock reading than the
    latest term's never inflates it."""

    def __init__(self, time_constant_s: float) -> None:
        self._tau = time_constant_s
        self._value = 0.0
        self._at = -math.inf

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount
        self._at = max(now, self._at)

    def value(self, now: float) -> float:
        if self._value == 0.0 or now <= self._at:
            return self._value
        return self._value * math.exp((self._at - now) / self._tau)


class FoldedCost:
    """What one prompt chunk folded into a worker's decoding steps costs them, in seconds: the mixed
    steps' time over the decode steps their batches would have run (reported), over the chunks of the
    prompts placed there while others decoded (counted at placement: `prefill_chunks`), both sums
    exponentially weighted over `time_constant_s`, so it follows the recent workload. None until
    `min_steps` mixed steps and a chunk have been counted."""

    def __init__(self, time_constant_s: float, min_steps: int) -> None:
        if time_constant_s <= 0 or min_steps < 1:
            raise ValueError("time_constant_s must be > 0 and min_steps >= 1")
        self._min_steps = min_steps
        self._steps = 0
        self._excess = DecayingSum(time_constant_s)
        self._chunks = DecayingSum(time_constant_s)
        self._mixed_steps = DecayingSum(time_constant_s)

    def add_step(self, excess_s: float, now: float) -> None:
        """One mixed step, `excess_s` over its batch's decode step (negative when it was cheaper: a
        CPU computes part of the decodes in the prefill's pass)."""
        self._excess.add(excess_s, now)
        self._mixed_steps.add(1.0, now)
        self._steps += 1

    def add_chunks(self, chunks: int, now: float) -> None:
        """A prompt placed to be prefilled in `chunks` steps' slices, beside a decoding batch."""
        self._chunks.add(float(chunks), now)

    def per_chunk_s(self, now: float) -> float | None:
        chunks = self._chunks.value(now)
        if self._steps < self._min_steps or chunks <= 0:
            return None
        return max(self._excess.value(now) / chunks, 0.0)

    def per_step_s(self, now: float) -> float | None:
        """What a mixed step costs over its batch's decode step, on average (whatever it carries):
        a prompt in slices rides one such step per slice."""
        if self._steps < self._min_steps:
            return None
        return max(self._excess.value(now) / self._mixed_steps.value(now), 0.0)


def prefill_chunks(new_tokens: int, max_prefill_chunk: int) -> int:
    """The steps' slices a prompt is prefilled in: the engine takes at most `max_prefill_chunk` of its
    tokens per step (0: the worker does not say, taken as whole prompts)."""
    if max_prefill_chunk <= 0:
        return 1
    return max(-(-new_tokens // max_prefill_chunk), 1)


def prefill_share(work_rate: float, prompt_rate: float, mixed_decode_share: float, step_s: float) -> float:
    """The fraction of a decoding batch's time (its step `step_s`) that prompts arriving at
    `prompt_rate` per second, `work_rate` seconds of prefill per second, add to its steps."""
    return max(work_rate - prompt_rate * (1.0 - mixed_decode_share) * step_s, 0.0)


def measured_share(chunk_rate: float, folded_s_per_chunk: float) -> float:
    """The fraction of a decoding batch's time that prompt chunks arriving at `chunk_rate` per second
    take, each costing what the worker's mixed steps measured (`FoldedCost`)."""
    return chunk_rate * folded_s_per_chunk


def decode_stretch(prefill_share: float, max_num_seqs: int | None) -> float:
    """How much longer decode steps take, wall clock, when `prefill_share` of the engine's time goes
    to prefills. A one-slot worker admits (and prefills) the next prompt only once its running
    sequence is done, so its decoding never shares the engine."""
    if max_num_seqs == 1:
        return 1.0
    return 1.0 / (1.0 - min(max(prefill_share, 0.0), MAX_PREFILL_SHARE))
