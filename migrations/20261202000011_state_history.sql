-- A run's state kept every step's output and every signal's payload, so it
-- grew with each of them, and every input of the run loads and writes back
-- the whole state. The coordinator now keeps only the newest output in the
-- state (`output`, null before a step succeeded) and signals without their
-- payloads; each output is in the detail of the transition its step's
-- success made, each payload in the detail of its `run.signalled`
-- transition. This moves what the runs already stored to where it is kept
-- now, so nothing is lost, and then gives their states the new shape.
--
-- The history is append-only and its trigger refuses every UPDATE. This is
-- the one change made to it: keys are added to a detail that lacks them,
-- and nothing in a row is replaced. The trigger is off only inside this
-- migration's transaction, so no other writer ever sees it off.
ALTER TABLE run_transitions DISABLE TRIGGER run_transitions_no_update;

-- Output n (from 0) is that of step n. Its success is the `step.succeeded`
-- transition, or `run.succeeded` for the last step, whose detail names the
-- step as `completed_step` (its `step_index` is the run's step after it,
-- the next one for `step.succeeded`).
UPDATE run_transitions t
SET detail = t.detail || jsonb_build_object('output', o.output)
FROM runs r
CROSS JOIN LATERAL jsonb_array_elements(r.state -> 'outputs') WITH ORDINALITY AS o (output, n)
WHERE t.run_id = r.run_id
  AND t.kind IN ('step.succeeded', 'run.succeeded')
  AND (t.detail ->> 'completed_step')::bigint = o.n - 1
  AND NOT t.detail ? 'output';

-- A signal id is recorded once per run, by one `run.signalled` transition.
UPDATE run_transitions t
SET detail = t.detail || jsonb_build_object('payload', s.signal -> 'payload')
FROM runs r
CROSS JOIN LATERAL jsonb_array_elements(r.state -> 'signals') AS s (signal)
WHERE t.run_id = r.run_id
  AND t.kind = 'run.signalled'
  AND t.detail ->> 'signal_id' = s.signal ->> 'signal_id'
  AND s.signal ? 'payload'
  AND NOT t.detail ? 'payload';

ALTER TABLE run_transitions ENABLE TRIGGER run_transitions_no_update;

-- The newest output is the last one (a JSON null when there is none), and
-- the signals keep their order.
UPDATE runs
SET state = (state - 'outputs')
    || jsonb_build_object(
        'output', COALESCE(state -> 'outputs' -> -1, 'null'::jsonb),
        'signals', COALESCE(
            (SELECT jsonb_agg(s.signal - 'payload' ORDER BY s.n)
             FROM jsonb_array_elements(state -> 'signals') WITH ORDINALITY AS s (signal, n)),
            '[]'::jsonb))
WHERE state ? 'outputs';
