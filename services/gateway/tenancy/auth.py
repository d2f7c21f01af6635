"""API keys: `bt-` + 32 random bytes (urlsafe base64), shown once, stored only as SHA-256.

Why a plain SHA-256 and not a slow password hash: the key carries 256 bits of randomness, so
brute-forcing a leaked hash is hopeless without key stretching, and a fast hash lets every request be
authenticated with one indexed lookup (`api_keys.key_hash` is UNIQUE). The display prefix (`bt-` + 8
characters) is not secret: it lets a person tell keys apart in listings and `baton admin revoke-key`.

Revoked keys are refused on the next request: lookups are not cached, so there is no window.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.types import Tier
from services.common.errors import AuthenticationError, RevokedKeyError

if TYPE_CHECKING:  # API keys live in Postgres; BATON_AUTH_MODE=none runs without psycopg
    from services.gateway.db.api_keys import ApiKeyRecord, ApiKeyStore

KEY_PREFIX = "bt-"
_RANDOM_BYTES = 32
_DISPLAY_CHARS = 8
# token_urlsafe(32) is 43 characters of the base64url alphabet (no padding).
_KEY_RE = re.compile(r"^bt-[A-Za-z0-9_-]{43}$")


def generate_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def display_prefix(key: str) -> str:
    return key[: len(KEY_PREFIX) + _DISPLAY_CHARS]


def key_from_authorization(header: str | None) -> str:
    """The key in an `Authorization: Bearer bt-...` header; a missing or other scheme is a 401."""
    if not header:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer bt-...'")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("malformed Authorization header: expected 'Bearer bt-...'")
    return token.strip()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the authenticated key, its organisation and the key's own limits."""

    key_id: uuid.UUID
    org_id: uuid.UUID
    user_id: uuid.UUID | None
    tier: Tier
    key_rpm_limit: int | None  # None: the tier's default
    key_tpm_limit: int | None


@dataclass(frozen=True)
class IssuedKey:
    """A new key. `key` exists only here: show it to the person once; it is not recoverable."""

    key: str
    record: ApiKeyRecord


class ApiKeyAuthenticator:
    def __init__(self, store: ApiKeyStore) -> None:
        self._store = store

    async def issue(self, org_id: uuid.UUID, *, user_id: uuid.UUID | None = None, name: str | None = None,
                    rpm_limit: int | None = None, tpm_limit: int | None = None) -> IssuedKey:
        key = generate_api_key()
        record = await self._store.insert(org_id, hash_api_key(key), display_prefix(key), user_id=user_id,
                                          name=name, rpm_limit=rpm_limit, tpm_limit=tpm_limit)
        return IssuedKey(key, record)

    async def authenticate_bearer(self, token: str | None) -> Principal:
        """The principal of a request's `Authorization: Bearer` token; no token is a 401."""
        if token is None:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer bt-...'")
        return await self.authenticate(token)

    async def authenticate(self, presented: str) -> Principal:
        """The principal of a presented key. Unknown, malformed and revoked keys raise 401 errors."""
        # A malformed key is refused without a database round trip.
        if not _KEY_RE.match(presented):
            raise AuthenticationError("invalid API key")
        found = await self._store.find_by_hash(hash_api_key(presented))
        if found is None:
            raise AuthenticationError("invalid API key")
        key = found.key
        if key.revoked:
            raise RevokedKeyError(f"API key {key.prefix}... was revoked")
        return Principal(key.id, key.org_id, key.user_id, found.tier, key.rpm_limit, key.tpm_limit)

    async def revoke(self, key_id: uuid.UUID) -> ApiKeyRecord:
        return await self._store.revoke(key_id)
