"""A worker taking the role the scheduler asks for (prefill <-> decode <-> both) without restarting.

The scheduler drains the worker first (scheduler/core/role_switch.py) and only then answers its
heartbeats with `switch_to_role`; `RoleSwitcher.apply` is called with that answer. It switches only
when the worker is idle here too (no Generate flow, no Prefill job): a request the scheduler did
not place (a gateway routing on its own while the scheduler was away) must not be dropped, so a
busy worker refuses and the next heartbeat answer asks again.

What a switch does: the role's services are rebuilt on the same engine (the KV cache and its prefix
cache stay), the KV link is created if the worker started as `both` and needs one now, and the
servicer starts answering for the new role; every later status and heartbeat reports the new role.
A decode worker's configured prefill peers are remembered across switches.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.worker.config import WorkerConfig, WorkerRole

log = logging.getLogger(__name__)


class RoleHost(Protocol):
    """What a role switch needs of its worker (services/worker/server.py's `WorkerServer`)."""

    config: WorkerConfig  # its role and prefill peers; replaced by `rebuild_role_services`
    worker_id: str

    def is_idle(self) -> bool:
        """No Generate flow and no Prefill job here."""
        ...

    async def rebuild_role_services(self, role: WorkerRole, prefill_peers: tuple[str, ...]) -> None:
        """Serve `role` from now on, on the same engine; called only when `is_idle()`."""
        ...


class RoleSwitcher:
    def __init__(self, server: RoleHost) -> None:
        self._server = server
        self._prefill_peers = server.config.prefill_peers  # kept for a later switch back to decode
        self.switches = 0

    async def apply(self, role_name: str) -> bool:
        """Take `role_name` if it is new and the worker is idle; True when the role changed."""
        try:
            role = WorkerRole(role_name)
        except ValueError:
            log.error("scheduler asked for unknown role %r; valid: %s", role_name, [r.value for r in WorkerRole])
            return False
        server = self._server
        if role is server.config.role:
            return False
        if role is not WorkerRole.BOTH and server.config.expert_parallel_size > 1:
            log.error("scheduler asked for role %s; an expert-parallel worker serves role both only", role.value)
            return False
        if not server.is_idle():
            log.warning("role switch to %s deferred: work in flight (the scheduler asks again)", role.value)
            return False
        peers = self._prefill_peers if role is WorkerRole.DECODE else ()
        previous = server.config.role
        await server.rebuild_role_services(role, peers)
        self.switches += 1
        log.warning("worker %s switched role %s -> %s", server.worker_id, previous.value, role.value)
        return True
