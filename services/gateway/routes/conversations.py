"""Conversations: `POST/GET /v1/conversations`, `GET/DELETE /v1/conversations/{id}`.

Scoped to the caller's organisation and user by the store: another organisation's or another user's
conversation is a 404, exactly like an unknown one (GET, DELETE and continuing one in a chat request
see only what `GET /v1/conversations` lists).
Deleting is soft; the rows are purged after the retention period (retention.py).
Continue one with `conversation_id` in a chat completion request. A gateway without a database
(`BATON_AUTH_MODE=none`) answers every one of these with 501 `feature_disabled`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from fastapi import APIRouter

from services.gateway.deps import Conversations, CurrentPrincipal, Deps
from services.gateway.errors import BadRequestError
from services.gateway.schemas import ConversationCreate

if TYPE_CHECKING:
    from services.gateway.db.conversations import Conversation, Message

router = APIRouter(tags=["conversations"])


def conversation_object(c: Conversation, messages: list[Message] | None = None) -> dict[str, object]:
    body: dict[str, object] = {"id": str(c.id), "object": "conversation", "title": c.title,
                               "created_at": int(c.created_at.timestamp()),
                               "updated_at": int(c.updated_at.timestamp())}
    if messages is not None:
        body["messages"] = [{"id": m.id, "role": m.role, "content": m.content,
                             "created_at": int(m.created_at.timestamp())} for m in messages]
    return body


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, principal: CurrentPrincipal,
                              store: Conversations, deps: Deps) -> dict[str, object]:
    if deps.safety is not None:  # stored turns are read by the model when continued: check them now
        screened = await deps.safety.check_texts(principal.org_id, (), [m.text() for m in body.messages],
                                                 "conversation-create")
        if screened.refusal is not None:
            raise BadRequestError("the conversation was refused by the content policy "
                                  f"({screened.refusal.category or 'unsafe'})", "messages", "content_policy_violation")
    conversation = await store.create(principal.org_id, principal.user_id, body.title)
    messages = []
    for m in body.messages:
        message = m.for_template()
        messages.append(await store.append(principal.org_id, conversation.id, message["role"],  # type: ignore[arg-type]
                                           message["content"]))
    return conversation_object(conversation, messages)


@router.get("/v1/conversations")
async def list_conversations(principal: CurrentPrincipal, store: Conversations) -> dict[str, object]:
    """The caller's live conversations, most recently active first."""
    found = await store.list_live(principal.org_id, principal.user_id)
    return {"object": "list", "data": [conversation_object(c) for c in found]}


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: uuid.UUID, principal: CurrentPrincipal,
                           store: Conversations) -> dict[str, object]:
    conversation = await store.get(principal.org_id, conversation_id, user=principal.user_id)
    return conversation_object(conversation, await store.messages(principal.org_id, conversation_id,
                                                                  user=principal.user_id))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: uuid.UUID, principal: CurrentPrincipal,
                              store: Conversations) -> dict[str, object]:
    await store.soft_delete(principal.org_id, conversation_id, user=principal.user_id)
    return {"id": str(conversation_id), "object": "conversation.deleted", "deleted": True}
