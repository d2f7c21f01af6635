"""`baton admin create-org | create-key | revoke-key`: operator commands on the gateway's database.

The async functions are the API (tests and a future admin HTTP route call them); the argparse
handlers are this command's main: the only place here that reads settings (`BATON_DATABASE_URL`,
overridable with `--database-url`). Wire into services/cli.py with `register_admin_commands(sub)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal

from pydantic import ValidationError

from scheduler.types import Tier
from services.common.errors import BatonError, InvalidRequestError, NotFoundError
from services.common.settings import TIERS, BatonSettings
from services.gateway.db.accounts import AccountStore, Organisation
from services.gateway.db.api_keys import ApiKeyRecord, ApiKeyStore
from services.gateway.db.pool import Database, DatabaseConfig
from services.gateway.tenancy.auth import ApiKeyAuthenticator, IssuedKey


async def create_org(db: Database, name: str, tier: Tier = Tier.FREE,
                     monthly_budget_usd: Decimal | None = None) -> Organisation:
    return await AccountStore(db).create_org(name, tier, monthly_budget_usd)


async def create_key(db: Database, org: str, *, user_email: str | None = None, name: str | None = None,
                     rpm_limit: int | None = None, tpm_limit: int | None = None) -> IssuedKey:
    """A new key for the organisation `org` (name or id); `user_email` attaches it to that user."""
    accounts = AccountStore(db)
    organisation = await accounts.find_org(org)
    user_id = None
    if user_email is not None:
        user_id = (await accounts.ensure_user(organisation.id, user_email)).id
    return await ApiKeyAuthenticator(ApiKeyStore(db)).issue(
        organisation.id, user_id=user_id, name=name, rpm_limit=rpm_limit, tpm_limit=tpm_limit)


async def revoke_key(db: Database, key_ref: str) -> ApiKeyRecord:
    """Revoke by key id, or by display prefix (`bt-AbCd1234`) when it names exactly one key."""
    store = ApiKeyStore(db)
    try:
        return await store.revoke(uuid.UUID(key_ref))
    except ValueError:
        pass
    matches = await store.find_by_prefix(key_ref)
    if not matches:
        raise NotFoundError(f"no API key with id or prefix {key_ref!r}")
    if len(matches) > 1:
        ids = ", ".join(str(m.id) for m in matches)
        raise InvalidRequestError(f"prefix {key_ref!r} matches {len(matches)} keys ({ids}); give the id")
    return await store.revoke(matches[0].id)


def register_admin_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `admin` with its subcommands to the `baton` parser's subparsers."""
    admin = subparsers.add_parser("admin", help="organisations and API keys (operator)")
    admin.add_argument("--database-url", default=None, help="default: $BATON_DATABASE_URL")
    admin.add_argument("--json", action="store_true", help="print one JSON object")
    sub = admin.add_subparsers(dest="admin_command", required=True)

    p = sub.add_parser("create-org", help="create an organisation")
    p.add_argument("name")
    p.add_argument("--tier", default="free", choices=list(TIERS))
    p.add_argument("--monthly-budget-usd", type=Decimal, default=None)
    p.set_defaults(func=_handler(_cmd_create_org))

    p = sub.add_parser("create-key", help="create an API key (printed once)")
    p.add_argument("--org", required=True, help="organisation name or id")
    p.add_argument("--user-email", default=None)
    p.add_argument("--name", default=None, help="a label for listings")
    p.add_argument("--rpm", type=int, default=None, help="requests/minute (default: the tier's)")
    p.add_argument("--tpm", type=int, default=None, help="tokens/minute (default: the tier's)")
    p.set_defaults(func=_handler(_cmd_create_key))

    p = sub.add_parser("revoke-key", help="revoke an API key by id or display prefix")
    p.add_argument("key", help="key id or prefix such as bt-AbCd1234")
    p.set_defaults(func=_handler(_cmd_revoke_key))


Command = Callable[[Database, argparse.Namespace], Awaitable[dict[str, object]]]


def _handler(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            config = DatabaseConfig.from_settings(BatonSettings(), url=args.database_url)
            result = asyncio.run(_with_db(DatabaseConfig(config.url, min_size=1, max_size=2), command, args))
        except BatonError as e:
            print(f"baton: error: {e}", file=sys.stderr)
            return 2
        except ValidationError as e:
            print(f"baton: error: invalid BATON_* settings: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(result, default=str))
        else:
            for key, value in result.items():
                print(f"{key}: {value}")
        return 0
    return run


async def _with_db(config: DatabaseConfig, command: Command, args: argparse.Namespace) -> dict[str, object]:
    async with Database(config) as db:
        return await command(db, args)


async def _cmd_create_org(db: Database, args: argparse.Namespace) -> dict[str, object]:
    org = await create_org(db, args.name, args.tier, args.monthly_budget_usd)
    return {"id": org.id, "name": org.name, "tier": org.tier, "monthly_budget_usd": org.monthly_budget_usd}


async def _cmd_create_key(db: Database, args: argparse.Namespace) -> dict[str, object]:
    issued = await create_key(db, args.org, user_email=args.user_email, name=args.name,
                              rpm_limit=args.rpm, tpm_limit=args.tpm)
    return {"id": issued.record.id, "key": issued.key, "prefix": issued.record.prefix,
            "note": "the key is shown only once: store it now"}


async def _cmd_revoke_key(db: Database, args: argparse.Namespace) -> dict[str, object]:
    record = await revoke_key(db, args.key)
    return {"id": record.id, "prefix": record.prefix, "revoked_at": record.revoked_at}
