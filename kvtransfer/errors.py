"""Typed kvtransfer errors. The worker maps them to gRPC status codes at the RPC edge."""


class KVTransferError(Exception):
    """Base class of every error kvtransfer raises on purpose."""


class IncompatiblePeerError(KVTransferError):
    """Two workers' KV layouts (or wire protocol versions) cannot exchange blocks.

    The message names every mismatching field with both values, e.g.
    ``block_size: local=16 peer=32``.
    """

    def __init__(self, peer: str, mismatches: list[tuple[str, object, object]]) -> None:
        self.peer = peer
        self.mismatches = mismatches
        details = "; ".join(f"{name}: local={mine!r} peer={theirs!r}" for name, mine, theirs in mismatches)
        super().__init__(f"KV peer {peer!r} is incompatible: {details}")


class UnknownPeerError(KVTransferError, KeyError):
    """A transfer names a peer that was never added (or was removed)."""


class PeerBusyError(KVTransferError):
    """A peer cannot be removed while transfers to it are still in flight."""


class InvalidTransferPlanError(KVTransferError, ValueError):
    """A transfer plan is malformed: empty, mismatched lengths, duplicate or out-of-range block ids."""


class TransferSetupError(KVTransferError):
    """NIXL refused to create a transfer (nothing was posted; no block was touched)."""


class MalformedNotificationError(KVTransferError, ValueError):
    """A NIXL notification is not one of ours (wrong magic, bad JSON, missing fields)."""


class NixlUnavailableError(KVTransferError, ImportError):
    """The `nixl` package cannot be imported (not installed, or its native libraries are missing)."""
