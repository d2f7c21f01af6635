"""The output gate: text reaches the client only after the safety filter passed it, whole words only."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.safety_gate import OutputGate


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    category: str | None = None
    tier: str = "pattern"


class HaltOn:
    """A filter that halts once the text it has seen contains `word`."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.seen = ""

    async def feed(self, delta: str, final: bool = False) -> Verdict:
        self.seen += delta
        return Verdict(self.word not in self.seen)

    async def close(self) -> None:
        pass


async def _run(gate: OutputGate, deltas: list[str]) -> tuple[str, bool]:
    out = ""
    for i, delta in enumerate(deltas):
        text, halt = await gate.admit(delta, final=i == len(deltas) - 1)
        if halt is not None:
            return out, True
        out += text
    return out, False


async def test_open_words_are_held_until_the_next_verdict() -> None:
    gate = OutputGate(HaltOn("never"))
    assert await gate.admit("Hello wor", final=False) == ("Hello ", None)
    assert await gate.admit("ld, and", final=False) == ("world, ", None)
    assert await gate.admit("", final=True) == ("and", None)


async def test_a_halt_drops_the_held_word() -> None:
    text, halted = await _run(OutputGate(HaltOn("secret@mail.com")), ["mail me at ", "secret@", "mail.com", " now"])
    assert halted and text == "mail me at "


async def test_without_a_filter_text_passes_straight_through() -> None:
    assert await _run(OutputGate(None), ["a", "b c"]) == ("ab c", False)
