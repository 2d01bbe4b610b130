-- Ductor's core schema: runs, their append-only transition history, attempts,
-- the effect-intent outbox and the routing idempotency table. Names follow the
-- concept document (record_version, last_transition_seq, eec_*). Later changes
-- come as new migrations; an applied migration is never edited.

CREATE TABLE runs (
    run_id              text        PRIMARY KEY
                                    CHECK (length(run_id) BETWEEN 1 AND 128),
    tenant_scope        text        NOT NULL CHECK (length(tenant_scope) BETWEEN 1 AND 128),
    pool_id             text        NOT NULL CHECK (length(pool_id) BETWEEN 1 AND 128),
    workflow_name       text        NOT NULL,
    workflow_version    integer     NOT NULL CHECK (workflow_version >= 1),
    status              text        NOT NULL
                                    CHECK (status IN ('running', 'succeeded', 'failed', 'cancelled')),
    -- Optimistic lock: every committed UPDATE bumps it, and every UPDATE is
    -- conditional on the value that was read.
    record_version      bigint      NOT NULL DEFAULT 1 CHECK (record_version >= 1),
    -- Seq of the newest transition; history only moves forward.
    last_transition_seq bigint      NOT NULL CHECK (last_transition_seq >= 0),
    -- The coordinator's full run state, as the pure fold sees it.
    state               jsonb       NOT NULL,
    created_at          timestamptz NOT NULL,
    updated_at          timestamptz NOT NULL,
    finished_at         timestamptz,
    CONSTRAINT runs_finished_iff_terminal
        CHECK ((status = 'running') = (finished_at IS NULL))
);

CREATE INDEX runs_tenant_created_idx ON runs (tenant_scope, created_at);
CREATE INDEX runs_finished_idx ON runs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE run_transitions (
    run_id           text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    seq              bigint      NOT NULL CHECK (seq >= 1),
    -- Names the input that caused the transition ("start", "result:<stamp>",
    -- "signal:<id>", ...). Unique per run: an input applies at most once.
    input_ref        text        NOT NULL,
    kind             text        NOT NULL,
    from_status      text        CHECK (from_status IN ('running', 'succeeded', 'failed', 'cancelled')),
    to_status        text        NOT NULL
                                 CHECK (to_status IN ('running', 'succeeded', 'failed', 'cancelled')),
    step_index       integer     NOT NULL CHECK (step_index >= 0),
    detail           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Where the input came from, for inspection and audits.
    source_topic     text,
    source_partition integer,
    source_offset    bigint,
    created_at       timestamptz NOT NULL,
    PRIMARY KEY (run_id, seq),
    CONSTRAINT run_transitions_input_once UNIQUE (run_id, input_ref)
);

-- The history is append-only: rows are inserted, and deleted only together
-- with their run by retention. An UPDATE is always a bug.
CREATE FUNCTION run_transitions_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'run_transitions is append-only'
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE TRIGGER run_transitions_no_update
    BEFORE UPDATE ON run_transitions
    FOR EACH ROW EXECUTE FUNCTION run_transitions_append_only();

CREATE TABLE run_attempts (
    -- The fencing token: only a result carrying the stamp of the outstanding
    -- attempt can change the run.
    stamp         uuid        PRIMARY KEY,
    run_id        text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    step_index    integer     NOT NULL CHECK (step_index >= 0),
    attempt       integer     NOT NULL CHECK (attempt >= 1),
    status        text        NOT NULL
                              CHECK (status IN ('dispatched', 'succeeded', 'failed', 'timed_out', 'cancelled')),
    dispatched_at timestamptz NOT NULL,
    deadline      timestamptz NOT NULL,
    finished_at   timestamptz,
    error         text,
    CONSTRAINT run_attempts_one_per_number UNIQUE (run_id, step_index, attempt),
    CONSTRAINT run_attempts_finished_iff_final
        CHECK ((status = 'dispatched') = (finished_at IS NULL))
);

CREATE TABLE eec_effect_intent (
    intent_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           text        NOT NULL,
    -- The transition that produced the effect, and its place in it.
    seq              bigint      NOT NULL CHECK (seq >= 1),
    effect_index     integer     NOT NULL CHECK (effect_index >= 0),
    -- Deterministic (run, seq, index): a redriven effect carries the key of
    -- its first delivery.
    idempotency_key  text        NOT NULL,
    tenant_scope     text        NOT NULL,
    topic            text        NOT NULL CHECK (length(topic) BETWEEN 1 AND 249),
    message_key      bytea       NOT NULL,
    -- Every header, ce_time included, fixed at commit so that redeliveries are
    -- byte-identical.
    headers          jsonb       NOT NULL,
    payload          bytea       NOT NULL,
    ce_type          text        NOT NULL,
    not_before       timestamptz NOT NULL,
    status           text        NOT NULL DEFAULT 'pending'
                                 CHECK (status IN ('pending', 'claimed', 'completed')),
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       text,
    claimed_by       text,
    claim_expires_at timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    CONSTRAINT eec_effect_intent_key_unique UNIQUE (idempotency_key),
    CONSTRAINT eec_effect_intent_position_unique UNIQUE (run_id, seq, effect_index),
    CONSTRAINT eec_effect_intent_completed_at
        CHECK ((status = 'completed') = (completed_at IS NOT NULL)),
    CONSTRAINT eec_effect_intent_claim
        CHECK ((status = 'claimed') = (claimed_by IS NOT NULL AND claim_expires_at IS NOT NULL))
);

-- The drainer's scan: due, not yet completed intents in commit order.
CREATE INDEX eec_effect_intent_due_idx
    ON eec_effect_intent (not_before, intent_id)
    WHERE status <> 'completed';
CREATE INDEX eec_effect_intent_completed_idx
    ON eec_effect_intent (completed_at)
    WHERE status = 'completed';

CREATE TABLE eec_routing_idempotency (
    tenant_scope        text        NOT NULL CHECK (length(tenant_scope) BETWEEN 1 AND 128),
    pool_id             text        NOT NULL CHECK (length(pool_id) BETWEEN 1 AND 128),
    -- An empty key opts out of dedup, so it is never stored.
    idempotency_key     text        NOT NULL CHECK (length(idempotency_key) BETWEEN 1 AND 256),
    status              text        NOT NULL
                                    CHECK (status IN ('pending', 'completed', 'failed_before_commit')),
    -- Canonical hash of the request: the same key with a different request
    -- is rejected.
    request_fingerprint text        NOT NULL,
    -- Bumped by every reclaim, so a first caller that lost its row cannot
    -- complete over the new owner.
    claim_epoch         bigint      NOT NULL DEFAULT 1 CHECK (claim_epoch >= 1),
    decision_id         text,
    reserved_at         timestamptz NOT NULL,
    -- A pending row past this is swept to failed_before_commit.
    pending_expires_at  timestamptz NOT NULL,
    -- A completed row past this may be reclaimed for a new decision.
    expires_at          timestamptz,
    completed_at        timestamptz,
    updated_at          timestamptz NOT NULL,
    PRIMARY KEY (tenant_scope, pool_id, idempotency_key),
    CONSTRAINT eec_routing_completed_has_decision
        CHECK ((status = 'completed') = (decision_id IS NOT NULL AND completed_at IS NOT NULL AND expires_at IS NOT NULL))
);

CREATE INDEX eec_routing_idempotency_pending_idx
    ON eec_routing_idempotency (pending_expires_at)
    WHERE status = 'pending';
CREATE INDEX eec_routing_idempotency_expires_idx
    ON eec_routing_idempotency (expires_at)
    WHERE status <> 'pending';
