-- Dead letters, recorded. Every input the ingress refuses is written here
-- before it is published to the dead-letter topic, so that a letter is
-- never in one place only, and so that the topic's copy, which may have
-- been cut to fit the broker, is not the only one: the row keeps the
-- whole value, up to `dead_letters.max_value_bytes`.
--
-- One row per input and stage: a redelivered input that fails again (after
-- a crash before its offset was stored) finds its row and adds none.
--
-- `headers` is jsonb rather than the bytes of Kafka's encoding: an array
-- of {"key": name, "value": null | {"utf8": text} | {"base64": bytes}},
-- in the order the input carried them, repeats kept, so that it reads as
-- the operator API shows it and can be searched, and still gives back
-- every byte (a value that is not UTF-8, or holds U+0000, which jsonb
-- cannot hold, is base64). The input's signature is never among them (see
-- src/ingress/dead_letter.rs): a replay is signed again by Ductor.
--
-- A letter is pending, then either replayed (once: `replay_id` is claimed
-- before the record is produced, `replayed_at` and where it landed are
-- recorded after) or discarded with a reason; never both.

CREATE TABLE dead_letters (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_topic text NOT NULL,
    source_partition integer NOT NULL,
    source_offset bigint NOT NULL,
    stage text NOT NULL,
    class text NOT NULL,
    error text NOT NULL,
    -- NULL: the input had no key (or one over the bound, see key_dropped).
    record_key bytea,
    key_dropped boolean NOT NULL DEFAULT false,
    headers jsonb NOT NULL DEFAULT '[]',
    headers_dropped boolean NOT NULL DEFAULT false,
    -- NULL: the input had no value. Else its first bytes, all of them
    -- unless value_bytes says it was longer.
    value bytea,
    value_bytes integer NOT NULL,
    -- Read from the value when it is a JSON object that names them.
    input_type text,
    tenant_scope text,
    run_id text,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    replay_id uuid,
    replay_claimed_at timestamptz,
    replayed_at timestamptz,
    replayed_partition integer,
    replayed_offset bigint,
    replay_signed boolean,
    discarded_at timestamptz,
    discard_reason text,
    CONSTRAINT dead_letters_once UNIQUE (source_topic, source_partition, source_offset, stage),
    CONSTRAINT dead_letters_value_bounded CHECK (value IS NULL OR length(value) <= value_bytes),
    CONSTRAINT dead_letters_headers_array CHECK (jsonb_typeof(headers) = 'array'),
    CONSTRAINT dead_letters_replay_claimed CHECK (
        (replay_id IS NULL) = (replay_claimed_at IS NULL)
        AND (replayed_at IS NULL OR replay_id IS NOT NULL)
        AND ((replayed_at IS NULL) = (replayed_offset IS NULL))),
    CONSTRAINT dead_letters_discarded_with_reason CHECK (
        (discarded_at IS NULL) = (discard_reason IS NULL)),
    CONSTRAINT dead_letters_replayed_or_discarded CHECK (
        replay_id IS NULL OR discarded_at IS NULL)
);

-- A tenant's letters, newest first (the operator API's keyset pages).
CREATE INDEX dead_letters_by_tenant ON dead_letters (tenant_scope, id);
-- Retention, and a listing by time.
CREATE INDEX dead_letters_by_time ON dead_letters (dead_lettered_at);

-- Retention's path, as for runs (20261204000018_retention_functions): the
-- application role may not delete a letter, so that it cannot erase the
-- record of an input it refused; it may call this function, which runs as
-- its owner and deletes only letters older than an age, at most `batch`,
-- skipping rows another session holds, and returns their ids.
CREATE FUNCTION ductor_purge_dead_letters(age_s double precision, batch bigint)
RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF age_s IS NULL OR age_s < 0 OR batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'retention needs an age of at least 0 s and a batch of at least 1 row'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH gone AS (
        DELETE FROM dead_letters d WHERE d.id IN (
            SELECT o.id FROM dead_letters o
            WHERE o.dead_lettered_at < now() - make_interval(secs => age_s)
            ORDER BY o.dead_lettered_at LIMIT batch FOR UPDATE SKIP LOCKED)
        RETURNING d.id
    )
    SELECT gone.id FROM gone;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ductor_purge_dead_letters(double precision, bigint) '
                   'SET search_path = %I, pg_temp', current_schema());
END;
$$;

REVOKE ALL ON FUNCTION ductor_purge_dead_letters(double precision, bigint) FROM PUBLIC;
