-- Measured with `ductor bench`: the outbox is most of the apply
-- transaction's cost. Three changes make it leaner.

-- The idempotency key is derived from (run_id, seq, effect_index), which is
-- already unique; a second unique index only costs every insert.
ALTER TABLE eec_effect_intent DROP CONSTRAINT eec_effect_intent_key_unique;

-- A step's timeout timer is pointless once its attempt has finished: the
-- transition that finishes the attempt deletes the still-pending timer, so
-- it is never published, consumed and folded into a no-op.
ALTER TABLE eec_effect_intent ADD COLUMN cancel_key text;
CREATE INDEX eec_effect_intent_cancel_idx
    ON eec_effect_intent (cancel_key)
    WHERE cancel_key IS NOT NULL;

-- Room on each page for in-place (HOT) updates of run state and attempts.
ALTER TABLE runs SET (fillfactor = 80);
ALTER TABLE run_attempts SET (fillfactor = 80);
