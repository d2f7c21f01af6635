"""Moving KV blocks between workers.

base        the contract: TransferState, TransferPlan, KVLayoutInfo/HandshakeInfo, KVSender/KVReceiver
errors      typed errors (IncompatiblePeerError names the mismatching fields)
integrity   per-block checksums computed where the KV cache lives
faults      fault injection (fail, stall, corrupt, drop notice) for the failure tests
nixl/       the NIXL implementation (imports `nixl` only when an agent is created)
"""
