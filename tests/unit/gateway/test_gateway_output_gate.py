"""The output gate: text streams at once, the filter checks it behind, and a halt lands within a
bounded number of tokens of the text that caused it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.gateway.completions.output_gate import OutputGate


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    category: str | None = None
    tier: str = "pattern"


class HaltOn:
    """A filter that halts once the text it has seen contains `word`, answering after `delay_s`."""

    def __init__(self, word: str, delay_s: float = 0.0) -> None:
        self.word = word
        self.delay_s = delay_s
        self.seen = ""
        self.feeds = 0
        self.closed = False

    async def feed(self, delta: str, final: bool = False) -> Verdict:
        self.feeds += 1
        await asyncio.sleep(self.delay_s)
        self.seen += delta
        return Verdict(self.word not in self.seen)

    async def close(self) -> None:
        self.closed = True


async def _stream(gate: OutputGate, deltas: list[str]) -> tuple[list[str], bool]:
    """Feed one-token deltas the way the runner does; (texts released, halted)."""
    out: list[str] = []
    for i, delta in enumerate(deltas):
        text, halt = await gate.admit(delta, 1, final=i == len(deltas) - 1)
        if halt is not None:
            return out, True
        out.append(text)
    return out, False


async def test_the_first_token_is_released_before_the_filter_answers() -> None:
    f = HaltOn("never", delay_s=0.5)
    gate = OutputGate(f)
    text, halt = await asyncio.wait_for(gate.admit("Hello", 1, final=False), 0.05)
    assert (text, halt) == ("Hello", None)
    await gate.close()


async def test_a_slow_filter_holds_the_stream_after_the_unchecked_budget() -> None:
    gate = OutputGate(HaltOn("never", delay_s=0.2), max_unchecked_tokens=4)
    for i in range(4):
        assert await asyncio.wait_for(gate.admit(f"t{i} ", 1, final=False), 0.05) == (f"t{i} ", None)
    released = asyncio.ensure_future(gate.admit("t4 ", 1, final=False))
    await asyncio.sleep(0.05)
    assert not released.done()  # five unchecked tokens: waits for the filter to catch up
    assert await asyncio.wait_for(released, 2) == ("t4 ", None)
    await gate.close()


async def test_a_halt_lands_within_16_tokens_of_the_offending_text() -> None:
    deltas = [f"w{i} " for i in range(10)] + ["secret@mail.com "] + [f"x{i} " for i in range(40)]
    out, halted = await _stream(OutputGate(HaltOn("secret@mail.com", delay_s=0.01)), deltas)
    assert halted
    after = len(out) - deltas.index("secret@mail.com ")
    assert 0 < after <= 16, after


async def test_the_final_chunk_waits_for_every_verdict() -> None:
    f = HaltOn("bad", delay_s=0.02)
    out, halted = await _stream(OutputGate(f), ["all ", "good ", "until ", "bad"])
    assert halted and "bad" not in "".join(out)


async def test_deltas_queued_behind_a_verdict_go_as_one_feed() -> None:
    f = HaltOn("never", delay_s=0.05)
    out, halted = await _stream(OutputGate(f, max_unchecked_tokens=16), [f"t{i} " for i in range(12)])
    assert not halted and len(out) == 12 and f.feeds < 12 and f.seen == "".join(out)


async def test_close_closes_the_filter() -> None:
    f = HaltOn("never")
    gate = OutputGate(f)
    await gate.admit("a", 1, final=False)
    await gate.close()
    assert f.closed


async def test_without_a_filter_text_passes_straight_through() -> None:
    assert await _stream(OutputGate(None), ["a", "b c"]) == (["a", "b c"], False)
