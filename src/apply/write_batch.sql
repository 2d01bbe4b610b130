-- A whole batch in one statement: the runs (new ones inserted unless a
-- tombstone says retention deleted them, changed ones updated only where
-- record_version is still the one loaded), their counts by status, the
-- history and the effects (transitions, attempts inserted and finished, the cancel
-- of finished attempts' pending timeout timers, the effect intents), then
-- ductor_write_guard over what each conditional write matched against what
-- was sent ($60; NULL: no check). $61 names the writer in each transition. A shortfall is a lost race: the guard
-- raises DU409 and nothing of the statement is kept. Without a transaction
-- around it, the statement is the batch's commit.
--
-- The attempts update and the cancel test the status in a CASE, so that the
-- planner cannot take an equality on the status as a sign that only a few
-- rows qualify. On a young table, whose statistics are older than its rows,
-- a.status = 'dispatched' was estimated at one row: the attempts update
-- compared every attempt of the table with every attempt of the batch (two
-- million comparisons, over a second, for 256 attempts against 8000), and
-- the cancel scanned the pending-intent index instead of probing
-- eec_effect_intent_cancel_idx.
--
-- With a fast lane ($58 names its drainer), a due intent with no earlier
-- undelivered intent of its run and topic (one due by now or by its own
-- not_before, so that a clock running ahead of the database's cannot hide
-- it) is inserted claimed by that drainer. Rows of one statement do not see
-- each other, so two intents of one run and topic in the same batch are both
-- claimed; the drainer publishes them as one chain, in order. An intent of
-- another writer can only appear with a newer record_version of its run,
-- which makes this statement's runs update fall short and roll back.
--
-- Placeholders are numbered in bind order; BatchWrite::bind binds them.
WITH ins AS (
    INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version,
        status, record_version, last_transition_seq, state, created_at, updated_at, finished_at)
    SELECT u.run_id, u.tenant, u.pool, u.workflow, u.version, u.status, 1, u.seq,
        u.state::jsonb, u.created_at, u.updated_at, u.finished_at
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[],
        $7::int8[], $8::text[], $9::timestamptz[], $10::timestamptz[], $11::timestamptz[])
        AS u(run_id, tenant, pool, workflow, version, status, seq, state, created_at,
             updated_at, finished_at)
    WHERE NOT EXISTS (SELECT 1 FROM run_tombstones p WHERE p.run_id = u.run_id)
    ON CONFLICT (run_id) DO NOTHING
    RETURNING 1
), upd AS (
    UPDATE runs AS r SET status = u.status,
        record_version = r.record_version + 1, last_transition_seq = u.seq,
        state = u.state::jsonb, updated_at = u.updated_at, finished_at = u.finished_at
    FROM UNNEST($12::text[], $13::int8[], $14::text[], $15::int8[], $16::text[],
        $17::timestamptz[], $18::timestamptz[])
        AS u(run_id, expected_version, status, seq, state, updated_at, finished_at)
    WHERE r.run_id = u.run_id
      AND r.record_version = u.expected_version AND r.last_transition_seq < u.seq
    RETURNING 1
), t AS (
    INSERT INTO run_transitions (run_id, seq, input_ref, kind, from_status, to_status,
        step_index, detail, source_topic, source_partition, source_offset, created_at, writer)
    SELECT u.run_id, u.seq, u.input_ref, u.kind, u.from_status, u.to_status, u.step_index,
        u.detail::jsonb, u.source_topic, u.source_partition, u.source_offset, u.at, $61::text
    FROM UNNEST($19::text[], $20::int8[], $21::text[], $22::text[], $23::text[], $24::text[],
        $25::int4[], $26::text[], $27::text[], $28::int4[], $29::int8[], $30::timestamptz[])
        AS u(run_id, seq, input_ref, kind, from_status, to_status, step_index, detail,
             source_topic, source_partition, source_offset, at)
    ON CONFLICT DO NOTHING
    RETURNING 1
), ai AS (
    INSERT INTO run_attempts (stamp, run_id, step_index, attempt, status, dispatched_at,
        deadline, finished_at, error)
    SELECT * FROM UNNEST($31::uuid[], $32::text[], $33::int4[], $34::int4[], $35::text[],
        $36::timestamptz[], $37::timestamptz[], $38::timestamptz[], $39::text[])
    ON CONFLICT DO NOTHING
    RETURNING 1
), af AS (
    UPDATE run_attempts AS a
    SET status = u.status, finished_at = u.finished_at, error = u.error
    FROM UNNEST($40::uuid[], $41::text[], $42::timestamptz[], $43::text[])
        AS u(stamp, status, finished_at, error)
    WHERE a.stamp = u.stamp AND CASE WHEN a.status = 'dispatched' THEN true END
    RETURNING 1
), d AS (
    DELETE FROM eec_effect_intent WHERE cancel_key = ANY($44::text[])
        AND CASE WHEN status = 'pending' THEN true END
    RETURNING 1
), counted AS (
    -- The runs' counts by status, as the batch moves them ($62..$66, netted
    -- per key by the plan), in key order (see run_counts).
    INSERT INTO run_counts AS c (tenant_scope, workflow_name, workflow_version, status, n)
    SELECT * FROM UNNEST($62::text[], $63::text[], $64::int4[], $65::text[], $66::int8[])
        AS k(tenant, workflow, version, status, delta)
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (tenant_scope, workflow_name, workflow_version, status)
        DO UPDATE SET n = c.n + EXCLUDED.n
    RETURNING 1
), iu AS (
    SELECT * FROM UNNEST($45::text[], $46::int8[], $47::int4[], $48::text[], $49::text[],
        $50::text[], $51::bytea[], $52::text[], $53::bytea[], $54::text[],
        $55::timestamptz[], $56::text[], $57::bool[])
        AS u(run_id, seq, effect_index, key, tenant, topic, message_key, headers, payload,
             ce_type, not_before, cancel_key, due)
), ic AS (
    SELECT iu.*, iu.due AND $58::text IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM eec_effect_intent e
        WHERE e.run_id = iu.run_id AND e.topic = iu.topic
          AND e.status <> 'completed' AND e.status <> 'parked'
          AND (e.not_before <= GREATEST(clock_timestamp(), iu.not_before)
               OR e.attempts > 0)) AS fast
    FROM iu
), i AS (
    INSERT INTO eec_effect_intent (run_id, seq, effect_index, idempotency_key, tenant_scope,
        topic, message_key, headers, payload, ce_type, not_before, cancel_key,
        status, claimed_by, claim_expires_at, attempts)
    SELECT ic.run_id, ic.seq, ic.effect_index, ic.key, ic.tenant, ic.topic, ic.message_key,
        ic.headers::jsonb, ic.payload, ic.ce_type, ic.not_before, ic.cancel_key,
        CASE WHEN ic.fast THEN 'claimed' ELSE 'pending' END,
        CASE WHEN ic.fast THEN $58::text END,
        CASE WHEN ic.fast THEN clock_timestamp() + make_interval(secs => $59::float8) END,
        CASE WHEN ic.fast THEN 1 ELSE 0 END
    FROM ic
    RETURNING intent_id, run_id, seq, effect_index, status = 'claimed' AS claimed, created_at
)
SELECT ductor_write_guard($60::int8[], ARRAY[(SELECT count(*) FROM ins),
        (SELECT count(*) FROM upd), (SELECT count(*) FROM t), (SELECT count(*) FROM ai),
        (SELECT count(*) FROM af)]) AS guarded,
    (SELECT count(*) FROM d) AS timers_cancelled,
    (SELECT count(*) FROM i) AS intents,
    ARRAY(SELECT intent_id FROM i WHERE claimed ORDER BY intent_id) AS claimed_ids,
    ARRAY(SELECT run_id FROM i WHERE claimed ORDER BY intent_id) AS claimed_runs,
    ARRAY(SELECT seq FROM i WHERE claimed ORDER BY intent_id) AS claimed_seqs,
    ARRAY(SELECT effect_index FROM i WHERE claimed ORDER BY intent_id) AS claimed_indexes,
    ARRAY(SELECT created_at FROM i WHERE claimed ORDER BY intent_id) AS claimed_created
