"""Replay traces: request arrivals, and a seeded synthetic generator of a mixed workload.

The generator produces the shapes that make routing matter: chat turns on a few shared system
prompts (prefix reuse across users), follow-up turns that extend a conversation's own prefix,
and long-document prompts (prefill-heavy). Block hashes are chained like the gateway's — each
depends on its parent — but computed from labels rather than token ids, which is all the
scheduler ever sees.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

from scheduler.types import Tier

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Arrival:
    time_s: float
    request_id: str
    prompt_tokens: int
    output_tokens: int  # what the request will actually generate
    prefix_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    tier: Tier
    max_tokens: int | None = None  # the cap the client asked for; None: exactly output_tokens
    conversation_id: str | None = None
    # Chained hashes of the full blocks the answer fills after the prompt's (`link_turns`): the engine
    # caches every computed block, the answer's too, and a conversation's next turn begins with them.
    output_hashes: tuple[int, ...] = ()

    @property
    def effective_max_tokens(self) -> int:
        return self.output_tokens if self.max_tokens is None else max(self.max_tokens, 1)


def link_turns(trace: Sequence[Arrival], block_size: int) -> list[Arrival]:
    """`trace` with each conversation turn's `output_hashes` read from the conversation's next turn, whose
    prompt begins with this turn's prompt and answer. The blocks counted are those the answer completes
    with its KV computed (every token's but the last one generated). Turns are linked by conversation id
    where the trace has one, else by their hashes: the next turn is the earliest later prompt that begins
    with this one's blocks, provided every later prompt that does continues one chain (a prompt of shared
    blocks only, a system prompt, begins many conversations and links to none). A conversation's last
    turn, and a turn whose next prompt rewrote the history, get none.

    Without them a replay's worker cached only prompts, so a later turn missed the block(s) holding the
    previous answer: on the CPU policy runs' multi-turn experiment the simulated prefix hit rate was 0.81
    where the real engine's was 0.84 in every repeat, and the simulated TTFT p90 of prefix-aware routing
    was 1.17-1.34x the real one (docs/benchmarks.md, pass Z)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    ordered = sorted(trace, key=lambda a: a.time_s)
    linked = []
    for i, turn in enumerate(ordered):
        later = _next_turn(turn, ordered[i + 1:])
        linked.append(turn if later is None else replace(turn, output_hashes=_answer_blocks(turn, later, block_size)))
    return linked


def _next_turn(turn: Arrival, later: Sequence[Arrival]) -> Arrival | None:
    if turn.conversation_id is not None:
        return next((a for a in later if a.conversation_id == turn.conversation_id), None)
    own = turn.prefix_hashes
    chain = [a for a in later if len(a.prefix_hashes) > len(own) and a.prefix_hashes[: len(own)] == own]
    if not own or not chain:
        return None
    if any(b.prefix_hashes[: len(a.prefix_hashes)] != a.prefix_hashes for a, b in pairwise(chain)):
        return None
    return chain[0]


def _answer_blocks(turn: Arrival, later: Arrival, block_size: int) -> tuple[int, ...]:
    own = turn.prefix_hashes
    if later.prefix_hashes[: len(own)] != own:
        return ()
    computed_blocks = (turn.prompt_tokens + turn.output_tokens - 1) // block_size
    return later.prefix_hashes[len(own): computed_blocks]


def extend_chain(prefix: tuple[int, ...], num_blocks: int, label: int) -> tuple[int, ...]:
    """Append `num_blocks` hashes chained from `prefix`; `label` makes the new content unique."""
    hashes = list(prefix)
    parent = hashes[-1] if hashes else 0
    for i in range(num_blocks):
        # Tuples of ints hash identically in every run (PYTHONHASHSEED only salts str/bytes).
        parent = hash((parent, label, i)) & _MASK64
        hashes.append(parent)
    return tuple(hashes)


