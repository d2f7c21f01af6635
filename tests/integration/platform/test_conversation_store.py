"""Conversations: scoped to their organisation, soft-deleted, messages in order."""

from __future__ import annotations

import pytest

from services.common.errors import NotFoundError
from services.gateway.db.accounts import AccountStore
from services.gateway.db.conversations import ConversationStore
from services.gateway.db.pool import Database


async def test_messages_come_back_in_order_and_bump_the_conversation(db: Database) -> None:
    org = await AccountStore(db).create_org("chatty")
    store = ConversationStore(db)
    conv = await store.create(org.id, None, "hello")
    await store.append(org.id, conv.id, "user", "hi")
    await store.append(org.id, conv.id, "assistant", "hello!", prompt_tokens=12, completion_tokens=3)
    messages = await store.messages(org.id, conv.id)
    assert [(m.role, m.content) for m in messages] == [("user", "hi"), ("assistant", "hello!")]
    assert (await store.get(org.id, conv.id)).updated_at > conv.updated_at


async def test_other_organisations_cannot_see_a_conversation(db: Database) -> None:
    accounts = AccountStore(db)
    owner, other = await accounts.create_org("owner"), await accounts.create_org("other")
    store = ConversationStore(db)
    conv = await store.create(owner.id, None)
    with pytest.raises(NotFoundError):
        await store.get(other.id, conv.id)
    with pytest.raises(NotFoundError):
        await store.append(other.id, conv.id, "user", "sneaky")


async def test_soft_deleted_conversation_disappears_but_its_rows_stay(db: Database) -> None:
    org = await AccountStore(db).create_org("forgetful")
    store = ConversationStore(db)
    conv = await store.create(org.id, None, "to delete")
    await store.append(org.id, conv.id, "user", "remember me")
    await store.soft_delete(org.id, conv.id)
    assert await store.list_live(org.id, None) == []
    with pytest.raises(NotFoundError):
        await store.messages(org.id, conv.id)
    with pytest.raises(NotFoundError):
        await store.append(org.id, conv.id, "user", "too late")
    async with db.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM messages WHERE conversation_id = %s", (conv.id,))
        assert await cur.fetchone() == (1,)


async def test_another_user_of_the_organisation_cannot_read_or_delete_a_conversation(db: Database) -> None:
    accounts = AccountStore(db)
    org = await accounts.create_org("shared")
    alice = await accounts.ensure_user(org.id, "alice@example.com")
    bob = await accounts.ensure_user(org.id, "bob@example.com")
    store = ConversationStore(db)
    conv = await store.create(org.id, alice.id, "alice's")
    await store.append(org.id, conv.id, "user", "private")
    for caller in (bob.id, None):  # another user, or a key without a user
        with pytest.raises(NotFoundError):
            await store.get(org.id, conv.id, user=caller)
        with pytest.raises(NotFoundError):
            await store.messages(org.id, conv.id, user=caller)
        with pytest.raises(NotFoundError):
            await store.soft_delete(org.id, conv.id, user=caller)
    assert [m.content for m in await store.messages(org.id, conv.id, user=alice.id)] == ["private"]
