-- Organisations, their users and API keys.
-- Limits on a key are nullable: NULL means "the tier's default" (BATON_TIER_LIMITS), so changing a
-- tier's defaults changes every key that never got its own limit.

CREATE TABLE organisations (
    id                 uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name               text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    tier               text NOT NULL DEFAULT 'free' CHECK (tier IN ('free', 'plus', 'enterprise')),
    monthly_budget_usd numeric(14, 4) CHECK (monthly_budget_usd >= 0),  -- NULL: no budget
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id     uuid NOT NULL REFERENCES organisations (id) ON DELETE CASCADE,
    email      text NOT NULL CHECK (length(email) BETWEEN 3 AND 320),
    name       text,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, email)
);

CREATE TABLE api_keys (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id     uuid NOT NULL REFERENCES organisations (id) ON DELETE CASCADE,
    user_id    uuid REFERENCES users (id) ON DELETE SET NULL,
    key_hash   bytea NOT NULL UNIQUE CHECK (length(key_hash) = 32),  -- SHA-256 of the whole key
    prefix     text NOT NULL,  -- first characters of the key, shown in listings; not secret
    name       text,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    rpm_limit  integer CHECK (rpm_limit > 0),
    tpm_limit  integer CHECK (tpm_limit > 0)
);

CREATE INDEX api_keys_org_idx ON api_keys (org_id, created_at);
