-- Every running drainer keeps a heartbeat here. A claim is held for its
-- lease, but no longer than its drainer lives: the reconciler gives back
-- the claims of a drainer whose heartbeat stopped (its process was killed)
-- after `drainer.member_timeout_ms`, instead of waiting out the lease, so
-- a crash of Ductor delays a run's effects by seconds, not by a lease.
CREATE TABLE eec_drainer_member (
    drainer_id   text        PRIMARY KEY CHECK (length(drainer_id) BETWEEN 1 AND 256),
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
