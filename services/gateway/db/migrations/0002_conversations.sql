-- Conversations (soft-deleted: deleted_at set, rows kept for audit) and their messages.

CREATE TABLE conversations (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id     uuid NOT NULL REFERENCES organisations (id) ON DELETE CASCADE,
    user_id    uuid REFERENCES users (id) ON DELETE SET NULL,
    title      text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz
);

-- The listing a user sees: their live conversations, most recently active first.
CREATE INDEX conversations_live_idx ON conversations (org_id, user_id, updated_at DESC)
    WHERE deleted_at IS NULL;

CREATE TABLE messages (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    conversation_id   uuid NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    role              text NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content           text NOT NULL,
    prompt_tokens     integer CHECK (prompt_tokens >= 0),
    completion_tokens integer CHECK (completion_tokens >= 0),
    created_at        timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX messages_conversation_idx ON messages (conversation_id, id);
