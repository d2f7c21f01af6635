"""`BATON_AUTH_MODE=none`'s tenant services: one anonymous principal, no limits, storage disabled."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.gateway.errors import FeatureDisabledError, baton_error_response
from services.gateway.tenancy.backends import ANONYMOUS_ORG_ID, build_open_tenancy

ROOT = Path(__file__).resolve().parents[3]


def test_every_caller_is_the_anonymous_org_at_the_configured_tier() -> None:
    auth = build_open_tenancy("plus").authenticator
    with_key = asyncio.run(auth.authenticate_bearer("anything"))
    without = asyncio.run(auth.authenticate_bearer(None))
    assert with_key == without
    assert (with_key.org_id, with_key.tier) == (ANONYMOUS_ORG_ID, "plus")


def test_admission_never_refuses_and_sends_no_rate_limit_headers() -> None:
    tenancy = build_open_tenancy("enterprise")
    principal = asyncio.run(tenancy.authenticator.authenticate_bearer(None))
    lease = asyncio.run(tenancy.admission.acquire(principal, 10**9))
    asyncio.run(tenancy.admission.reconcile(lease, 5))
    assert lease.headers() == {}


def test_conversation_storage_is_a_501_that_clients_should_not_retry() -> None:
    with pytest.raises(FeatureDisabledError) as info:
        build_open_tenancy("enterprise").conversation_store()
    response = baton_error_response(info.value)
    assert response.status_code == 501
    assert response.headers["x-should-retry"] == "false"
    assert b'"feature_disabled"' in response.body


def test_the_gateway_builds_without_database_redis_or_kafka_clients(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import builtins
        real = builtins.__import__
        def refuse(name, *args, **kwargs):
            if name.split(".")[0] in ("psycopg", "psycopg_pool", "redis", "confluent_kafka"):
                raise ImportError(f"{name} must not be needed in auth_mode=none")
            return real(name, *args, **kwargs)
        builtins.__import__ = refuse
        from services.gateway.__main__ import build_tenancy
        from services.gateway.app import create_app
        from services.common.settings import BatonSettings
        from services.gateway.settings import GatewaySettings
        print(build_tenancy(GatewaySettings(auth_mode="none"), BatonSettings()).mode)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "none"
