"""Per-worker step-time model, seeded from a profile and refitted online from reported samples.

prefill step  = a + b*tokens + c*attention      (attention = tokens**2 for one uncached prompt)
decode step   = d + e*batch  + f*context_tokens (memory-bound: weights once, KV per context token)
KV transfer   = g + h*tokens                    (not fitted yet: workers report no transfer samples)

The fit is windowed least squares pulled towards the profile (ridge to the prior): with no samples
the profile is the answer, a handful of samples nudges it, and a full window of recent samples
dominates it, so a worker that slows down (thermal throttling, a noisy neighbour) is tracked
within one window. Features are rescaled to O(1) before solving; tokens**2 reaches 1e8 and would
otherwise make the normal equations numerically useless. Pure Python: the systems are 3x3.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from scheduler.types import DecodeSample, PrefillSample, StepSample

_MIN_STEP_S = 1e-4  # predictions never go below this: a zero-cost step would attract every request


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
        attention = new_tokens * (new_tokens + 2 * cached_tokens)
        return (
            self.prefill_fixed_s
            + self.prefill_per_token_s * new_tokens
            + self.prefill_per_token_sq_s * attention
        )

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * batch
            + self.decode_per_context_token_s * context_tokens
        )

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_fixed_s + self.transfer_per_token_s * tokens


class WindowedLeastSquares:
    """Least squares over the last `window` samples, regularised towards `prior` coefficients.

    The normal equations are kept as running sums (a sample's outer product is added on arrival
    and subtracted when it leaves the window), so a refit is a small k-by-k solve however large
    the window. The sums are rebuilt from the window once per `window` samples to stop
    floating-point drift from accumulating.
    """

    def __init__(
        self, prior: tuple[float, ...], scales: tuple[float, ...], window: int, prior_weight: float
    ) -> None:
        if len(prior) != len(scales) or window <= 0 or prior_weight <= 0:
            raise ValueError("need len(prior) == len(scales), window > 0 and prior_weight > 0")
        self._scales = scales
        self._prior_scaled = [p * s for p, s in zip(prior, scales, strict=True)]
        self._prior_weight = prior_weight
        self._window = window
        self._samples: deque[tuple[list[float], float]] = deque()
        self._since_rebuild = 0
        self._xtx = [[0.0] * len(scales) for _ in scales]
        self._xty = [0.0] * len(scales)
        self._coefficients = tuple(prior)
        self._dirty = False

    def add(self, features: tuple[float, ...], target: float) -> None:
        scaled = [f / s for f, s in zip(features, self._scales, strict=True)]
        self._samples.append((scaled, target))
        self._accumulate(scaled, target, 1.0)
        if len(self._samples) > self._window:
            old, old_target = self._samples.popleft()
            self._accumulate(old, old_target, -1.0)
        self._since_rebuild += 1
        if self._since_rebuild >= self._window:
            self._rebuild()
        self._dirty = True

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def coefficients(self) -> tuple[float, ...]:
        # Refit lazily: heartbeats bring many samples, routing asks for few predictions in between.
        if self._dirty:
            self._coefficients = self._solve()
            self._dirty = False
        return self._coefficients

    def _accumulate(self, x: list[float], target: float, sign: float) -> None:
        for i, xi in enumerate(x):
            self._xty[i] += sign * xi * target
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] += sign * xi * xj

    def _rebuild(self) -> None:
        self._xtx = [[0.0] * len(self._scales) for _ in self._scales]
        self._xty = [0.0] * len(self._scales)
        for x, target in self._samples:
            self._accumulate(x, target, 1.0)
        self._since_rebuild = 0

    def _solve(self) -> tuple[float, ...]:
        lam = self._prior_weight
        a = [[v + (lam if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xtx)]
        b = [v + lam * p for v, p in zip(self._xty, self._prior_scaled, strict=True)]
        theta_scaled = _solve_spd(a, b)
        # Every true coefficient is a cost, so a negative one is noise; clamping keeps long prompts
        # from being predicted as cheaper than short ones.
        return tuple(max(t / s, 0.0) for t, s in zip(theta_scaled, self._scales, strict=True))


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination for the small symmetric positive-definite systems above (no pivoting
    needed: the ridge term keeps every pivot positive)."""
    n = len(b)
    a = [row[:] for row in a]
    b = b[:]
    for k in range(n):
        for i in range(k + 1, n):
            factor = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= factor * a[k][j]
            b[i] -= factor * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


class CostModel:
    """One worker's predicted step times; `observe` samples as heartbeats deliver them."""

    def __init__(
        self, profile: WorkerProfile | None = None, window: int = 512, prior_weight: float = 1.0
    ) -> None:
        self._profile = profile or WorkerProfile()
        p = self._profile
        self._prefill = WindowedLeastSquares(
            (p.prefill_fixed_s, p.prefill_per_token_s, p.prefill_per_token_sq_s),
            (1.0, 1e3, 1e6),
            window,
            prior_weight,
        )
        self._decode = WindowedLeastSquares(
            (p.decode_fixed_s, p.decode_per_seq_s, p.decode_per_context_token_s),
            (1.0, 1e2, 1e5),
            window,
            prior_weight,
        )

    def observe(self, sample: StepSample) -> None:
        if sample.seconds <= 0:
            return  # a clock glitch; a zero-time step would drag every coefficient down
        if isinstance(sample, PrefillSample):
            attention = sample.attention_tokens_sq
            sq = sample.tokens**2 if attention is None else attention
            self._prefill.add((1.0, float(sample.tokens), float(sq)), sample.seconds)
        elif isinstance(sample, DecodeSample):
            self._decode.add((1.0, float(sample.batch_size), float(sample.context_tokens)), sample.seconds)

    @property
    def num_samples(self) -> int:
        return self._prefill.num_samples + self._decode.num_samples

    def fitted_profile(self) -> WorkerProfile:
        """The current coefficients as a profile (for metrics, and to seed the next start)."""
        a, b, c = self._prefill.coefficients
        d, e, f = self._decode.coefficients
        return WorkerProfile(
            prefill_fixed_s=a,
            prefill_per_token_s=b,
            prefill_per_token_sq_s=c,
            decode_fixed_s=d,
            decode_per_seq_s=e,
            decode_per_context_token_s=f,
            transfer_fixed_s=self._profile.transfer_fixed_s,
            transfer_per_token_s=self._profile.transfer_per_token_s,
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        a, b, c = self._prefill.coefficients
        return max(_MIN_STEP_S, a + b * new_tokens + c * new_tokens * (new_tokens + 2 * cached_tokens))

    def prefill_backlog_s(self, queued_tokens: int, queued_requests: int) -> float:
        """Time to drain a prefill queue whose per-prompt sizes are unknown (assumed equal)."""
        if queued_tokens <= 0:
            return 0.0
        a, b, c = self._prefill.coefficients
        requests = max(queued_requests, 1)
        return a * requests + b * queued_tokens + c * queued_tokens**2 / requests

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        d, e, f = self._decode.coefficients
        return max(_MIN_STEP_S, d + e * batch + f * context_tokens)

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
        prefill also shares its step with the running decode batch: pass that step as
        `shared_step_s`."""
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
