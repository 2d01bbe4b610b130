-- What is left of a finished run after retention deleted it (runs.retention_ms):
-- enough to answer a late input for it without starting it again, and to
-- tell an operator it existed. A tombstone is kept runs.tombstone_retention_ms,
-- which should outlast the retention of the input topics: past it, a start
-- replayed from Kafka would begin the run anew.
CREATE TABLE run_tombstones (
    run_id            text        PRIMARY KEY,
    tenant_scope      text        NOT NULL,
    workflow_name     text        NOT NULL,
    workflow_version  integer     NOT NULL,
    status            text        NOT NULL CHECK (status IN ('succeeded', 'failed', 'cancelled')),
    -- The fingerprint of the request that started the run (NULL for runs
    -- started before fingerprints were kept): a late start with another
    -- request is refused as idempotency_mismatch, as it was before.
    start_fingerprint text,
    last_transition_seq bigint    NOT NULL,
    created_at        timestamptz NOT NULL,
    finished_at       timestamptz NOT NULL,
    purged_at         timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX run_tombstones_purged_idx ON run_tombstones (purged_at);
