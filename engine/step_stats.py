"""What an engine step ran, for step-time samples, metrics and speculative-decoding totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import BatchPlan, StepResult


@dataclass
class SpeculationStats:
    """Totals since start over verify chunks (decodes that carried a draft), for metrics and benchmarks."""

    verify_chunks: int = 0
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # drafts the target model kept

    @classmethod
    def of_step(cls, plan: BatchPlan, result: StepResult) -> SpeculationStats:
        """One step's verify chunks, drafts and accepted drafts."""
        step = cls()
        for chunk in plan.chunks:
            if chunk.num_draft_tokens:
                step.verify_chunks += 1
                step.draft_tokens += chunk.num_draft_tokens
                step.accepted_tokens += len(result.accepted.get(chunk.request_id, ()))
        return step

    def add(self, other: SpeculationStats) -> None:
        self.verify_chunks += other.verify_chunks
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a verify chunk yields on average: accepted drafts plus the model's own token."""
        return (self.accepted_tokens + self.verify_chunks) / self.verify_chunks if self.verify_chunks else 0.0


@dataclass(frozen=True)
class StepStats:
    """What one step ran (for step-time samples and metrics).

    Two times: `seconds` is the forward pass and sampling (`runner.execute`); `served_seconds` is what
    the step cost the engine loop that serves it (engine.async_engine), from the loop's previous step
    (or its wake from idle) to this step's end: the commands applied between steps, the batch's
    scheduling and bookkeeping, the previous step's emission to the streams, and the forward pass. A
    busy loop's period is the client's token gap, so a TPOT predicted from `seconds` alone is short by
    the rest: on one H200 near saturation, ~2 ms of a ~13-ms mean step (docs/benchmarks.md)."""

    prefill_tokens: int  # tokens of prefill chunks
    attention_tokens_sq: int  # sum over prefill chunks of new * (new + 2 * cached)
    decode_seqs: int  # sequences that decoded (one token, or a verify chunk of one token + its draft)
    decode_context_tokens: int  # their total context after the step
    seconds: float
    speculation: SpeculationStats = field(default_factory=lambda: SpeculationStats())  # this step's drafts
    served_seconds: float | None = None  # None: not stepped by a serving loop (a bare LLMEngine)

    @property
    def period_seconds(self) -> float:
        """The step as its clients pay for it: the served time where a serving loop measured one."""
        return self.seconds if self.served_seconds is None else self.served_seconds

    @classmethod
    def of(cls, plan: BatchPlan, seconds: float, speculation: SpeculationStats | None = None) -> StepStats:
        prefill = attention = decodes = context = 0
        for c in plan.chunks:
            decoding = c.start_pos >= len(c.prompt_token_ids)
            if decoding and (c.num_tokens == 1 or c.num_draft_tokens):  # a verify chunk is a decode, not a prefill
                decodes += 1
                context += c.context_len
            else:
                prefill += c.num_tokens
                attention += c.num_tokens * (c.num_tokens + 2 * c.start_pos)
        return cls(prefill, attention, decodes, context, seconds, speculation or SpeculationStats())
