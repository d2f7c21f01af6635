-- Usage outbox: the gateway writes one row per finished request here before the response ends, and
-- its relay publishes the rows to Kafka (services/billing/relay.py). A row lives until the billing
-- ledger has its request id (then the relay deletes it), so neither a gateway crash nor a broker
-- that lost acknowledged messages can lose usage. `event` is the UsageEvent JSON as published.

CREATE TABLE usage_outbox (
    request_id  text PRIMARY KEY CHECK (length(request_id) BETWEEN 1 AND 200),
    event       text NOT NULL,
    recorded_at timestamptz NOT NULL,  -- when the request finished (the event's created_at)
    sent_at     timestamptz,           -- a broker acknowledged it (NULL: to publish)
    republished integer NOT NULL DEFAULT 0  -- published again because the ledger never got it
);

CREATE INDEX usage_outbox_unsent_idx ON usage_outbox (recorded_at, request_id) WHERE sent_at IS NULL;
CREATE INDEX usage_outbox_sent_idx ON usage_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- The relay compares a published row's age with the ledger's progress (max(ingested_at)).
CREATE INDEX usage_events_ingested_idx ON usage_events (ingested_at);
