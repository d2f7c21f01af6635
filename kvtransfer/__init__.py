"""Moving KV blocks between workers.

base        the contract: TransferState, TransferPlan, KVLayoutInfo/HandshakeInfo, KVSender/KVReceiver
errors      typed errors (IncompatiblePeerError names the mismatching fields)
integrity   per-block checksums computed where the KV cache lives
faults      fault injection (fail, stall, corrupt, drop notice) for the failure tests
transport   open_transport(kind) -> Transport: the one way to open a sender + receiver by name
nixl/       the NIXL implementation (imports `nixl` only when an agent is created)
memory/     the in-process fake for tests: the same sender/receiver over an agent that copies tensors
"""
