"""NIXL implementation of the KV hand-off. Importing this package does not import `nixl`;
creating a `NixlAgent` does (raising NixlUnavailableError if it cannot)."""

from kvtransfer.nixl.agent import NixlAgent, NixlAgentConfig, nixl_available
from kvtransfer.nixl.receiver import NixlKVReceiver, ReceiverConfig
from kvtransfer.nixl.sender import NixlKVSender, SenderConfig

__all__ = [
    "NixlAgent",
    "NixlAgentConfig",
    "NixlKVReceiver",
    "NixlKVSender",
    "ReceiverConfig",
    "SenderConfig",
    "nixl_available",
]
