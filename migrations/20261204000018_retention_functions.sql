-- Retention's own path through the history. The application role may not
-- delete a run, a transition, an attempt or a tombstone: with DELETE on
-- `runs` it could erase a running run and, by the cascade, its whole
-- history. Instead it may call these two functions, which run as their
-- owner (the migrator: SECURITY DEFINER) and delete only what retention
-- deletes: finished runs older than an age, each leaving its tombstone in
-- the same statement (the transitions and attempts go by ON DELETE
-- CASCADE), and tombstones older than an age. Each deletes at most `batch`
-- rows, skipping rows another session holds, and returns the ids it
-- deleted, one row each.
--
-- A SECURITY DEFINER function must not resolve a name through a schema its
-- caller can write: the search_path is pinned below to the schema these
-- functions are made in (the migrator's, which only it may create in),
-- then pg_temp, last. And nobody but the roles `ductor migrate` grants may
-- call them.

CREATE FUNCTION ductor_purge_finished_runs(age_s double precision, batch bigint)
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
        RETURNING r.run_id
    )
    SELECT gone.run_id FROM gone;
END;
$$;

CREATE FUNCTION ductor_purge_tombstones(age_s double precision, batch bigint)
RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF age_s IS NULL OR age_s < 0 OR batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'retention needs an age of at least 0 s and a batch of at least 1 row'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH gone AS (
        DELETE FROM run_tombstones t WHERE t.run_id IN (
            SELECT o.run_id FROM run_tombstones o
            WHERE o.purged_at < now() - make_interval(secs => age_s)
            ORDER BY o.purged_at LIMIT batch FOR UPDATE SKIP LOCKED)
        RETURNING t.run_id
    )
    SELECT gone.run_id FROM gone;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ductor_purge_finished_runs(double precision, bigint) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION ductor_purge_tombstones(double precision, bigint) '
                   'SET search_path = %I, pg_temp', current_schema());
END;
$$;

REVOKE ALL ON FUNCTION ductor_purge_finished_runs(double precision, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION ductor_purge_tombstones(double precision, bigint) FROM PUBLIC;
