"""Moving KV blocks between workers.

base        the data: TransferState, TransferPlan, HandoffPayload, KVLayoutInfo/HandshakeInfo, LandedKV
roles       the interfaces: KVSender, KVReceiver, KVTransfer (one request's WRITE)
errors      typed errors (IncompatiblePeerError names the mismatching fields)
integrity   landed blocks verified against the sender's checksums (on the engine thread)
faults      fault injection (fail, stall, corrupt, drop notice) for the failure tests
transport   open_transport(kind) -> Transport: the one way to open a sender + receiver by name
nixl/       the NIXL implementation (imports `nixl` only when an agent is created)
memory/     the in-process fake for tests: the same sender/receiver over an agent that copies tensors
"""
