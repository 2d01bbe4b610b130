-- An intent that can never be published as it is (too large for the
-- broker, a topic that does not exist, a topic the producer may not write)
-- is parked after `drainer.park_after_failures` such failures: it leaves
-- the claim rounds, so it cannot hold up anything else, and waits with its
-- error until `ductor outbox redrive` puts it back once the cause is fixed.
ALTER TABLE eec_effect_intent DROP CONSTRAINT eec_effect_intent_status_check;
ALTER TABLE eec_effect_intent ADD CONSTRAINT eec_effect_intent_status_check
    CHECK (status IN ('pending', 'claimed', 'completed', 'parked'));
-- Permanent publish failures so far; transient ones (a broker away, a
-- timeout) are not counted, they only push `not_before` back.
ALTER TABLE eec_effect_intent
    ADD COLUMN publish_failures integer NOT NULL DEFAULT 0 CHECK (publish_failures >= 0),
    ADD COLUMN parked_at timestamptz;
ALTER TABLE eec_effect_intent ADD CONSTRAINT eec_effect_intent_parked
    CHECK ((status = 'parked') = (parked_at IS NOT NULL));
CREATE INDEX eec_effect_intent_parked_idx
    ON eec_effect_intent (parked_at)
    WHERE status = 'parked';
