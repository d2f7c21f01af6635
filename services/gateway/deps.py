"""`GatewayDeps`: every long-lived object the routes use, and the typed FastAPI dependencies on them.

main (or a test) builds the clients from configuration and passes them in: the tokenizer, the router,
the safety gate and `TenantServices` (API keys, rate limits, budgets, usage, conversations -- or the
anonymous stand-ins of `BATON_AUTH_MODE=none`, see tenancy.py); `GatewayDeps` derives the prompt
builder, the runner and the completion service from them. The app's lifespan calls `start()` and
`close()`. Routes never build any of this: they declare `Annotated` dependencies such as
`CurrentPrincipal` (the caller, authenticated from `Authorization: Bearer`), `Conversations` (the
store; 501 when disabled) or `Completions` (the completion service).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.gateway.completions.catalog import ModelCatalog, ModelRuntime
from services.gateway.completions.generation import WorkerClient
from services.gateway.completions.migration import MigrationPolicy
from services.gateway.completions.prompt import PromptBuilder
from services.gateway.completions.responses import ResponsesService
from services.gateway.completions.runner import CompletionRunner
from services.gateway.completions.safety_gate import SafetyGate
from services.gateway.completions.service import CompletionService
from services.gateway.config import GatewayConfig, ServedModel
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing.router_client import RouterClient
from services.gateway.streams.relay import LocalOnly, StreamRelay
from services.gateway.streams.replay_log import StreamHub
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.backends import TenantServices, UsageReports
from tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.gateway.db.conversations import ConversationStore


@dataclass
class GatewayDeps:
    config: GatewayConfig
    tokenizer: Tokenizer
    router: RouterClient
    tenancy: TenantServices
    safety: SafetyGate | None = None
    workers: WorkerClient = field(default_factory=WorkerClient)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    stream_redis_url: str | None = None  # streams shared by replicas through this Redis (None: local only)
    extra_tokenizers: Mapping[str, Tokenizer] = field(default_factory=dict)  # config.extra_models' by name

    def __post_init__(self) -> None:
        self.streams = StreamHub(self.config.stream)
        self.relay = build_relay(self.streams, self.stream_redis_url)
        self.prompts = self._prompt_builder(self.tokenizer, self.config.model)  # the default model's
        self.models = ModelCatalog([ModelRuntime.of(self.prompts), *(
            ModelRuntime.of(self._prompt_builder(self.extra_tokenizers[m.name], m)) for m in self.config.extra_models)])
        t = self.tenancy
        self.runner = CompletionRunner(self.workers, self.router, self.safety, t.usage, t.admission,
                                       t.conversations, self.metrics, self.config.slos,
                                       MigrationPolicy(self.tokenizer, self.config.max_migrations))
        self.completions = CompletionService(self.config, self.models, self.runner, t, self.streams, self.relay)
        self.responses = ResponsesService(self.completions)
        if t.metrics is not None:
            self.metrics.register_extra(t.metrics)
        self.draining = False

    def _prompt_builder(self, tokenizer: Tokenizer, model: ServedModel) -> PromptBuilder:
        return PromptBuilder(tokenizer, model, self.config.block_size, self.config.default_max_tokens)

    async def start(self) -> None:
        await self.tenancy.start()
        await self.relay.start()
        await self.router.start()

    async def close(self, stream_grace_s: float = 1.0) -> None:
        """Abort what still runs (after the server's own drain), bill it, close every client.

        uvicorn has already given running streams `drain_timeout_s` before the lifespan ends, so only
        a short grace is left here."""
        self.draining = True
        await self.completions.close(stream_grace_s)
        await self.relay.close()
        await self.router.close()
        await self.workers.close()
        if self.safety is not None:
            await self.safety.close()
        await self.tenancy.close()


def get_deps(request: Request) -> GatewayDeps:
    deps: GatewayDeps = request.app.state.deps
    return deps


Deps = Annotated[GatewayDeps, Depends(get_deps)]
_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer bt-...`")


async def current_principal(deps: Deps, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                               Depends(_bearer)]) -> Principal:
    return await deps.tenancy.authenticator.authenticate_bearer(
        None if credentials is None else credentials.credentials)


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]


def usage_reports(deps: Deps) -> UsageReports:
    return deps.tenancy.usage_report_source()


Reports = Annotated[UsageReports, Depends(usage_reports)]


def completion_service(deps: Deps) -> CompletionService:
    return deps.completions


Completions = Annotated[CompletionService, Depends(completion_service)]


def responses_service(deps: Deps) -> ResponsesService:
    return deps.responses


Responses = Annotated[ResponsesService, Depends(responses_service)]


def conversation_store(deps: Deps) -> ConversationStore:
    return deps.tenancy.conversation_store()


Conversations = Annotated["ConversationStore", Depends(conversation_store)]


def build_relay(hub: StreamHub, redis_url: str | None) -> StreamRelay:
    if not redis_url:
        return LocalOnly(hub.config)
    from services.gateway.streams.redis_relay import RedisRelay  # imports redis: only when there is one

    return RedisRelay(hub, redis_url)
