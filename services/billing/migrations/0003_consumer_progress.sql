-- Each billing consumer's last empty poll: the moment it had read everything the broker held for it.
-- The outbox relay re-publishes a published row the ledger still lacks once every live consumer has
-- caught up after it was sent (services/billing/relay.py): the broker lost it. Rows of consumers not
-- seen for a while are ignored (a stopped consumer must not hold re-publishing back).

CREATE TABLE billing_consumer_progress (
    member       text PRIMARY KEY CHECK (length(member) BETWEEN 1 AND 200),
    caught_up_at timestamptz,           -- last empty poll (NULL: not caught up yet)
    seen_at      timestamptz NOT NULL   -- last poll of any kind
);
