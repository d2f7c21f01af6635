"""Per-worker step-time model, seeded from a profile and refitted online from reported samples.

prefill step  = max(floor, a + b*tokens + c*attention)   (attention = tokens**2 for one uncached prompt)
decode step   = d + e*batch  + f*context_tokens (memory-bound: weights once, KV per context token)
KV transfer   = g + h*tokens                    (not fitted yet: workers report no transfer samples)
mixed step    = prefill step + s * decode step   (fitted with the prefill line: see below)

The fit is windowed least squares pulled towards the profile (ridge to the prior): with no samples
the profile is the answer; samples replace it along the directions they measure (one step size
fixes the prediction at that size, the per-unit costs stay the profile's until sizes vary), and a
full window of recent samples dominates it, so a worker that slows down (thermal throttling, a
noisy neighbour) is tracked within one window. The ridge is relative to the data: `prior_weight`
is worth that many samples in the units of the sizes the window actually holds (see
`WindowedLeastSquares._penalty`, scheduler/calibration/windowed.py). Fixed feature scales did not do
that: a CPU worker's batches of 1-8 scaled by 1/100 left the data's pull on the per-sequence term
~1e-4 of the prior's, and the fit never left the default profile. The default weight is a tenth of
a sample: a wrong profile (the default one on a CPU is off 10-100x) is one pseudo-sample with a huge
error, and a whole sample of it still biased poorly separable terms (fixed vs per-token over prompts of 32-512
tokens) by 30% after 300 real samples.
The prefill floor: an eager prefill forward costs the same up to a few hundred tokens (the launches
of every layer's kernels bound it, not the GPU: on the 4xH100 profile of docs/benchmarks.md, 16 to 512
tokens all took ~22 ms, then 1024 took 32.7 and 2048 took 64.4), so one line through all sizes is too
dear for small steps and too cheap for large ones. `baton profile` fits the floor with the line
(scheduler/calibration/profile_fit.py); the floor is not refitted online, and samples at or under it carry
nothing about the line above it, so they are not fitted (`CostModel.observe`). A profile without a
floor (older files) has floor 0: the plain line, as before.
Mixed steps: a worker with chunked prefill computes a prompt's chunk and its running decodes in one
forward pass, and every decoding sequence gets its token from it. Priced as prefill + a whole decode
step (s = 1), the weights' pass and, on a CPU, most of the per-sequence work count twice: on the CPU
policy runs such a step took ~335 ms at the median where prefill + decode said ~430 (s near 0.3 from
the client's token gaps, lab/experiments/mixed_steps.py), and the goodput policy over-predicted
the batching worker's TPOT by ~20% (docs/benchmarks.md, pass N). Workers report mixed steps, and s is
fitted with the prefill line, one least squares over pure prefills (decode feature 0) and mixed steps
(the batch's decode step, priced by the decode fit, as a fourth feature), with the prior s = 1.
Taking each mixed step's excess over the fitted prefill alone did not work: a batching worker runs
nearly every prompt inside a mixed step, its prefill line rests on a few pure prefills, and the
shares read 0.0-0.9 over the runs of one pass. The joint fit's s swings too with few mixed steps
(what separates it from the fixed cost is the spread of batch sizes), but the time it says a prompt
adds to a step matched the runs' measured mean within ~5% in 11 of 13 of them. A mixed step whose
prefill the profile puts on its floor is not fitted (floor + s * decode has no term in the line).
Cold start: until a worker has `MIN_OWN_SAMPLES` steps of a kind, that kind is predicted from its
model's pooled fit (every worker of the model feeding one more model, `pool`), when the pool has
more samples. The default profile describes a small model on a GPU; on a CPU its 15-ms decode step is
~5x too fast, and on the CPU policy runs a worker that had not decoded yet looked nearly free for its
first second or two: the goodput policy queued requests on the one-slot worker at a predicted TTFT of
~0.2 s that took 2.2 s, while the other worker's samples already said what a step costs.
Decode steps are a line plus a per-batch-size correction: the mean residual of the window's steps at
that size, shrunk towards the line while they are few (`WindowedLeastSquares.residual_at`). A line
alone misprices a curve that is not one: on the 2-core CPU of the policy runs the fitted 96 ms +
22 ms per sequence priced 4 sequences at ~184 ms where they took 146-159, and the goodput policy, its
TPOT judged ~20% high, held requests in the admission queue until 11-30 of 60 timed out
(docs/benchmarks.md, pass K).
Beyond the batches seen: past the largest decode batch the window holds a few steps of (`MIN_SEEN_SAMPLES`),
a step is the fitted one at that batch plus the profile's per-sequence cost for each sequence more,
not the fitted line extended. The fitted per-sequence cost is a slope measured over the sizes the
worker has run, and decode cost is not linear in batch everywhere: on the 2-core CPU of the policy
runs steps took ~75 / 130 / 160-190 ms at 1 / 2 / 3 sequences and 140-190 ms from 4 to 8, so a line
through 1-3 priced a fourth sequence at ~250 ms, over the 250-ms TPOT target, and the goodput policy
held the batch at 3 and never saw that 4 was cheaper (docs/benchmarks.md, pass I and after). Pricing the
unseen size by the profile is optimism where the data say nothing: the next placement there is
tried, its steps are reported within a heartbeat, and from then on the line covers that size. One
size at a time: each placement beyond the seen range is priced from the largest seen size, and a burst
can overshoot only by the arrivals of one heartbeat interval.
Beyond the contexts seen, the same: past the largest batch context in the window, a token of context
costs the profile's per-token cost, not the fitted one. A worker's first seconds hold one or two
batch sizes over a few tokens of context each, and the per-token cost fitted there measures whatever
else changed in those seconds: on the CPU policy runs a batch-1 step drifted from 62 to 82 ms over
contexts 82-91 while the other worker on the same cores started (host contention, not context), the
fit read 0.3-0.85 ms per context token (40x the 13-21 us the whole run's fit found), priced 3
sequences at 270 tokens at 180-230 ms where they took 100-150, and the goodput policy queued 3-10
requests at the start of 5 of 6 runs for a TPOT target they would have met; two of those runs lost
goodput cells to the queueing (docs/benchmarks.md, pass T).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Generic, TypeVar

from scheduler.calibration.windowed import WindowedLeastSquares
from scheduler.types import DecodeSample, MixedSample, PrefillSample, StepSample

# A mixed step priced as prefill + a whole decode step until the worker's mixed steps say otherwise.
PRIOR_MIXED_DECODE_SHARE = 1.0
_MIN_STEP_S = 1e-4  # predictions never go below this: a zero-cost step would attract every request
MIN_OWN_SAMPLES = 8  # a worker's own steps of a kind before its own fit replaces the pooled one


@dataclass(frozen=True)
class WorkerProfile:
    """Seed coefficients for one (model, hardware) pair, in seconds; `baton profile` writes these.

    The defaults describe a small model on one modest accelerator, pessimistic on purpose: an
    unprofiled worker should look slower than it is until its own samples arrive, not faster.
    """

    prefill_fixed_s: float = 0.01
    prefill_per_token_s: float = 2e-4
    prefill_per_token_sq_s: float = 2e-9
    decode_fixed_s: float = 0.015
    decode_per_seq_s: float = 2e-4
    decode_per_context_token_s: float = 5e-8
    transfer_fixed_s: float = 0.002
    transfer_per_token_s: float = 2e-6
    prefill_floor_s: float = 0.0  # no prefill step is cheaper (see the module docstring); 0: none

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"profile coefficients must be non-negative: {', '.join(negative)}")

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> WorkerProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown profile keys {unknown}; valid keys: {', '.join(sorted(known))}")
        return cls(**{k: float(v) for k, v in data.items()})

    @classmethod
    def from_json(cls, text: str) -> WorkerProfile:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> WorkerProfile:
        return cls.from_json(Path(path).read_text())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill_step_s(new_tokens, new_tokens * (new_tokens + 2 * cached_tokens))

    def prefill_step_s(self, tokens: int, attention: int) -> float:
        """One prefill step of `tokens` new tokens whose attention terms sum to `attention` (several
        prompts' chunks may share it: each adds new * (new + 2 * cached))."""
        return max(self.prefill_floor_s, self.prefill_line_s(tokens, attention))

    def prefill_line_s(self, tokens: int, attention: int) -> float:
        """The line above the floor."""
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens + self.prefill_per_token_sq_s * attention

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * batch
            + self.decode_per_context_token_s * context_tokens
        )

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_fixed_s + self.transfer_per_token_s * tokens


