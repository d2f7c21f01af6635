"""The in-process "network" of the memory transport: memory agents find each other by agent name.

One process-wide fabric (`FABRIC`) is what `open_transport("memory", ...)` registers its agents on,
so that a prefill worker's and a decode worker's links built independently in one test process can
reach each other exactly as NIXL agents do: by the name in the peer's handshake.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvtransfer.errors import KVTransferError, UnknownPeerError

if TYPE_CHECKING:
    from kvtransfer.memory.agent import MemoryAgent


class MemoryFabric:
    """Agent name -> live memory agent. Thread-safe: each worker's link thread looks its peers up."""

    def __init__(self) -> None:
        self._agents: dict[str, MemoryAgent] = {}
        self._lock = threading.Lock()

    def register(self, agent: MemoryAgent) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise KVTransferError(f"a memory agent named {agent.name!r} is already registered")
            self._agents[agent.name] = agent

    def unregister(self, name: str) -> None:
        with self._lock:
            self._agents.pop(name, None)

    def lookup(self, name: str) -> MemoryAgent:
        """The live agent called `name`; UnknownPeerError once it closed (a dead peer)."""
        with self._lock:
            agent = self._agents.get(name)
        if agent is None:
            raise UnknownPeerError(f"no memory agent {name!r} on this fabric (closed, or never opened)")
        return agent

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._agents)


FABRIC = MemoryFabric()
