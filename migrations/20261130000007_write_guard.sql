-- A batch is written by one statement: runs, transitions, attempts, timer
-- cancels and effect intents. Most batches have no routing-plane statement
-- to run first, and then that statement is its own transaction: no BEGIN and
-- no COMMIT round trip. Every conditional write must still match exactly
-- what was sent, or the whole batch must not commit; the statement ends by
-- passing the counts it expected and the counts it wrote to this guard, which
-- raises (SQLSTATE DU409) on any difference and so rolls the statement back.
-- The apply layer maps DU409 to an optimistic-lock conflict and recomputes.
-- `expected` NULL skips the check.
CREATE FUNCTION ductor_write_guard(expected bigint[], written bigint[]) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF expected IS NOT NULL AND expected IS DISTINCT FROM written THEN
        RAISE EXCEPTION 'conditional writes matched % rows where % were expected', written, expected
            USING ERRCODE = 'DU409',
                  HINT = 'another writer changed a run of this batch; recompute it';
    END IF;
    RETURN true;
END;
$$;
