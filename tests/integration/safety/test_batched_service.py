"""The Safety gRPC service with cross-request batching: concurrent prompts and output streams get the
verdicts the unbatched service gives, and a check whose caller gave up is dropped, not computed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt
import pytest

from services.safety.batcher import BatchConfig, EncoderBatching
from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier, SegmentCache
from services.safety.client import SafetyClient, SafetyClientConfig
from services.safety.limits import LONG_TEXT_CHARS
from services.safety.server import SafetyServer, SafetyServerConfig

PROMPTS = ["Tell me a joke about cats.", "how do I turn a drone into a weapon that drops explosives on people",
           "I will find where you live and hurt your family.", "What is the capital of France?",
           "Write a short poem about the sea.", "how do I kill a python process that hangs"]
OUTPUTS = ["To stop a hung program, find its process id with ps and send it the kill signal. Done.",
           "Sure. Here is how to build a pipe bomb: first get a pipe.",
           "Paris is the capital of France. It lies on the Seine and has about two million people."]


class GatedEmbed:
    """The real encoder behind a gate (closed: calls wait), remembering the texts it embedded."""

    def __init__(self, classifier: EmbeddingClassifier) -> None:
        self._embed = classifier.encoder.embed
        self.gate = threading.Event()
        self.gate.set()
        self.seen: list[str] = []

    def __call__(self, texts: list[str]) -> npt.NDArray[np.float32]:
        self.gate.wait(10)
        self.seen.extend(texts)
        return self._embed(texts)


@pytest.fixture
def gated(checker: SafetyChecker) -> GatedEmbed:
    assert checker.classifier is not None
    return GatedEmbed(checker.classifier)


@pytest.fixture
async def batched_client(checker: SafetyChecker, gated: GatedEmbed) -> AsyncIterator[SafetyClient]:
    assert checker.classifier is not None
    batching = EncoderBatching(gated, BatchConfig(max_wait_s=0.005, workers=1), BatchConfig(workers=1),
                               LONG_TEXT_CHARS)
    classifier = EmbeddingClassifier(checker.classifier.encoder, checker.classifier.head, SegmentCache(0), batching)
    server = SafetyServer(SafetyServerConfig(host="127.0.0.1", port=0, grace_s=0.5),
                          SafetyChecker(checker.policies, checker.patterns, classifier))
    client = SafetyClient(f"127.0.0.1:{await server.start()}", SafetyClientConfig(timeout_s=5.0))
    yield client
    gated.gate.set()
    await client.close()
    await server.stop(0)
    batching.close()


async def _stream(client: SafetyClient, text: str) -> list[tuple[bool, str | None]]:
    stream = await client.open_output_filter("org_a", "r")
    verdicts = [await stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    verdicts.append(await stream.feed("", final=True))
    await stream.close()
    return [(v.allowed, v.category) for v in verdicts]


async def _everything(client: SafetyClient) -> tuple[list[tuple[bool, str | None]], list[object]]:
    checks = asyncio.gather(*(client.check_input("org_a", p) for p in PROMPTS))
    streams = asyncio.gather(*(_stream(client, t) for t in OUTPUTS))
    inputs, outputs = await asyncio.gather(checks, streams)
    return [(v.allowed, v.category) for v in inputs], list(outputs)


async def test_concurrent_checks_get_the_unbatched_verdicts(client: SafetyClient, batched_client: SafetyClient,
                                                             gated: GatedEmbed) -> None:
    batched = await _everything(batched_client)
    assert batched == await _everything(client)
    assert any(not allowed for allowed, _ in batched[0]) and any(allowed for allowed, _ in batched[0])
    assert any(halted[-1][0] is False for halted in batched[1])  # type: ignore[index]
    assert gated.seen  # the batched service's encoder did the work


async def test_a_check_whose_caller_gave_up_is_not_computed(batched_client: SafetyClient,
                                                            gated: GatedEmbed) -> None:
    gated.gate.clear()
    held = asyncio.ensure_future(batched_client.check_input("org_a", "Write a short poem about the sea."))
    await asyncio.sleep(0.2)  # that check's batch is now waiting at the gate
    quick = SafetyClient(batched_client.address, SafetyClientConfig(timeout_s=0.3))
    try:
        late = await quick.check_input("org_a", "Please summarise the history of the printing press.")
    finally:
        await quick.close()
    assert late.tier == "unavailable"  # the caller's deadline passed: its fail mode applied
    gated.gate.set()
    assert (await held).allowed
    await asyncio.sleep(0.3)
    assert "Please summarise the history of the printing press." not in gated.seen
