-- What the operator's list and search of runs read (`GET /v1/runs`,
-- `ductor runs list`), so that they stay fast with millions of runs:
--
-- - every list is a keyset page in (created_at, run_id) order, newest
--   first, read from an index that starts with the filter's column: all
--   tenants, one tenant (which replaces runs_tenant_created_idx), one
--   status, one workflow (and version), one correlation id;
-- - a run's correlation id is kept in a column of its own, taken from the
--   state by Postgres, so that it can be indexed without an expression
--   over `state` (an index over `state` would make every update of a run
--   a non-HOT one, since the state changes with each);
-- - the counts of runs by tenant, workflow, version and status are kept in
--   `run_counts`, moved by the statement that changes a run's status (the
--   batch statement, `src/apply/write_batch.sql`) and by retention's
--   purge, so that counting reads a handful of rows instead of the runs.
--
-- None of these columns changes while a run runs: the indexes on status
-- are updated when a run finishes (when `finished_at`'s index is too), and
-- an update of a running run stays HOT as before. Adding the column
-- rewrites `runs` once, here.

ALTER TABLE runs
    ADD COLUMN correlation_id text GENERATED ALWAYS AS (state ->> 'correlation_id') STORED;

CREATE INDEX runs_created_idx ON runs (created_at, run_id);
CREATE INDEX runs_tenant_created_run_idx ON runs (tenant_scope, created_at, run_id);
DROP INDEX runs_tenant_created_idx;
CREATE INDEX runs_status_created_idx ON runs (status, created_at, run_id);
CREATE INDEX runs_workflow_created_idx
    ON runs (workflow_name, workflow_version, created_at, run_id);
CREATE INDEX runs_correlation_idx
    ON runs (correlation_id, created_at, run_id) WHERE correlation_id IS NOT NULL;

-- How many runs each tenant has of each workflow version in each status.
-- A row's `n` is moved by deltas, upserted in key order within a statement
-- so that two writers never wait on each other's rows in opposite orders.
-- (A delta may be negative, so `n` has no CHECK: Postgres checks the row
-- an upsert proposes before it finds the conflict.)
CREATE TABLE run_counts (
    tenant_scope     text    NOT NULL,
    workflow_name    text    NOT NULL,
    workflow_version integer NOT NULL,
    status           text    NOT NULL
                             CHECK (status IN ('running', 'succeeded', 'failed', 'cancelled')),
    n                bigint  NOT NULL,
    PRIMARY KEY (tenant_scope, workflow_name, workflow_version, status)
);

INSERT INTO run_counts (tenant_scope, workflow_name, workflow_version, status, n)
SELECT tenant_scope, workflow_name, workflow_version, status, count(*)
FROM runs
GROUP BY tenant_scope, workflow_name, workflow_version, status;

-- Retention's purge, as before, and the purged runs leave the counts in
-- the same statement.
CREATE OR REPLACE FUNCTION ductor_purge_finished_runs(age_s double precision, batch bigint)
RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF age_s IS NULL OR age_s < 0 OR batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'retention needs an age of at least 0 s and a batch of at least 1 row'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH doomed AS (
        SELECT r.run_id FROM runs r
        WHERE r.finished_at < now() - make_interval(secs => age_s)
        ORDER BY r.finished_at LIMIT batch FOR UPDATE SKIP LOCKED
    ), tomb AS (
        INSERT INTO run_tombstones (run_id, tenant_scope, workflow_name, workflow_version,
            status, start_fingerprint, last_transition_seq, created_at, finished_at)
        SELECT r.run_id, r.tenant_scope, r.workflow_name, r.workflow_version, r.status,
            r.state->>'start_fingerprint', r.last_transition_seq, r.created_at, r.finished_at
        FROM runs r JOIN doomed USING (run_id)
        ON CONFLICT (run_id) DO NOTHING
    ), gone AS (
        DELETE FROM runs r USING doomed d WHERE r.run_id = d.run_id
        RETURNING r.run_id, r.tenant_scope, r.workflow_name, r.workflow_version, r.status
    ), counted AS (
        INSERT INTO run_counts AS c (tenant_scope, workflow_name, workflow_version, status, n)
        SELECT tenant_scope, workflow_name, workflow_version, status, -count(*)
        FROM gone GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
        ON CONFLICT (tenant_scope, workflow_name, workflow_version, status)
            DO UPDATE SET n = c.n + EXCLUDED.n
    )
    SELECT gone.run_id FROM gone;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ductor_purge_finished_runs(double precision, bigint) '
                   'SET search_path = %I, pg_temp', current_schema());
END;
$$;

REVOKE ALL ON FUNCTION ductor_purge_finished_runs(double precision, bigint) FROM PUBLIC;
