-- An intent's `not_before` is part of what was committed (a timer's time,
-- compared by the checker with the replayed effect) and never changes. When
-- an intent must wait longer than that (its publish failed and it backs
-- off, or its dispatch went out late and a step's timeout timer restarts
-- its clock), the wait goes here: the drainer claims it once both times
-- have passed.
ALTER TABLE eec_effect_intent ADD COLUMN deferred_until timestamptz;