class CostModel:
    """One worker's predicted step times; `observe` samples as heartbeats deliver them."""

    def __init__(
        self, profile: WorkerProfile | None = None, window: int = 512, prior_weight: float = 0.1,
        pool: CostModel | None = None,
    ) -> None:
        """`pool`: the fit of every worker serving the same model, which predicts a kind of step this
        worker has too few samples of (see the module docstring); the owner feeds it."""
        self._profile = profile or WorkerProfile()
        p = self._profile
        self._prefill = WindowedLeastSquares(  # the prefill line and the mixed steps' decode share
            (p.prefill_fixed_s, p.prefill_per_token_s, p.prefill_per_token_sq_s, PRIOR_MIXED_DECODE_SHARE),
            window, prior_weight,
        )
        self._decode = WindowedLeastSquares(
            (p.decode_fixed_s, p.decode_per_seq_s, p.decode_per_context_token_s),
            window,
            prior_weight,
            tracked=1,
            bounded=2,
        )
        self._prefill_choice: _FitChoice[tuple[float, ...]] = _FitChoice(
            self._prefill, None if pool is None else pool._prefill, _coefficients)
        self._decode_choice: _FitChoice[_DecodeTerms] = _FitChoice(
            self._decode, None if pool is None else pool._decode, _DecodeTerms.of)

    def observe(self, sample: StepSample) -> None:
        if sample.seconds <= 0:
            return  # a clock glitch; a zero-time step would drag every coefficient down
        if isinstance(sample, PrefillSample):
            attention = sample.attention_tokens_sq
            sq = sample.tokens**2 if attention is None else attention
            if self._at_floor(sample.tokens, sq):
                return  # the floor's time says nothing about the line above it
            self._prefill.add((1.0, float(sample.tokens), float(sq), 0.0), sample.seconds)
        elif isinstance(sample, DecodeSample):
            self._decode.add((1.0, float(sample.batch_size), float(sample.context_tokens)), sample.seconds)
        elif isinstance(sample, MixedSample):
            if self._at_floor(sample.prefill_tokens, sample.attention_tokens_sq):
                return  # floor + s * decode: says nothing about the line, and the fit has no floor term
            decode_s = self.decode_step_s(sample.batch_size, sample.context_tokens)
            features = (1.0, float(sample.prefill_tokens), float(sample.attention_tokens_sq), decode_s)
            self._prefill.add(features, sample.seconds)

    def refit(self) -> None:
        """Solve now the fits that took samples since the last solve. Reads refit lazily too, but a
        solve costs more than a whole routing decision's other arithmetic, so the scheduler calls
        this after each heartbeat's samples: a decision that came first to a fresh fit waited for
        its solve (~0.15 ms each; 0.9 per decision in the slowest 1%)."""
        self._prefill_choice.terms()
        self._decode_choice.terms()

    def _prefill_coefficients(self) -> tuple[float, ...]:
        return self._prefill_choice.terms()

    def _at_floor(self, tokens: int, attention: int) -> bool:
        """A step of this size that the profile puts on its floor (never, without a floor)."""
        p = self._profile
        return p.prefill_floor_s > 0 and p.prefill_line_s(tokens, attention) <= p.prefill_floor_s

    @property
    def num_samples(self) -> int:
        return self._prefill.num_samples + self._decode.num_samples

    def fitted_profile(self) -> WorkerProfile:
        """The current coefficients as a profile (for metrics, and to seed the next start)."""
        a, b, c, _ = self._prefill_coefficients()
        decode = self._decode_choice.terms()
        d, e, f = decode.fixed, decode.per_seq, decode.per_context
        return WorkerProfile(
            prefill_fixed_s=a,
            prefill_per_token_s=b,
            prefill_per_token_sq_s=c,
            decode_fixed_s=d,
            decode_per_seq_s=e,
            decode_per_context_token_s=f,
            transfer_fixed_s=self._profile.transfer_fixed_s,
            transfer_per_token_s=self._profile.transfer_per_token_s,
            prefill_floor_s=self._profile.prefill_floor_s,
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        a, b, c, _ = self._prefill_coefficients()
        line = a + b * new_tokens + c * new_tokens * (new_tokens + 2 * cached_tokens)
        return max(_MIN_STEP_S, self._profile.prefill_floor_s, line)

    @property
    def mixed_decode_share(self) -> float:
        """The share of a decode step's price that a step also carrying prefill pays (the module
        docstring: mixed steps); 1 until mixed steps say otherwise."""
        return min(self._prefill_coefficients()[3], 1.0)

    def mixed_step_s(self, new_tokens: int, cached_tokens: int, running_step_s: float) -> float:
        """A step carrying this prefill and a running decode batch whose own step takes `running_step_s`."""
        return self.prefill_s(new_tokens, cached_tokens) + self.mixed_decode_share * running_step_s

    def prefill_added_s(self, new_tokens: int, cached_tokens: int, running_step_s: float) -> float:
        """What folding this prefill into the running batch's step adds to it: the mixed step less
        the decode step the batch would have run anyway (the whole prefill when nothing runs)."""
        return max(self.mixed_step_s(new_tokens, cached_tokens, running_step_s) - running_step_s, 0.0)

    def prefill_marginal_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prefill's cost inside a step that runs anyway (chunked into a decode step): no fixed part."""
        _, b, c, _ = self._prefill_coefficients()
        return b * new_tokens + c * new_tokens * (new_tokens + 2 * cached_tokens)

    def prefill_backlog_s(self, queued_tokens: int, queued_requests: int) -> float:
        """Time to drain a prefill queue whose per-prompt sizes are unknown (assumed equal), each
        prompt no cheaper than the floor."""
        if queued_tokens <= 0:
            return 0.0
        a, b, c, _ = self._prefill_coefficients()
        requests = max(queued_requests, 1)
        per_prompt = queued_tokens / requests
        return requests * max(self._profile.prefill_floor_s, a + b * per_prompt + c * per_prompt**2)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """The fitted line, corrected by what the steps at this batch size say it misses, up to the
        largest batch the fit has seen; beyond it, the step at that batch plus the profile's
        per-sequence cost for each sequence more. Context likewise: the fitted per-token cost up to
        the largest context in the window, the profile's past it (see the module docstring)."""
        terms = self._decode_choice.terms()
        seen = terms.largest_batch
        unseen = batch - seen if 0 < seen < batch else 0.0  # sequences past the largest batch seen
        priced = batch - unseen
        batch_s = (terms.fixed + terms.per_seq * priced + terms.fit.residual_at(priced)
                   + self._profile.decode_per_seq_s * unseen)
        seen_context = terms.largest_context
        fitted = context_tokens if seen_context is None else min(context_tokens, seen_context)
        context_s = terms.per_context * fitted + self._profile.decode_per_context_token_s * (context_tokens - fitted)
        return max(_MIN_STEP_S, batch_s + context_s)

    def transfer_s(self, tokens: int) -> float:
        return self._profile.transfer_s(tokens) if tokens > 0 else 0.0

    def predict_ttft_s(
        self,
        *,
        queued_tokens: int,
        queued_requests: int,
        new_tokens: int,
        cached_tokens: int,
        transfer_tokens: int = 0,
        shared_step_s: float = 0.0,
    ) -> float:
        """TTFT with this worker prefilling: the queue ahead, the request's own prefill, then the
        KV the decode worker lacks crossing the link (0 tokens when prefilled locally). A local
        prefill also shares its step with the running decode batch: pass the decode part of that
        mixed step (`mixed_decode_share` of the batch's step) as `shared_step_s`."""
        return (
            self.prefill_backlog_s(queued_tokens, queued_requests)
            + self.prefill_s(new_tokens, cached_tokens)
            + self.transfer_s(transfer_tokens)
            + shared_step_s
        )

    def predict_tpot_s(
        self, *, batch: int, context_tokens: int, prompt_tokens: int, max_tokens: int
    ) -> float:
        """TPOT with this worker decoding a batch of `batch` sequences plus this request, taken at
        its mid-life context; the rest of the batch is assumed to keep its current context."""
        return self.decode_step_s(batch + 1, context_tokens + prompt_tokens + max_tokens // 2)


_Terms = TypeVar("_Terms")


class _FitChoice(Generic[_Terms]):
    """One kind of step's fit for a worker: its own once it has `MIN_OWN_SAMPLES`, before that the
    pooled one if it knows more; and the terms `derive` reads from that fit, kept until either fit
    takes a sample. Routing reads them ~130 times per decision and samples arrive a few times per
    second, so a read is one version check (docs/benchmarks.md, scheduler decision latency)."""

    def __init__(
        self, own: WindowedLeastSquares, pooled: WindowedLeastSquares | None,
        derive: Callable[[WindowedLeastSquares], _Terms],
    ) -> None:
        self._own = own
        self._pooled = pooled
        self._derive = derive
        self._terms = derive(own)
        self._own_version = self._pooled_version = -1  # stale: the first call chooses

    def terms(self) -> _Terms:
        own, pooled = self._own, self._pooled
        if own.version != self._own_version or pooled is not None and pooled.version != self._pooled_version:
            self._own_version, self._pooled_version = own.version, -1 if pooled is None else pooled.version
            fit = own
            if pooled is not None and own.num_samples < MIN_OWN_SAMPLES and pooled.num_samples > own.num_samples:
                fit = pooled
            self._terms = self._derive(fit)
        return self._terms


def _coefficients(fit: WindowedLeastSquares) -> tuple[float, ...]:
    return fit.coefficients


@dataclass(slots=True)
class _DecodeTerms:
    """What `CostModel.decode_step_s` reads from a decode fit, read once per refit (see `_FitChoice`)."""

    fit: WindowedLeastSquares
    fixed: float
    per_seq: float
    per_context: float
    largest_batch: float  # `WindowedLeastSquares.largest_seen`
    largest_context: float | None  # `WindowedLeastSquares.largest_bounded`

    @classmethod
    def of(cls, fit: WindowedLeastSquares) -> _DecodeTerms:
        d, e, f = fit.coefficients
        return cls(fit, d, e, f, fit.largest_seen(), fit.largest_bounded())

