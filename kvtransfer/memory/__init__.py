"""In-memory KV transport for tests: the NIXL sender/receiver state machines over a `MemoryAgent`
that copies blocks between tensors of one process (no NIXL, no UCX). Open it through
`kvtransfer.transport.open_transport(TransportKind.MEMORY, ...)`."""

from kvtransfer.memory.agent import FABRIC, MemoryAgent, MemoryFabric

__all__ = ["FABRIC", "MemoryAgent", "MemoryFabric"]
