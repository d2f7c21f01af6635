"""API keys: issued once, stored only as SHA-256, looked up by hash, refused once revoked."""

from __future__ import annotations

import argparse
import hashlib
import json
import uuid
from decimal import Decimal

import psycopg
import pytest

from services.common.errors import AuthenticationError, NotFoundError, RevokedKeyError
from services.gateway.db.api_keys import ApiKeyStore
from services.gateway.db.pool import Database
from services.gateway.tenancy.admin import create_key, create_org, register_admin_commands, revoke_key
from services.gateway.tenancy.auth import ApiKeyAuthenticator, key_from_authorization


def _org_name() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


async def test_issued_key_authenticates_as_its_org_and_user(db: Database) -> None:
    org = await create_org(db, _org_name(), "plus", Decimal("50"))
    issued = await create_key(db, org.name, user_email="ada@example.com", rpm_limit=7)
    principal = await ApiKeyAuthenticator(ApiKeyStore(db)).authenticate(issued.key)
    assert (principal.org_id, principal.key_id, principal.tier) == (org.id, issued.record.id, "plus")
    assert principal.user_id is not None
    assert (principal.key_rpm_limit, principal.key_tpm_limit) == (7, None)
    assert issued.key.startswith("bt-") and len(issued.key) == 46
    assert issued.record.prefix == issued.key[:11]


async def test_plain_key_is_not_stored_only_its_sha256(db: Database, database_url: str) -> None:
    org = await create_org(db, _org_name())
    issued = await create_key(db, org.name)
    with psycopg.connect(database_url) as conn:
        dump = "\n".join(str(row) for table in ("organisations", "users", "api_keys")
                         for row in conn.execute(f"SELECT * FROM {table}"))  # noqa: S608
        stored_hash = conn.execute("SELECT key_hash FROM api_keys WHERE id = %s",
                                   (issued.record.id,)).fetchone()
    secret_part = issued.key[len(issued.record.prefix):]
    assert issued.key not in dump and secret_part not in dump
    assert stored_hash is not None and bytes(stored_hash[0]) == hashlib.sha256(issued.key.encode()).digest()


async def test_revoked_key_is_refused(db: Database) -> None:
    org = await create_org(db, _org_name())
    issued = await create_key(db, org.name)
    auth = ApiKeyAuthenticator(ApiKeyStore(db))
    await auth.authenticate(issued.key)
    await revoke_key(db, str(issued.record.id))
    with pytest.raises(RevokedKeyError):
        await auth.authenticate(issued.key)


async def test_revoke_by_display_prefix(db: Database) -> None:
    org = await create_org(db, _org_name())
    issued = await create_key(db, org.name)
    record = await revoke_key(db, issued.record.prefix)
    assert record.id == issued.record.id and record.revoked_at is not None


@pytest.mark.parametrize("presented", ["bt-" + "A" * 43, "sk-not-ours", "bt-short", ""])
async def test_unknown_or_malformed_key_is_refused(db: Database, presented: str) -> None:
    with pytest.raises(AuthenticationError):
        await ApiKeyAuthenticator(ApiKeyStore(db)).authenticate(presented)


def test_bearer_header_parsing() -> None:
    assert key_from_authorization("Bearer bt-abc") == "bt-abc"
    for bad in (None, "", "Basic xyz", "Bearer "):
        with pytest.raises(AuthenticationError):
            key_from_authorization(bad)


async def test_key_for_unknown_org_is_not_found(db: Database) -> None:
    with pytest.raises(NotFoundError):
        await create_key(db, "no-such-org")


def _admin(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """Run `baton admin ...` in-process; the JSON output on success, {"error": stderr} on failure."""
    parser = argparse.ArgumentParser(prog="baton")
    register_admin_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else {"error": captured.err}


def test_admin_cli_create_org_key_and_revoke(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["admin", "--database-url", database_url, "--json"]
    code, org = _admin([*base, "create-org", "acme-cli", "--tier", "enterprise"], capsys)
    assert code == 0 and org["tier"] == "enterprise"
    code, key = _admin([*base, "create-key", "--org", "acme-cli", "--rpm", "5"], capsys)
    assert code == 0 and key["key"].startswith(key["prefix"])
    code, revoked = _admin([*base, "revoke-key", key["prefix"]], capsys)
    assert code == 0 and revoked["id"] == key["id"] and revoked["revoked_at"]
    code, failed = _admin([*base, "create-org", "acme-cli"], capsys)  # duplicate: a clear error, exit 2
    assert code == 2 and "already exists" in failed["error"]
