"""`GatewayDeps`: every long-lived object the routes use, and the typed FastAPI dependencies on them.

main (or a test) builds the clients from configuration and passes them in; `GatewayDeps` derives the
stores, the rate limiter and the services from them. The app's lifespan calls `start()` and
`close()`. Routes never build any of this: they declare `Annotated` dependencies such as
`CurrentPrincipal` (the caller, authenticated from `Authorization: Bearer`), `DbConn` (a pooled
connection, one transaction) or `Completions` (the completion service).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import psycopg
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis

from engine.tokenizer import Tokenizer
from services.common.errors import AuthenticationError
from services.gateway.auth import ApiKeyAuthenticator, Principal
from services.gateway.budget import BudgetGuard
from services.gateway.config import GatewayConfig
from services.gateway.db.api_keys import ApiKeyStore
from services.gateway.db.conversations import ConversationStore
from services.gateway.db.pool import Database
from services.gateway.generation import WorkerClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt import PromptBuilder
from services.gateway.ratelimit import RateLimitConfig, RateLimiter
from services.gateway.routing import RouterClient
from services.gateway.runner import CompletionRunner, UsageSink
from services.gateway.safety_gate import SafetyGate
from services.gateway.service import CompletionService
from services.gateway.streams import StreamHub


@dataclass
class GatewayDeps:
    config: GatewayConfig
    db: Database
    redis: Redis
    tokenizer: Tokenizer
    router: RouterClient
    usage: UsageSink
    rate_limits: RateLimitConfig
    safety: SafetyGate | None = None
    workers: WorkerClient = field(default_factory=WorkerClient)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)

    def __post_init__(self) -> None:
        self.streams = StreamHub(self.config.stream)
        self.authenticator = ApiKeyAuthenticator(ApiKeyStore(self.db))
        self.conversations = ConversationStore(self.db)
        self.rate_limiter = RateLimiter(self.redis, self.rate_limits)
        self.budget = BudgetGuard(self.db)
        self.prompts = PromptBuilder(self.tokenizer, self.config.model, self.config.block_size,
                                     self.config.default_max_tokens)
        self.runner = CompletionRunner(self.workers, self.router, self.safety, self.usage, self.rate_limiter,
                                       self.conversations, self.metrics, self.config.slos)
        self.completions = CompletionService(self.config, self.prompts, self.runner, self.rate_limiter,
                                             self.budget, self.conversations, self.streams)
        self.draining = False

    async def start(self) -> None:
        await self.db.open()
        start = getattr(self.usage, "start", None)
        if start is not None:
            start()

    async def close(self, stream_grace_s: float = 1.0) -> None:
        """Abort what still runs (after the server's own drain), bill it, close every client.

        uvicorn has already given running streams `drain_timeout_s` before the lifespan ends, so only
        a short grace is left here."""
        self.draining = True
        await self.completions.close(stream_grace_s)
        await self.router.close()
        await self.workers.close()
        if self.safety is not None:
            await self.safety.close()
        close_usage = getattr(self.usage, "close", None)
        if close_usage is not None:
            await asyncio.to_thread(close_usage)
        await self.redis.aclose()
        await self.db.close()


def get_deps(request: Request) -> GatewayDeps:
    deps: GatewayDeps = request.app.state.deps
    return deps


Deps = Annotated[GatewayDeps, Depends(get_deps)]
_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer bt-...`")


async def current_principal(deps: Deps, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                               Depends(_bearer)]) -> Principal:
    if credentials is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer bt-...'")
    return await deps.authenticator.authenticate(credentials.credentials)


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]


async def db_connection(deps: Deps) -> AsyncIterator[psycopg.AsyncConnection]:
    async with deps.db.connection() as conn:
        yield conn


DbConn = Annotated[psycopg.AsyncConnection, Depends(db_connection)]


def completion_service(deps: Deps) -> CompletionService:
    return deps.completions


Completions = Annotated[CompletionService, Depends(completion_service)]


def conversation_store(deps: Deps) -> ConversationStore:
    return deps.conversations


Conversations = Annotated[ConversationStore, Depends(conversation_store)]
