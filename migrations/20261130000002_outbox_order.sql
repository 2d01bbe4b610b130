-- The drainer claims an intent only when no earlier, due, undelivered intent
-- of the same run and topic exists, so that a run's effects reach each topic
-- in transition order even with several drainers. This index answers that
-- check without scanning the run's delivered history.
CREATE INDEX eec_effect_intent_run_order_idx
    ON eec_effect_intent (run_id, topic, seq, effect_index)
    WHERE status <> 'completed';
