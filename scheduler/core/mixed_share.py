"""The share of a decode step's price that a step also carrying prefill pays, learnt per worker.

A worker with chunked prefill computes a prompt's chunk and its running decodes in one forward pass,
and every decoding sequence gets its token from that step. Pricing the step as prefill + a whole decode
step (share 1) counts the weights' pass, and on a CPU most of the per-sequence work, twice: on the CPU
policy runs a step carrying a prompt took ~335 ms at the median where prefill + decode said ~430, a
share near 0.3 (the client's token gaps, loadtest/experiments/mixed_steps.py), and the goodput policy,
pricing the prompts arriving during a request's life at share 1, over-predicted the batching worker's
TPOT by ~20% (docs/benchmarks.md, pass N).

Each mixed step a worker reports gives its time beyond the prefill part, `seconds - prefill(tokens)`,
and the decode step of its batch, `decode(batch, context)`, both priced by the worker's fits at the
time. The share is their ratio of sums over a window, so one step whose prefill the fit misprices moves
it by that step's weight only, pulled towards the prior by `prior_weight` steps of the window's mean
decode step, and clamped to [0, 1]. The prior is 1, what the scheduler assumed before workers reported
mixed steps: a worker that never mixes (a prefill worker, an idle one) keeps it.
"""

from __future__ import annotations

from collections import deque

PRIOR_SHARE = 1.0


class MixedDecodeShare:
    def __init__(self, window: int = 512, prior_weight: float = 1.0) -> None:
        if window <= 0 or prior_weight <= 0:
            raise ValueError("need window > 0 and prior_weight > 0")
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)  # (time over prefill, decode step)
        self._over_sum = 0.0
        self._decode_sum = 0.0
        self._prior_weight = prior_weight
        self.version = 0  # bumped by every sample (see cost_model._FitChoice)

    @property
    def num_samples(self) -> int:
        return len(self._steps)

    def add(self, over_prefill_s: float, decode_s: float) -> None:
        """One mixed step: its seconds beyond the prefill part, and the batch's pure decode step."""
        if decode_s <= 0:
            return  # nothing decoded at a price: says nothing about the share
        if len(self._steps) == self._steps.maxlen:
            old_over, old_decode = self._steps[0]
            self._over_sum -= old_over
            self._decode_sum -= old_decode
        self._steps.append((over_prefill_s, decode_s))
        self._over_sum += over_prefill_s
        self._decode_sum += decode_s
        self.version += 1

    @property
    def value(self) -> float:
        n = len(self._steps)
        if n == 0:
            return PRIOR_SHARE
        prior_decode = self._prior_weight * self._decode_sum / n
        share = (self._over_sum + PRIOR_SHARE * prior_decode) / (self._decode_sum + prior_decode)
        return min(max(share, 0.0), 1.0)
