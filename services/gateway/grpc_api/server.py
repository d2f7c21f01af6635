"""`GrpcApiServer`: the gRPC API's server inside the gateway process, started and stopped by the app's
lifespan (after the gateway's clients are up, before they close), on the gateway's event loop.

TLS is optional: with a certificate chain and its private key (PEM files, `BATON_GRPC_TLS_CERT` and
`BATON_GRPC_TLS_KEY`) the port speaks TLS only; without them it is plaintext (for a private network, or
behind a mesh that adds mTLS). The port also answers the standard gRPC health check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import api_pb2_grpc as pb_grpc
from services.common.errors import ConfigError
from services.common.tracing import TraceContextServerInterceptor
from services.gateway.deps import GatewayDeps
from services.gateway.grpc_api.servicer import BatonApiServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "baton.v1.BatonApi"


@dataclass(frozen=True)
class GrpcApiConfig:
    host: str
    port: int  # 0: any free port (see GrpcApiServer.port once started)
    tls: tuple[bytes, bytes] | None = None  # (PEM private key, PEM certificate chain); None: plaintext
    shared_port: bool = False  # True: one of several gateway processes binding this port (replicas.py)

    @classmethod
    def from_paths(cls, host: str, port: int, cert: str | None, key: str | None) -> GrpcApiConfig:
        """Reads the TLS files now, so a bad path stops the gateway before it starts."""
        if (cert is None) != (key is None):
            raise ConfigError("BATON_GRPC_TLS_CERT and BATON_GRPC_TLS_KEY go together: set both or neither")
        if cert is None or key is None:
            return cls(host, port)
        return cls(host, port, (_read(key, "BATON_GRPC_TLS_KEY"), _read(cert, "BATON_GRPC_TLS_CERT")))

    def credentials(self) -> grpc.ServerCredentials | None:
        return None if self.tls is None else grpc.ssl_server_credentials([self.tls])


class GrpcApiServer:
    def __init__(self, deps: GatewayDeps, config: GrpcApiConfig) -> None:
        self.deps = deps
        self.config = config
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        credentials = self.config.credentials()
        server = grpc.aio.server(interceptors=[TraceContextServerInterceptor()], options=[
            ("grpc.max_receive_message_length", self.deps.config.max_request_bytes),
            # A taken port is an error, not a second server sharing it, unless the port is meant to be
            # shared by the gateway's own processes (SO_REUSEPORT, as their HTTP port).
            ("grpc.so_reuseport", int(self.config.shared_port))])
        pb_grpc.add_BatonApiServicer_to_server(BatonApiServicer(self.deps), server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            port = server.add_insecure_port(address) if credentials is None \
                else server.add_secure_port(address, credentials)
        except RuntimeError as e:
            raise ConfigError(f"the gRPC API cannot listen on {address}: {e}") from e
        await server.start()
        for name in ("", SERVICE_NAME):
            await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        log.info("gRPC API on %s:%d (%s)", self.config.host, port, "TLS" if credentials else "plaintext")

    async def stop(self, grace_s: float) -> None:
        """No new calls; running ones get `grace_s` to finish, then are cancelled (aborted and billed)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{setting}={path}: {e}") from e
