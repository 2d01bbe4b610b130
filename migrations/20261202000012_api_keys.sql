-- The callers of the HTTP API. A key is `dk_<key_id>_<secret>`; only the
-- SHA-256 of the secret is kept, so a copy of this table lets nobody in.
-- (The secret is 256 random bits: a fast hash is enough, there is nothing
-- to guess.) The tenant of every request is its key's: a caller cannot
-- act as another tenant, whatever its body says.
CREATE TABLE api_keys (
    key_id          text        PRIMARY KEY CHECK (key_id ~ '^[0-9a-f]{16}$'),
    tenant_scope    text        NOT NULL CHECK (length(tenant_scope) BETWEEN 1 AND 128),
    -- What the key may do: `runs:write` (start, signal, cancel),
    -- `runs:read`, `admin` (the operator endpoints).
    scopes          text[]      NOT NULL CHECK (
        cardinality(scopes) BETWEEN 1 AND 3
        AND scopes <@ ARRAY['runs:write', 'runs:read', 'admin']
    ),
    secret_sha256   bytea       NOT NULL CHECK (length(secret_sha256) = 32),
    label           text        CHECK (length(label) <= 200),
    -- Requests per second this key may make; NULL: the configured default.
    requests_per_second integer CHECK (requests_per_second > 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz,
    -- Coarse (updated at most once a minute per key).
    last_used_at    timestamptz,
    revoked_at      timestamptz
);

CREATE INDEX api_keys_tenant ON api_keys (tenant_scope);
