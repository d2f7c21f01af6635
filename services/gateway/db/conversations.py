"""`ConversationStore`: conversations and their messages, scoped to an organisation (and user).

Every read and write takes the caller's org id, so one organisation can never see another's
conversation even with a guessed id. Within an organisation a conversation belongs to the user who
created it (`user_id`; NULL for keys without a user): `get`, `messages`, `rename` and `soft_delete`
take the caller's `user` and treat another user's conversation as missing (404), exactly as `list_live`
never lists it. `ORG_WIDE` skips that check, for internal callers that already made it (appending the
reply of a request whose history was read with the caller's user).

Deletion is soft (`deleted_at`): a deleted conversation
disappears from reads and refuses new messages, but its rows stay for audit and billing disputes.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from psycopg import errors as pg_errors

from services.common.errors import InvalidRequestError, NotFoundError
from services.gateway.db.pool import Database, returned

Role = Literal["system", "user", "assistant", "tool"]
_CONV_COLUMNS = "id, org_id, user_id, title, created_at, updated_at"


class UserScope(enum.Enum):
    ORG_WIDE = "org_wide"


ORG_WIDE = UserScope.ORG_WIDE
User = uuid.UUID | None | UserScope  # the caller's user id (None: a key without a user), or ORG_WIDE


def _owned(user: User, column: str = "user_id") -> tuple[str, tuple[uuid.UUID | None, ...]]:
    if isinstance(user, UserScope):
        return "", ()
    return f" AND {column} IS NOT DISTINCT FROM %s", (user,)


@dataclass(frozen=True)
class Conversation:
    id: uuid.UUID
    org_id: uuid.UUID
    user_id: uuid.UUID | None
    title: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: uuid.UUID
    role: Role
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    created_at: datetime


class ConversationStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def create(self, org_id: uuid.UUID, user_id: uuid.UUID | None, title: str = "",
                     conversation_id: uuid.UUID | None = None) -> Conversation:
        """A new conversation; `conversation_id` (a stored response's, known before it is stored) or a new one."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"INSERT INTO conversations (id, org_id, user_id, title) VALUES (%s, %s, %s, %s) "
                f"RETURNING {_CONV_COLUMNS}", (conversation_id or uuid.uuid4(), org_id, user_id, title))
            return Conversation(*returned(await cur.fetchone()))

    async def get(self, org_id: uuid.UUID, conversation_id: uuid.UUID, *, user: User = ORG_WIDE) -> Conversation:
        owner, args = _owned(user)
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_CONV_COLUMNS} FROM conversations "
                f"WHERE id = %s AND org_id = %s AND deleted_at IS NULL{owner}", (conversation_id, org_id, *args))
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"conversation {conversation_id} not found")
        return Conversation(*row)

    async def list_live(self, org_id: uuid.UUID, user_id: uuid.UUID | None,
                        limit: int = 50) -> list[Conversation]:
        """Live conversations of the user (or the org's user-less ones), most recently active first."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_CONV_COLUMNS} FROM conversations WHERE org_id = %s "
                "AND user_id IS NOT DISTINCT FROM %s AND deleted_at IS NULL "
                "ORDER BY updated_at DESC LIMIT %s", (org_id, user_id, limit))
            return [Conversation(*row) for row in await cur.fetchall()]

    async def rename(self, org_id: uuid.UUID, conversation_id: uuid.UUID, title: str, *,
                     user: User = ORG_WIDE) -> Conversation:
        owner, args = _owned(user)
        async with self._db.connection() as conn:
            cur = await conn.execute(
                "UPDATE conversations SET title = %s, updated_at = now() "
                f"WHERE id = %s AND org_id = %s AND deleted_at IS NULL{owner} RETURNING {_CONV_COLUMNS}",
                (title, conversation_id, org_id, *args))
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"conversation {conversation_id} not found")
        return Conversation(*row)

    async def soft_delete(self, org_id: uuid.UUID, conversation_id: uuid.UUID, *, user: User = ORG_WIDE) -> None:
        owner, args = _owned(user)
        async with self._db.connection() as conn:
            cur = await conn.execute(
                "UPDATE conversations SET deleted_at = now() "
                f"WHERE id = %s AND org_id = %s AND deleted_at IS NULL{owner}", (conversation_id, org_id, *args))
            if cur.rowcount == 0:
                raise NotFoundError(f"conversation {conversation_id} not found")

    async def purge_deleted(self, deleted_before: datetime) -> int:
        """Hard-delete conversations soft-deleted before `deleted_before` (their messages cascade)."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                "DELETE FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < %s",
                (deleted_before,))
            return cur.rowcount

    async def append(self, org_id: uuid.UUID, conversation_id: uuid.UUID, role: Role, content: str, *,
                     prompt_tokens: int | None = None, completion_tokens: int | None = None) -> Message:
        """Add a message and bump the conversation's `updated_at`, in one transaction."""
        try:
            async with self._db.connection() as conn:
                # Locks the live conversation row, so a concurrent soft delete can't slip in between.
                cur = await conn.execute(
                    "UPDATE conversations SET updated_at = now() "
                    "WHERE id = %s AND org_id = %s AND deleted_at IS NULL", (conversation_id, org_id))
                if cur.rowcount == 0:
                    raise NotFoundError(f"conversation {conversation_id} not found")
                cur = await conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, prompt_tokens, completion_tokens) "
                    "VALUES (%s, %s, %s, %s, %s) RETURNING id, conversation_id, role, content, "
                    "prompt_tokens, completion_tokens, created_at",
                    (conversation_id, role, content, prompt_tokens, completion_tokens))
                return Message(*returned(await cur.fetchone()))
        except pg_errors.CheckViolation as e:
            raise InvalidRequestError(f"invalid message: {e.diag.message_primary}") from e

    async def messages(self, org_id: uuid.UUID, conversation_id: uuid.UUID, *,
                       user: User = ORG_WIDE) -> list[Message]:
        """The conversation's messages in order (NotFound if it is deleted, another org's or user's)."""
        owner, args = _owned(user, "c.user_id")
        async with self._db.connection() as conn:
            cur = await conn.execute(
                "SELECT m.id, m.conversation_id, m.role, m.content, m.prompt_tokens, m.completion_tokens, "
                "m.created_at FROM messages m JOIN conversations c ON c.id = m.conversation_id "
                f"WHERE c.id = %s AND c.org_id = %s AND c.deleted_at IS NULL{owner} ORDER BY m.id",
                (conversation_id, org_id, *args))
            rows = await cur.fetchall()
        if not rows:
            await self.get(org_id, conversation_id, user=user)  # NotFound: missing, deleted or not theirs
        return [Message(*row) for row in rows]
