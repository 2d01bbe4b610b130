-- The due index served both the drainer's claim scan and, as the smallest
-- index over undelivered intents, any query about them. With statistics that
-- lag behind a fast-growing table, the planner could pick it for the
-- per-intent ordering check of the apply transaction, turning an index probe
-- on (run_id, topic) into a scan of every undelivered intent, for each new
-- intent. The claim scan only wants pending intents, so the due index now
-- covers exactly those, and the ordering check (status <> 'completed') is
-- left with the index made for it.
DROP INDEX eec_effect_intent_due_idx;
CREATE INDEX eec_effect_intent_due_idx
    ON eec_effect_intent (not_before, intent_id)
    WHERE status = 'pending';

-- A queue table: rows change status quickly and most of it is completed
-- history. Analyse and vacuum it sooner than the global defaults, so plans
-- follow the live set and dead index entries are reclaimed.
ALTER TABLE eec_effect_intent SET (
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_scale_factor = 0.05
);