def _default_tier_mix() -> dict[Tier, float]:
    return {Tier.FREE: 0.5, Tier.PLUS: 0.3, Tier.ENTERPRISE: 0.2}


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 1000
    rate_per_s: float = 20.0  # Poisson arrivals
    block_size: int = 16
    system_prompts: int = 4
    system_prompt_tokens: int = 512
    chat_message_tokens: tuple[int, int] = (64, 768)
    chat_output_tokens: tuple[int, int] = (32, 256)
    document_fraction: float = 0.2
    document_prompt_tokens: tuple[int, int] = (2048, 6144)
    document_output_tokens: tuple[int, int] = (32, 128)
    followup_fraction: float = 0.3  # of chat requests: the next turn of an earlier conversation
    followup_min_gap_s: float = 5.0  # a user reads the answer before replying
    max_conversation_tokens: int = 8192
    tier_mix: Mapping[Tier, float] = field(default_factory=_default_tier_mix)
    seed: int = 0


@dataclass
class _Conversation:
    conversation_id: str
    tier: Tier
    context_tokens: int  # previous prompt + its answer
    hashes: tuple[int, ...]  # full blocks of the previous prompt
    last_arrival_s: float


def make_trace(spec: WorkloadSpec) -> list[Arrival]:
    rng = random.Random(spec.seed)
    conversations: list[_Conversation] = []
    arrivals: list[Arrival] = []
    now = 0.0
    for index in range(spec.num_requests):
        now += rng.expovariate(spec.rate_per_s)
        request_id = f"req-{index:06d}"
        if rng.random() < spec.document_fraction:
            arrivals.append(_document(spec, rng, now, request_id, index))
        else:
            arrivals.append(_chat_turn(spec, rng, now, request_id, index, conversations))
    return arrivals


def _pick_tier(spec: WorkloadSpec, rng: random.Random) -> Tier:
    tiers = list(spec.tier_mix)
    return rng.choices(tiers, weights=[spec.tier_mix[t] for t in tiers])[0]


def _document(spec: WorkloadSpec, rng: random.Random, now: float, request_id: str, index: int) -> Arrival:
    prompt = rng.randint(*spec.document_prompt_tokens)
    hashes = extend_chain((), prompt // spec.block_size, label=1_000_000 + index)
    output = rng.randint(*spec.document_output_tokens)
    return Arrival(now, request_id, prompt, output, hashes, _pick_tier(spec, rng))


def _chat_turn(
    spec: WorkloadSpec,
    rng: random.Random,
    now: float,
    request_id: str,
    index: int,
    conversations: list[_Conversation],
) -> Arrival:
    message = rng.randint(*spec.chat_message_tokens)
    output = rng.randint(*spec.chat_output_tokens)
    ready = [c for c in conversations if now - c.last_arrival_s >= spec.followup_min_gap_s]
    conversation = rng.choice(ready) if ready and rng.random() < spec.followup_fraction else None
    if conversation is None or conversation.context_tokens + message > spec.max_conversation_tokens:
        if conversation is not None:
            conversations.remove(conversation)
        conversation = _new_conversation(spec, rng, now, index)
        conversations.append(conversation)
    prompt = conversation.context_tokens + message
    reused = conversation.hashes[: conversation.context_tokens // spec.block_size]
    hashes = extend_chain(reused, prompt // spec.block_size - len(reused), label=2_000_000 + index)
    conversation.context_tokens = prompt + output
    conversation.hashes = hashes
    conversation.last_arrival_s = now
    return Arrival(
        now, request_id, prompt, output, hashes, conversation.tier, None, conversation.conversation_id
    )


def _new_conversation(spec: WorkloadSpec, rng: random.Random, now: float, index: int) -> _Conversation:
    system = rng.randrange(spec.system_prompts)
    system_blocks = spec.system_prompt_tokens // spec.block_size
    hashes = extend_chain((), system_blocks, label=system)
    return _Conversation(
        f"conv-{index:06d}", _pick_tier(spec, rng), system_blocks * spec.block_size, hashes, now
    )
