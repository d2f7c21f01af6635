"""The two processes of the NIXL KV WRITE benchmark (lab/micro/bench_kv_transfer.py): the receiver
exposes its blocks and verifies what landed, the sender times WRITEs (optionally checksumming first, as the
prefill engine does). They talk over a multiprocessing pipe; every wait has a timeout."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import statistics
import time
import traceback
import uuid
from multiprocessing.connection import Connection

import torch

from engine.kv_cache import KVCacheSpec
from engine.kv_integrity import block_checksums
from kvtransfer.base import HandoffPayload, TransferPlan, TransferState
from kvtransfer.layout import KVLayoutInfo

MODEL_ID = "bench-kv-llama-3.1-8b-shape"
RECV_TIMEOUT_S = 60.0  # any pipe message (handshake, ack, verification)
TRANSFER_TIMEOUT_S = 20.0  # one WRITE


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {mp.current_process().name}] {msg}", flush=True)


def recv(conn: Connection, what: str, timeout_s: float = RECV_TIMEOUT_S) -> tuple:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {what} within {timeout_s} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"peer failed while we waited for {what}:\n{msg[1]}")
    return msg


def setup_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    return dev


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN bit pattern equals itself here, unlike torch.equal on floats)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- process B: the receiver ------------------------------------------------------------------------
def receiver_main(conn: Connection, spec: KVCacheSpec, num_blocks: int, device: str, life_s: float) -> None:
    """Expose a zeroed pool; poll NIXL until told to stop; zero / verify on request."""
    from kvtransfer.nixl import NixlAgent, NixlAgentConfig

    agent = None
    try:
        dev = setup_device(device)
        kv = spec.allocate(num_blocks, dev)
        sync(dev)
        layout = KVLayoutInfo.from_spec(spec, model_id=MODEL_ID)
        agent = NixlAgent(NixlAgentConfig(name=f"bench-recv-{uuid.uuid4().hex[:8]}"), kv, layout)
        log(f"receiver ready: {num_blocks} blocks of {spec.bytes_per_block} B on {dev} "
            f"({agent.handshake_info.mem_type})")
        conn.send(("hello", agent.handshake_info))
        give_up = time.monotonic() + life_s
        notices = 0
        while time.monotonic() < give_up:
            if not conn.poll(0):
                notices += len(agent.drain_notifications())  # NIXL progress: the peer's WRITEs need it
                time.sleep(2e-5)
                continue
            msg = conn.recv()
            if msg[0] == "stop":
                conn.send(("bye", notices))
                break
            if msg[0] == "zero":
                kv.zero_()
                sync(dev)
                conn.send(("zeroed",))
            elif msg[0] == "verify":
                _, remote_ids, expected = msg  # numpy uint8 [blocks, bytes_per_block]: no /dev/shm needed
                got = kv[list(remote_ids)].cpu().view(len(remote_ids), -1).view(torch.uint8)
                want = torch.from_numpy(expected)
                bad = [bid for i, bid in enumerate(remote_ids) if not torch.equal(got[i], want[i])]
                conn.send(("verified", not bad, bad[:8]))
        else:
            log(f"receiver gave up after {life_s} s without a stop")
    except BaseException:
        log("receiver failed")
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if agent is not None:
            agent.close()


# ---- process A: the sender --------------------------------------------------------------------------
def sender_main(conn: Connection, out: Connection, spec: KVCacheSpec, num_blocks: int, device: str,
                n_blocks: int, warmup: int, iters: int, seed: int, case_names: tuple[str, ...]) -> None:
    from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVSender

    agent = None
    senders = []
    try:
        dev = setup_device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        kv = torch.randn((num_blocks, *spec.block_shape), generator=gen, device=dev, dtype=spec.torch_dtype)
        sync(dev)
        layout = KVLayoutInfo.from_spec(spec, model_id=MODEL_ID)
        agent = NixlAgent(NixlAgentConfig(name=f"bench-send-{uuid.uuid4().hex[:8]}"), kv, layout)
        plain = NixlKVSender(agent)
        senders = [plain]
        info = recv(conn, "receiver handshake")[1]
        peer = plain.add_peer(info)
        log(f"sender ready on {dev}; peer {peer}")
        rng = random.Random(seed)
        contiguous = (tuple(range(n_blocks)), tuple(range(n_blocks)))
        scattered = (tuple(rng.sample(range(num_blocks), n_blocks)), tuple(rng.sample(range(num_blocks), n_blocks)))
        cases = {"contiguous": (None, *contiguous), "random": (None, *scattered),
                 "contiguous+cksum": (kv, *contiguous)}
        results = {}
        counter = 0
        for name in case_names:
            sender = plain
            cksum_of, local_ids, remote_ids = cases[name.split(" ")[0]]
            conn.send(("zero",))
            recv(conn, "zero ack")
            counter += 1
            first_s = one_write(sender, peer, f"{name}-verify", counter, local_ids, remote_ids, cksum_of)
            source = kv[list(local_ids)].cpu().view(len(local_ids), -1).view(torch.uint8).numpy()
            conn.send(("verify", remote_ids, source))
            _, ok, bad = recv(conn, "verification")
            log(f"{name}: first WRITE {first_s * 1e3:.2f} ms, destination {'matches' if ok else 'DIFFERS'} {bad}")
            times = []
            for i in range(warmup + iters):
                counter += 1
                seconds = one_write(sender, peer, f"{name}-{i}", counter, local_ids, remote_ids, cksum_of)
                if i >= warmup:
                    times.append(seconds)
            results[name] = {"verified": ok, "bad_blocks": bad, "first_write_ms": first_s * 1e3,
                             "times_ms": [t * 1e3 for t in times]}
            log(f"{name}: median {statistics.median(times) * 1e3:.3f} ms over {iters}")
        conn.send(("stop",))
        recv(conn, "receiver stop ack")
        out.send(("results", results))
    except BaseException:
        log("sender failed")
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send(("stop",))
        out.send(("error", traceback.format_exc()))
    finally:
        for sender in senders:
            sender.close()
        if agent is not None:
            agent.close()


def one_write(sender, peer: str, rid: str, attempt: int, local_ids: tuple, remote_ids: tuple,  # noqa: ANN001
              checksum_of: torch.Tensor | None = None) -> float:
    """Seconds from start() to DONE (spinning on poll); raises on any other end or after the timeout.
    `checksum_of`: the KV cache, checksummed into the payload first (as the prefill engine does, timed)."""
    t0 = time.perf_counter()
    sums = None if checksum_of is None else tuple(block_checksums(checksum_of, local_ids))
    plan = TransferPlan.create(rid, local_ids, remote_ids, now=time.monotonic(), timeout_s=TRANSFER_TIMEOUT_S,
                               attempt=attempt, payload=HandoffPayload(checksums=sums))
    transfer = sender.start(peer, plan)
    give_up = t0 + TRANSFER_TIMEOUT_S + 5
    while True:
        sender.poll()
        if transfer.state.is_terminal:
            break
        if time.perf_counter() > give_up:
            raise TimeoutError(f"{rid}: WRITE not terminal after {TRANSFER_TIMEOUT_S + 5} s")
    seconds = time.perf_counter() - t0
    if transfer.state is not TransferState.DONE:
        raise RuntimeError(f"{rid}: WRITE ended {transfer.state.value}: {transfer.reason}")
    return seconds
