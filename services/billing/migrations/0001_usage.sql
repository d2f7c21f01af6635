-- Billing ledger. usage_events has one row per request, ever: request_id is the primary key and the
-- consumer inserts with ON CONFLICT DO NOTHING, so a redelivered event changes nothing.
-- No foreign keys to organisations/api_keys on purpose: the ledger records facts as they happened,
-- and an event must never be stuck behind a deleted organisation.

CREATE TABLE usage_events (
    request_id        text PRIMARY KEY CHECK (length(request_id) BETWEEN 1 AND 200),
    org_id            uuid NOT NULL,
    api_key_id        uuid,
    model             text NOT NULL,
    prompt_tokens     integer NOT NULL CHECK (prompt_tokens >= 0),  -- includes cached_tokens
    cached_tokens     integer NOT NULL CHECK (cached_tokens >= 0 AND cached_tokens <= prompt_tokens),
    completion_tokens integer NOT NULL CHECK (completion_tokens >= 0),
    finish_reason     text NOT NULL,
    ttft_ms           double precision,
    e2e_ms            double precision,
    cost_usd          numeric(18, 8) NOT NULL,
    created_at        timestamptz NOT NULL,  -- when the request finished (the event's time)
    ingested_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX usage_events_org_time_idx ON usage_events (org_id, created_at);

-- Per organisation, UTC day and model; updated in the same transaction as the inserts above, only
-- for rows that were really inserted, so it always equals the sums over usage_events.
CREATE TABLE usage_daily (
    org_id            uuid NOT NULL,
    day               date NOT NULL,
    model             text NOT NULL,
    requests          bigint NOT NULL,
    prompt_tokens     bigint NOT NULL,
    cached_tokens     bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    cost_usd          numeric(20, 8) NOT NULL,
    PRIMARY KEY (org_id, day, model)
);
