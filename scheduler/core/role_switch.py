"""Turning a worker prefill <-> decode <-> both, draining it first (as SGLang and Dynamo do).

    set_role -> DRAINING: the worker leaves the routing view at once (no new placements), the
                work already there finishes
             -> SWITCHING: a heartbeat shows it idle (nothing running, queued or prefilling) and
                the scheduler holds no placement on it; from now on every heartbeat answer tells
                the worker its new role (`pending`), until
             -> DONE: a heartbeat (or a re-registration) reports the new role; it is routable again.

Why drain through the scheduler rather than the worker: the scheduler is what keeps sending work,
so it must stop first; and a worker that switched with sequences in flight would drop them (a
prefill worker has no decode batch to finish them in). A worker that dies while switching is
forgotten with the switch. Pure: the scheduler core calls it with `now` and snapshots.
"""

from __future__ import annotations

from collections.abc import KeysView

from scheduler.types import RoleSwitch, SwitchState, WorkerRole, WorkerSnapshot


class RoleSwitches:
    def __init__(self) -> None:
        self._switches: dict[str, RoleSwitch] = {}

    def worker_ids(self) -> KeysView[str]:
        """The workers being switched (a live view: membership tests need no call per worker)."""
        return self._switches.keys()

    def start(self, snapshot: WorkerSnapshot, role: WorkerRole) -> RoleSwitch:
        """Begin (or retarget) a switch; DONE at once when the worker already has `role`."""
        if snapshot.role is role:
            self._switches.pop(snapshot.worker_id, None)
            return RoleSwitch(snapshot.worker_id, role, role, SwitchState.DONE)
        switch = RoleSwitch(snapshot.worker_id, snapshot.role, role, SwitchState.DRAINING)
        self._switches[snapshot.worker_id] = switch
        return switch

    def get(self, worker_id: str) -> RoleSwitch | None:
        return self._switches.get(worker_id)

    def pending(self, worker_id: str) -> WorkerRole | None:
        """The role to tell the worker in its heartbeat answer, once it is drained."""
        switch = self._switches.get(worker_id)
        return switch.to_role if switch is not None and switch.state is SwitchState.SWITCHING else None

    def observe(self, snapshot: WorkerSnapshot, holds_work: bool) -> RoleSwitch | None:
        """A heartbeat (or registration) from the worker; returns the switch if it moved to DONE.
        `holds_work`: the scheduler still counts placements on it (routed, not finished)."""
        switch = self._switches.get(snapshot.worker_id)
        if switch is None:
            return None
        if snapshot.role is switch.to_role:
            del self._switches[snapshot.worker_id]
            return RoleSwitch(switch.worker_id, switch.from_role, switch.to_role, SwitchState.DONE)
        if switch.state is SwitchState.DRAINING and not holds_work and _idle(snapshot):
            self._switches[snapshot.worker_id] = RoleSwitch(
                switch.worker_id, switch.from_role, switch.to_role, SwitchState.SWITCHING
            )
        return None

    def forget(self, worker_id: str) -> None:
        self._switches.pop(worker_id, None)

    def all(self) -> list[RoleSwitch]:
        return sorted(self._switches.values(), key=lambda s: s.worker_id)


def _idle(snapshot: WorkerSnapshot) -> bool:
    return snapshot.running_seqs == 0 and snapshot.queue_depth == 0 and snapshot.inflight_prefill_tokens == 0
