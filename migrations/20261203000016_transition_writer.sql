-- Who wrote each transition: `<host>:<pid>/<role>#<epoch>` (the ingress's
-- epoch moves on at every assignment of its partitions). With the input
-- topics co-partitioned, one run's transitions within an epoch come from
-- one writer; the history shows it. NULL for transitions written before.
ALTER TABLE run_transitions ADD COLUMN writer text;
