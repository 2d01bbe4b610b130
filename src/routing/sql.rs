//! The statements over `eec_routing_idempotency`, one per step of a key's
//! life: reserve (with the reads that judge the row it met), fence and
//! complete in the deciding transaction, sweep, and purge. Bound
//! parameters only; every statement that may touch more than one row is
//! bounded by a `LIMIT` its caller passes.
//!
//! In: a key `(tenant_scope, pool_id, idempotency_key)` and the values each
//! statement binds. Out: the SQL text the routing plane and its retention
//! run. Guarantees: a reserve takes over only a `failed_before_commit` row
//! or a `completed` one past its TTL, bumping `claim_epoch`; a completion
//! touches only a `pending` row (the fence, run before it in the same
//! transaction, checks our `claim_epoch`); the purge never deletes a
//! `pending` row.

/// Reserves a key, or reclaims it from a `failed_before_commit` row or a
/// `completed` one past its validity TTL; any other row wins.
pub(super) const RESERVE_SQL: &str = "\
    INSERT INTO eec_routing_idempotency AS r (tenant_scope, pool_id, idempotency_key, status, \
        request_fingerprint, claim_epoch, reserved_at, pending_expires_at, updated_at) \
    VALUES ($1, $2, $3, 'pending', $4, 1, now(), now() + make_interval(secs => $5), now()) \
    ON CONFLICT (tenant_scope, pool_id, idempotency_key) DO UPDATE SET \
        status = 'pending', request_fingerprint = EXCLUDED.request_fingerprint, \
        claim_epoch = r.claim_epoch + 1, decision_id = NULL, decision = NULL, \
        reserved_at = now(), pending_expires_at = EXCLUDED.pending_expires_at, \
        expires_at = NULL, completed_at = NULL, updated_at = now() \
    WHERE r.status = 'failed_before_commit' \
       OR (r.status = 'completed' AND r.expires_at <= now()) \
    RETURNING r.claim_epoch";

/// The row holding a key, and whether its decision is past its validity
/// TTL: what a caller that lost the reservation follows.
pub(super) const EXISTING_SQL: &str = "\
    SELECT status, request_fingerprint, decision, \
        (status = 'completed' AND expires_at <= now()) AS expired \
    FROM eec_routing_idempotency \
    WHERE tenant_scope = $1 AND pool_id = $2 AND idempotency_key = $3";

/// The status of the row holding a key, read before reserving it, to tell
/// a fresh reservation from a reclaimed or an expired one.
pub(super) const STATUS_SQL: &str = "\
    SELECT status FROM eec_routing_idempotency \
    WHERE tenant_scope = $1 AND pool_id = $2 AND idempotency_key = $3";

/// Locks a key's row if it is still `pending` under our `claim_epoch`: the
/// fence the deciding transaction checks before it completes the key.
pub(super) const FENCE_SQL: &str = "\
    SELECT 1 FROM eec_routing_idempotency \
    WHERE tenant_scope = $1 AND pool_id = $2 AND idempotency_key = $3 \
      AND status = 'pending' AND claim_epoch = $4 \
    FOR UPDATE";

/// Completes a `pending` key with its decision and a fresh validity TTL.
pub(super) const COMPLETE_SQL: &str = "\
    UPDATE eec_routing_idempotency SET status = 'completed', decision_id = $4, \
        decision = $5, completed_at = now(), \
        expires_at = now() + make_interval(secs => $6), updated_at = now() \
    WHERE tenant_scope = $1 AND pool_id = $2 AND idempotency_key = $3 AND status = 'pending'";

/// Moves at most `$1` `pending` rows past their deadline to
/// `failed_before_commit`, oldest deadline first, skipping rows in use.
pub(super) const SWEEP_SQL: &str = "\
    UPDATE eec_routing_idempotency SET status = 'failed_before_commit', updated_at = now() \
    WHERE (tenant_scope, pool_id, idempotency_key) IN ( \
        SELECT tenant_scope, pool_id, idempotency_key FROM eec_routing_idempotency \
        WHERE status = 'pending' AND pending_expires_at < now() \
        ORDER BY pending_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)";

/// Deletes at most `$2` rows dead for longer than the retention (`$1`
/// seconds): failed ones, and completed ones past their TTL. A `pending`
/// row is never deleted.
pub(super) const PURGE_SQL: &str = "\
    DELETE FROM eec_routing_idempotency \
    WHERE (tenant_scope, pool_id, idempotency_key) IN ( \
        SELECT tenant_scope, pool_id, idempotency_key FROM eec_routing_idempotency \
        WHERE (status = 'failed_before_commit' \
                AND updated_at < now() - make_interval(secs => $1)) \
           OR (status = 'completed' \
                AND expires_at < now() - make_interval(secs => $1)) \
        LIMIT $2 FOR UPDATE SKIP LOCKED) \
      AND status <> 'pending'";
