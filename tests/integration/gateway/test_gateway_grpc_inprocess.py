"""The gRPC API's server in this process, on the gateway's real clients in open mode (no Postgres, Redis
or Kafka): a decode worker that is gone ends the call UNAVAILABLE, the health check answers, and a
port another server holds stops the start instead of being shared."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import api_pb2 as pb
from rpcgen.baton.v1 import api_pb2_grpc as pb_grpc
from services.billing.pricing import PriceTable
from services.common.errors import ConfigError
from services.common.settings import BatonSettings
from services.gateway.config import GatewayConfig, ServedModel
from services.gateway.deps import GatewayDeps
from services.gateway.grpc_api.server import SERVICE_NAME, GrpcApiConfig, GrpcApiServer
from services.gateway.routing.last_view import StaticWorkers
from services.gateway.routing.router_client import RouterClient
from services.gateway.tenancy.backends import build_open_tenancy
from services.launcher.process import free_port
from tests.support.gateway_stack import MODEL
from tokenization.tokenizer import Tokenizer


@pytest.fixture
async def server(default_model_dir: Path) -> AsyncIterator[GrpcApiServer]:
    """A gateway's gRPC API whose only decode worker listens nowhere."""
    model = ServedModel.from_dir(default_model_dir, MODEL, 2048, PriceTable.from_settings(BatonSettings()))
    deps = GatewayDeps(GatewayConfig(model), Tokenizer.from_dir(default_model_dir),
                       RouterClient(None, StaticWorkers((f"127.0.0.1:{free_port()}",))), build_open_tenancy("free"))
    await deps.start()
    api = GrpcApiServer(deps, GrpcApiConfig("127.0.0.1", 0))
    await api.start()
    yield api
    await api.stop(1.0)
    await deps.close()


async def test_a_dead_worker_ends_the_call_unavailable(server: GrpcApiServer) -> None:
    request = pb.ChatRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content="hi")],
                             sampling=pb.SamplingOptions(max_tokens=4))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.BatonApiStub(channel).Chat(request, timeout=60)  # open mode: no key needed
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for chunk in call:
                received.append(chunk)
        metadata = dict(failed.value.trailing_metadata() or ())
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "unavailable" in (failed.value.details() or "")
    assert metadata["baton-error-code"] == "upstream_error"
    assert received and received[-1].HasField("usage")  # the usage came before the status
    assert server.deps.completions.active_streams == 0


async def test_the_health_check_answers_serving(server: GrpcApiServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                                timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_taken_port_is_a_config_error(server: GrpcApiServer) -> None:
    with pytest.raises(ConfigError, match="cannot listen"):
        await GrpcApiServer(server.deps, GrpcApiConfig("127.0.0.1", server.port or 0)).start()
