-- The routing plane answers every caller with the same key with the same
-- decision body, so the body is kept with the row it belongs to.
ALTER TABLE eec_routing_idempotency ADD COLUMN decision jsonb;

ALTER TABLE eec_routing_idempotency
    ADD CONSTRAINT eec_routing_completed_has_body
    CHECK (status <> 'completed' OR decision IS NOT NULL);

-- Retention looks for failed reservations by age.
CREATE INDEX eec_routing_idempotency_failed_idx
    ON eec_routing_idempotency (updated_at)
    WHERE status = 'failed_before_commit';
