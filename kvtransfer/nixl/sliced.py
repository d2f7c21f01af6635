"""A single-rank prefill worker's WRITE into a decode worker of TP size d > 1 (heterogeneous TP).

The prefill rank holds every KV head; decode rank j holds heads [j * H/d, (j+1) * H/d). So one
request's hand-off is d WRITEs of the same block ids, WRITE j carrying head range j of every block
into decode rank j's agent (`kvtransfer.heads.head_slices`). The WRITE into decode rank 0 is the
group's rank 0 transfer (`NixlTransfer(group=True)`: it sends the one DONE notice, or the ABORTED
one); the others never notify. The sender settles the group once every other WRITE is terminal, the
same way it settles a tensor-parallel worker's followers (`ShardOutcome` per destination rank).
Over NIXL a head range is strided within a block, so each WRITE has one descriptor per (layer, K/V,
token) row of every block, built per transfer (`head_slice_rows`): correct, but on a GPU a staging
copy into contiguous blocks would be cheaper for long prompts.

Checksums: the prefill engine, told the decode worker's TP size, checksums each block's head slice j
as decode rank j will hold it (engine.kv_integrity.head_slice_checksums), rank-major, which is the order
the decode worker's LandedVerifier checks its ranks in: every decode rank verifies what it received.
A gather (a prefill worker of TP size p > 1 feeding fewer decode ranks) is not built: the sender
refuses such a peer at the handshake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.heads import head_slices, total_kv_heads
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import TransferNotice
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.shards import ShardOutcome


@dataclasses.dataclass(frozen=True)
class SlicedWrite:
    """The WRITEs of one head-sliced hand-off: `primary` into decode rank 0 (tracked by the sender
    like any transfer), `others[j - 1]` into decode rank j."""

    primary: NixlTransfer
    notice: TransferNotice  # sent by `primary` once every WRITE landed
    others: tuple[tuple[int, NixlTransfer], ...]  # (decode rank, its WRITE)

    @classmethod
    def start(cls, agent: NixlAgent, peer: HandshakeInfo, plan: TransferPlan, notice: TransferNotice,
              faults: FaultInjector, clock: Callable[[], float]) -> SlicedWrite:
        """Prepare every WRITE (TransferSetupError, nothing posted, if one cannot be), then post them."""
        layout = peer.layout
        slices = head_slices(total_kv_heads(layout), 1, layout.tp_size)
        targets = (peer, *peer.ranks)
        local = block_indices(plan.local_block_ids, agent.num_blocks, "local")
        fail_last = faults.should_inject(Fault.FAIL_SHARD_TRANSFER)
        handles: list[tuple[int, str, object]] = []
        try:
            for part in slices:
                target = targets[part.dst_rank]
                remote = block_indices(plan.remote_block_ids, target.num_blocks, "remote")
                handles.append((part.dst_rank, target.agent_name,
                                agent.make_write(target.agent_name, local, remote, b"", heads=part)))
        except Exception:
            for _, _, handle in handles:
                agent.release(handle)
            raise
        (_, peer_name, first), rest = handles[0], handles[1:]
        primary = NixlTransfer(agent, peer_name, plan, first, faults, clock, group=True)
        if primary.post().is_terminal:  # failed at once: the other slices are never posted
            for _, _, handle in rest:
                agent.release(handle)
            return cls(primary, notice, ())
        others = []
        for rank, name, handle in rest:
            transfer = NixlTransfer(agent, name, plan, handle, _faults(fail_last and rank == len(slices) - 1),
                                    clock, announce=False)
            transfer.post()
            others.append((rank, transfer))
        return cls(primary, notice, tuple(others))

    def settle_if_done(self, settle: Callable[[NixlTransfer, TransferNotice, list[ShardOutcome]], object]) -> bool:
        """Poll the other WRITEs (one failing cancels the rest); once all are terminal, hand their
        outcomes to `settle` (the sender's group settlement) and return True."""
        states = [transfer.poll() for _, transfer in self.others]
        if any(s.is_terminal and s is not TransferState.DONE for s in states):
            self.cancel_others()
        if not all(transfer.state.is_terminal for _, transfer in self.others):
            return False
        if not self.primary.state.is_terminal:
            outcomes = [ShardOutcome(rank, t.state, t.reason) for rank, t in self.others]
            settle(self.primary, self.notice, outcomes)
        return True

    def cancel_others(self) -> None:
        for _, transfer in self.others:
            transfer.cancel()


def _faults(fail: bool) -> FaultInjector:
    faults = FaultInjector()
    if fail:
        faults.arm(Fault.FAIL_TRANSFER)  # the real failure path of a WRITE NIXL refuses
    return faults

