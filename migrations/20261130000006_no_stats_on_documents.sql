-- No query filters, joins or sorts on the documents Ductor stores (run
-- state, transition detail, intent headers and payload, routing decision),
-- yet ANALYZE sampled and sorted them to build statistics nobody reads:
-- under load, autovacuum's analyses spent more CPU comparing JSONB values
-- than on anything else they did. Statistics stay on for every column that
-- a query does look at.
ALTER TABLE runs ALTER COLUMN state SET STATISTICS 0;
ALTER TABLE run_transitions ALTER COLUMN detail SET STATISTICS 0;
ALTER TABLE eec_effect_intent ALTER COLUMN headers SET STATISTICS 0;
ALTER TABLE eec_effect_intent ALTER COLUMN payload SET STATISTICS 0;
ALTER TABLE eec_routing_idempotency ALTER COLUMN decision SET STATISTICS 0;
