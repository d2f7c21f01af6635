"""The workload `baton plan` replays: a synthetic Poisson trace of given length distributions, or a recorded one."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.sim.trace import Arrival, extend_chain
from scheduler.types import Tier


@dataclass(frozen=True)
class SyntheticLengths:
    """Token counts of `baton plan`'s synthetic trace: `fixed:N` (or `N`), `uniform:A:B` (continuous, rounded),
    or `lognormal:MEDIAN:SIGMA` (clipped at 1). `baton bench`'s prompts use `loadtest.datasets.LengthDistribution`,
    whose `uniform` draws whole numbers: the two keep their own samplers so that neither's traces change."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> SyntheticLengths:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, *numbers = parts
            values = [float(n) for n in numbers]
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}: {cls.__doc__}") from None
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if arity.get(kind) != len(values) or min(values) < 0:
            raise ValueError(f"bad length distribution {text!r}: {cls.__doc__}")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = self.a * math.exp(rng.gauss(0.0, self.b))
        return max(1, round(value))


def synthetic_trace(prompt: SyntheticLengths, output: SyntheticLengths, rate: float, requests: int,
                    seed: int = 0, block_size: int = 16) -> list[Arrival]:
    """Poisson arrivals of single-turn requests with no shared prefix, one tier (SLOs are global)."""
    if rate <= 0 or requests <= 0:
        raise ValueError("need rate > 0 and requests > 0")
    rng = random.Random(seed)
    now, trace = 0.0, []
    for index in range(requests):
        now += rng.expovariate(rate)
        tokens = prompt.sample(rng)
        hashes = extend_chain((), tokens // block_size, label=seed * 1_000_000 + index)
        trace.append(Arrival(now, f"plan-{index:06d}", tokens, output.sample(rng), hashes, Tier.ENTERPRISE))
    return trace


def trace_from_rows(rows: Sequence[Mapping[str, Any]], block_size: int = 16) -> list[Arrival]:
    """A recorded trace: rows with `time_s`, `prompt_tokens`, `output_tokens` (a JSONL file's lines)."""
    trace = []
    for index, row in enumerate(rows):
        try:
            time_s, prompt, output = float(row["time_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace row {index}: need numeric time_s, prompt_tokens, output_tokens ({e})") from e
        if prompt <= 0 or output <= 0:
            raise ValueError(f"trace row {index}: prompt_tokens and output_tokens must be positive")
        hashes = extend_chain((), prompt // block_size, label=index)
        trace.append(Arrival(time_s, f"trace-{index:06d}", prompt, output, hashes, Tier.ENTERPRISE))
    return sorted(trace, key=lambda a: a.time_s)
