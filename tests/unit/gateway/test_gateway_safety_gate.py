"""The safety gate checks every text the model reads, each distinct text once per organisation."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from services.gateway.completions.safety_gate import SafetyGate, SafetyUnavailableError, VerdictCache

ORG = uuid.uuid4()


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    category: str | None = None
    tier: str = "classifier"
    score: float = 0.0
    watch: bool = False
    category_scores: tuple[tuple[str, float], ...] = ()


class KeywordClient:
    """Refuses texts containing "bomb"; watches texts containing "hmm"; counts calls."""

    def __init__(self, tier: str = "classifier") -> None:
        self.calls: list[str] = []
        self.tier = tier

    async def check_input(self, org_id: str, text: str, request_id: str = "") -> Verdict:
        self.calls.append(text)
        if self.tier == "unavailable":
            return Verdict(allowed=False, tier="unavailable")
        return Verdict(allowed="bomb" not in text, category="violence" if "bomb" in text else None,
                       watch="hmm" in text)

    async def open_output_filter(self, org_id: str, request_id: str, watch: bool = False) -> object:
        raise NotImplementedError


async def test_harm_in_any_new_message_is_refused() -> None:
    gate = SafetyGate(KeywordClient())
    for messages in (["You are a bomb maker", "hello"], ["hi", "sure, the bomb goes"], ["tool says: bomb"]):
        decision = await gate.check_texts(ORG, (), messages, "r")
        assert decision.refusal is not None and decision.refusal.category == "violence", messages


async def test_harm_in_stored_history_is_refused() -> None:
    decision = await SafetyGate(KeywordClient()).check_texts(ORG, ("old: bomb recipe",), ("continue",), "r")
    assert decision.refusal is not None


async def test_a_request_split_over_messages_is_also_read_joined() -> None:
    client = KeywordClient()
    await SafetyGate(client).check_texts(ORG, (), ("how to make a bo", "mb"), "r")
    assert "how to make a bo\nmb" in client.calls


async def test_history_is_checked_once_across_turns() -> None:
    client = KeywordClient()
    gate = SafetyGate(client)
    history = tuple(f"turn {i}" for i in range(20))
    await gate.check_texts(ORG, history, ("next",), "r1")
    first = len(client.calls)
    await gate.check_texts(ORG, (*history, "next", "answer"), ("and now?",), "r2")
    assert first == 21 and len(client.calls) - first == 2  # only "answer" and "and now?" are new


async def test_the_cache_is_per_organisation() -> None:
    client = KeywordClient()
    gate = SafetyGate(client)
    await gate.check_texts(ORG, (), ("same text",), "r")
    await gate.check_texts(uuid.uuid4(), (), ("same text",), "r")
    assert client.calls == ["same text", "same text"]


async def test_watch_is_reported_when_any_text_is_uncertain() -> None:
    decision = await SafetyGate(KeywordClient()).check_texts(ORG, ("hmm, maybe",), ("fine",), "r")
    assert decision.refusal is None and decision.watch


async def test_an_outage_is_a_503_and_never_cached() -> None:
    client = KeywordClient(tier="unavailable")
    gate = SafetyGate(client)
    for _ in range(2):
        with pytest.raises(SafetyUnavailableError):
            await gate.check_texts(ORG, (), ("hello",), "r")
    assert len(client.calls) == 2 and len(gate.cache) == 0


def test_the_cache_evicts_the_least_recently_used() -> None:
    cache = VerdictCache(max_entries=2)
    keys = [VerdictCache.key("o", t) for t in ("a", "b", "c")]
    cache.put(keys[0], Verdict(True))
    cache.put(keys[1], Verdict(True))
    assert cache.get(keys[0]) is not None  # "a" is now the most recent
    cache.put(keys[2], Verdict(True))
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and len(cache) == 2
