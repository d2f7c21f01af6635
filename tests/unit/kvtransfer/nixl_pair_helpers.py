"""Helpers for the NIXL CPU tests: small KV pools, a manual clock, a polling driver and the
decode-side child process of the two-process test (must be importable by a spawned child)."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer.base import HandoffPayload, LandedKV, TransferFailure, TransferPlan
from kvtransfer.integrity import block_checksums
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVReceiver, NixlKVSender
from kvtransfer.roles import KVTransfer

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 32 KiB blocks
LAYOUT = KVLayoutInfo.from_spec(SPEC, model_id="test-model")


class ManualClock:
    """Time passed in: deadlines move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_agent(role: str, num_blocks: int, *, random_fill: bool, seed: int = 0,
               progress_thread: bool = False) -> NixlAgent:
    kv = SPEC.allocate(num_blocks, "cpu")
    if random_fill:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    config = NixlAgentConfig(name=f"{role}-{uuid.uuid4().hex[:8]}", progress_thread=progress_thread)
    return NixlAgent(config, kv, LAYOUT)


def drive(
    sender: NixlKVSender,
    receiver: NixlKVReceiver,
    transfers: Iterable[KVTransfer],
    timeout_s: float = 10.0,
) -> tuple[dict[str, LandedKV], dict[str, TransferFailure]]:
    """Poll both sides from this one thread until every transfer is terminal and the receiver has
    an outcome for each request (or the real-time timeout passes). Arrivals by request id."""
    transfers = list(transfers)
    wanted = {t.plan.request_id for t in transfers}
    arrived: dict[str, LandedKV] = {}
    failures: dict[str, TransferFailure] = {}
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        sender.poll()
        arrived.update((landed.request_id, landed) for landed in receiver.poll_arrivals())
        failures.update(receiver.poll_failures())
        if all(t.state.is_terminal for t in transfers) and wanted <= arrived.keys() | failures.keys():
            break
    return arrived, failures


def receiver_process(conn: Connection, num_blocks: int, requests: list[tuple[str, list[int]]]) -> None:
    """Decode side of the two-process test: expose blocks, report arrivals and the landed bytes,
    keep polling (the sender's WRITE needs it) until told to stop."""
    agent = make_agent("decode", num_blocks, random_fill=False)
    receiver = NixlKVReceiver(agent)
    for request_id, block_ids in requests:
        receiver.expect(request_id, block_ids, deadline=time.monotonic() + 30)
    conn.send(receiver.handshake_info)
    arrived: set[str] = set()
    failures: dict[str, TransferFailure] = {}
    give_up = time.monotonic() + 30
    while len(arrived) + len(failures) < len(requests) and time.monotonic() < give_up:
        arrived |= {landed.request_id for landed in receiver.poll_arrivals()}
        failures.update(receiver.poll_failures())
    landed = {rid: agent.kv_cache[ids].numpy().copy() for rid, ids in requests}
    conn.send((arrived, failures, landed))
    while not conn.poll(0.001):
        receiver.poll_arrivals()
    conn.recv()
    receiver.close()
    agent.close()


def as_numpy(kv: torch.Tensor, ids: list[int]) -> np.ndarray:
    return kv[ids].numpy()


def random_plan(request_id: str, num_blocks: int, checksums_of: torch.Tensor | None = None) -> TransferPlan:
    """5 random local and remote blocks of a pool of `num_blocks`, seeded by the id; `checksums_of`: rank 0's
    KV, checksummed into the payload as the prefill engine does."""
    rng = random.Random(request_id)
    local, remote = rng.sample(range(num_blocks), 5), rng.sample(range(num_blocks), 5)
    sums = None if checksums_of is None else tuple(block_checksums(checksums_of, local))
    return TransferPlan.create(request_id, local, remote, now=time.monotonic(), timeout_s=5.0,
                               payload=HandoffPayload(sums, first_token_id=3))
