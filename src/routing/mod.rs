//! The routing plane: turns an idempotent start request into exactly one
//! decision (a run) per `(tenant_scope, pool_id, idempotency_key)`.
//!
//! `eec_routing_idempotency` rows move pending → completed |
//! failed_before_commit:
//!
//! - **reserve** is one `INSERT ... ON CONFLICT DO UPDATE ... WHERE` whose
//!   `WHERE` is the reclaim clause: a `failed_before_commit` row, or a
//!   `completed` row past its validity TTL, is taken over (its `claim_epoch`
//!   bumped); any other existing row wins and the caller is a duplicate;
//! - **complete** happens in the transaction that creates the run: the row is
//!   updated to `completed` with the decision, fenced on
//!   `status = 'pending' AND claim_epoch = <ours>`, so a caller whose row was
//!   swept and reclaimed meanwhile cannot complete over the new owner;
//! - the **sweeper** moves `pending` rows past their deadline to
//!   `failed_before_commit`, the **retention** worker deletes long-dead rows in
//!   bounded batches and never touches a `pending` row.
//!
//! An empty key opts out of deduplication. The same key with a different
//! request (by canonical fingerprint, envelope fields excluded) is rejected.
//! Requests read from Kafka reserve and decide in the ingress batch's own
//! transaction; HTTP requests reserve first, so that duplicates arriving while
//! the first caller is in flight see a `pending` row and follow the pool's
//! duplicate-waiter policy.
//!
//! In: start requests, from the ingress (inside its batch's transaction) or
//! from [`crate::api`] (reserved first). Out: a [`RouteOutcome`] per
//! request, and the rows of `eec_routing_idempotency`. Guarantees: one
//! decision per key while the key's decision is valid; the HTTP face, its
//! errors and its handlers live in [`crate::api`], not here.

mod decide;
pub mod retention;
mod sql;

pub use decide::{Decide, DecideError};

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sqlx::{Postgres, Row, Transaction as PgTx};

use self::sql::{COMPLETE_SQL, EXISTING_SQL, FENCE_SQL, RESERVE_SQL, STATUS_SQL};
use crate::config::{DuplicatePolicy, RoutingConfig};
use crate::contract::{
    Input, InputError, InputErrorClass, InputTopic, RunStart, decode_value, formats,
};

/// Longest idempotency key accepted, in characters.
pub const MAX_KEY_LEN: usize = crate::contract::input::MAX_IDEMPOTENCY_KEY_LEN;

/// The decision returned to every caller with the same key: the first gets it
/// with 201, duplicates with 200, byte for byte the same body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "Decision")]
pub struct RoutingDecision {
    #[schemars(with = "formats::Id")]
    pub run_id: String,
    #[schemars(with = "formats::Id")]
    pub tenant: String,
    #[schemars(with = "formats::Name")]
    pub pool: String,
    #[schemars(with = "formats::Name")]
    pub workflow: String,
    #[schemars(range(min = 1))]
    pub workflow_version: u32,
    /// `null` when the caller opted out of deduplication.
    #[schemars(with = "Option<formats::Text<1, MAX_KEY_LEN>>")]
    pub idempotency_key: Option<String>,
    #[schemars(with = "formats::Timestamp")]
    pub decided_at: DateTime<Utc>,
}

/// A start request on its way to a decision.
#[derive(Debug, Clone)]
pub struct RouteRequest {
    /// The start as the coordinator will fold it; its `run_id` is the
    /// decision this request makes if it wins.
    pub start: RunStart,
    /// `None`: the caller opted out (empty key); always a fresh decision.
    pub key: Option<String>,
    pub fingerprint: String,
    pub reservation: Reservation,
    /// Where a Kafka request came from; kept on the run's first transition.
    pub source: Option<crate::contract::Source>,
    /// The trace context the request carried (its message's headers, or
    /// the span of the HTTP request that made it).
    pub trace: Option<crate::contract::TraceContext>,
}

#[cfg(test)]
impl RouteRequest {
    /// A Kafka start of the example workflow with idempotency key `key`.
    pub(crate) fn keyed(tenant: &str, key: &str) -> RouteRequest {
        RouteRequest {
            start: RunStart {
                run_id: format!("run-{key}"),
                tenant: tenant.into(),
                workflow: "example".into(),
                workflow_version: None,
                pool: "default".into(),
                input: Value::Null,
                correlation_id: None,
                parent: None,
            },
            key: Some(key.into()),
            fingerprint: String::new(),
            reservation: Reservation::InTransaction,
            source: None,
            trace: None,
        }
    }
}

/// How a request holds its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// Reserve inside the deciding transaction (the Kafka path): the pending
    /// state is never visible to others.
    InTransaction,
    /// Reserved earlier by this caller with this claim epoch (the HTTP path).
    Held { epoch: i64 },
}

/// What routing did with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum RouteOutcome {
    /// A new run; `kind` says whether the row was new, reclaimed from a
    /// failed caller, or renewed after its TTL.
    Decided {
        decision: RoutingDecision,
        kind: ReserveKind,
    },
    /// The key already has a valid decision for the same request.
    Duplicate { decision: RoutingDecision },
    /// The key already has a decision for a different request.
    Mismatch,
    /// Our reservation was swept and taken over by another caller.
    ClaimLost,
    /// The start itself was rejected (e.g. unknown workflow).
    Rejected(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveKind {
    Fresh,
    Reclaimed,
    Expired,
    Unkeyed,
}

impl ReserveKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ReserveKind::Fresh => "fresh",
            ReserveKind::Reclaimed => "reclaimed",
            ReserveKind::Expired => "expired",
            ReserveKind::Unkeyed => "fresh",
        }
    }
}

/// The canonical fingerprint of a start request (see
/// [`crate::contract::fingerprint`]).
pub fn fingerprint(start: &RunStart) -> String {
    crate::contract::fingerprint::start(start)
}

/// Reads a start request that asks for a server-chosen decision: a
/// `run.start` without `run_id`, with an optional `idempotency_key`. `None`
/// when the value carries a `run_id` (a client-chosen run, handled by the
/// coordinator directly). `default_key` is used when the request names no key
/// (for Kafka: its topic, partition and offset, so a redelivery is never a
/// second run); an explicit empty key opts out.
pub fn decode_route_request(
    value: &Value,
    default_key: Option<String>,
) -> Result<Option<RouteRequest>, InputError> {
    let Value::Object(obj) = value else {
        return Ok(None);
    };
    if obj.get("type").and_then(Value::as_str) != Some("run.start") {
        return Ok(None);
    }
    let key = match obj.get("idempotency_key") {
        None | Some(Value::Null) => default_key,
        Some(Value::String(k)) if k.is_empty() => None,
        Some(Value::String(k)) if k.chars().count() <= MAX_KEY_LEN => Some(k.clone()),
        Some(Value::String(_)) => {
            return Err(InputError::new(
                InputErrorClass::Invalid,
                format!("idempotency_key: longer than {MAX_KEY_LEN} characters"),
            ));
        }
        Some(_) => {
            return Err(InputError::new(
                InputErrorClass::Invalid,
                "idempotency_key: must be a string",
            ));
        }
    };
    match obj.get("run_id") {
        None | Some(Value::Null) => {}
        Some(_) if obj.contains_key("idempotency_key") => {
            return Err(InputError::new(
                InputErrorClass::Invalid,
                "run.start takes either run_id (a client-chosen run) or idempotency_key, not both",
            ));
        }
        Some(_) => return Ok(None),
    }
    let mut with_id: Map<String, Value> = obj.clone();
    with_id.insert(
        "run_id".into(),
        Value::String(uuid::Uuid::new_v4().to_string()),
    );
    let Input::Start(mut start) = decode_value(InputTopic::Requests, &Value::Object(with_id))?
    else {
        return Ok(None);
    };
    // A child run's start is decided as the run its parent's attempt
    // names (the stamp, a random UUID), so that the parent can cancel it
    // without learning its id.
    if let Some(parent) = &start.parent {
        start.run_id = parent.stamp.to_string();
    }
    let fingerprint = fingerprint(&start);
    Ok(Some(RouteRequest {
        start,
        key,
        fingerprint,
        reservation: Reservation::InTransaction,
        source: None,
        trace: None,
    }))
}

/// The existing row for a key, as a duplicate sees it.
#[derive(Debug, Clone)]
pub struct ExistingRow {
    pub status: KeyStatus,
    pub fingerprint: String,
    pub decision: Option<RoutingDecision>,
    pub expired: bool,
}

/// Where an `eec_routing_idempotency` row is in its lifecycle: reserved
/// (`pending`), decided (`completed`, the decision kept until its validity
/// ends), or given up by the sweeper (`failed_before_commit`, free to be
/// reclaimed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    Pending,
    Completed,
    FailedBeforeCommit,
}

impl KeyStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyStatus::Pending => "pending",
            KeyStatus::Completed => "completed",
            KeyStatus::FailedBeforeCommit => "failed_before_commit",
        }
    }

    /// The status as stored; the table's CHECK constraint allows no other.
    fn from_column(status: String) -> Result<KeyStatus, sqlx::Error> {
        [
            KeyStatus::Pending,
            KeyStatus::Completed,
            KeyStatus::FailedBeforeCommit,
        ]
        .into_iter()
        .find(|s| s.as_str() == status)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown routing status {status:?}").into()))
    }
}

impl ReserveKind {
    /// What kind of reservation a won claim was, from the row's status
    /// before it: none, a completed row past its validity, or one the
    /// sweeper gave up.
    pub fn judged(before: Option<KeyStatus>) -> ReserveKind {
        match before {
            None => ReserveKind::Fresh,
            Some(KeyStatus::Completed) => ReserveKind::Expired,
            Some(_) => ReserveKind::Reclaimed,
        }
    }
}

/// What a caller that did not win the key does next, judged from the row
/// that holds it: the duplicate-waiter as a state machine.
#[derive(Debug, Clone, PartialEq)]
pub enum WaiterStep {
    /// The key was used for a different request (which is not echoed back).
    Mismatch,
    /// The key was decided: this is the decision (`None`: a completed row
    /// without one, which the schema forbids).
    Decided(Option<RoutingDecision>),
    /// Another caller is deciding and the policy is to answer at once.
    Busy,
    /// Another caller is still deciding at the deadline.
    TimedOut,
    /// Another caller is deciding: look again shortly.
    Wait,
    /// The row is free to take (given up, or past its validity): reserve again.
    Reserve,
}

/// The next step of a caller with `fingerprint` that found `row` holding its
/// key, under `policy`; `past_deadline` once its wait is over.
pub fn waiter_step(
    row: &ExistingRow,
    fingerprint: &str,
    policy: DuplicatePolicy,
    past_deadline: bool,
) -> WaiterStep {
    let live = !row.expired && matches!(row.status, KeyStatus::Completed | KeyStatus::Pending);
    if live && row.fingerprint != fingerprint {
        return WaiterStep::Mismatch;
    }
    match row.status {
        KeyStatus::Completed if !row.expired => WaiterStep::Decided(row.decision.clone()),
        KeyStatus::Pending if policy == DuplicatePolicy::Reject => WaiterStep::Busy,
        KeyStatus::Pending if past_deadline => WaiterStep::TimedOut,
        KeyStatus::Pending => WaiterStep::Wait,
        KeyStatus::Completed | KeyStatus::FailedBeforeCommit => WaiterStep::Reserve,
    }
}

/// Reserves `(tenant, pool, key)`, reclaiming a failed or expired row; on an
/// executor that is either the pool (autocommit) or a transaction.
pub async fn reserve<'e, E>(
    executor: E,
    tenant: &str,
    pool_id: &str,
    key: &str,
    fingerprint: &str,
    pending_ttl: Duration,
) -> Result<Option<i64>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    sqlx::query_scalar(RESERVE_SQL)
        .bind(tenant)
        .bind(pool_id)
        .bind(key)
        .bind(fingerprint)
        .bind(pending_ttl.as_secs_f64())
        .fetch_optional(executor)
        .await
}

pub async fn existing<'e, E>(
    executor: E,
    tenant: &str,
    pool_id: &str,
    key: &str,
) -> Result<Option<ExistingRow>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let row = sqlx::query(EXISTING_SQL)
        .bind(tenant)
        .bind(pool_id)
        .bind(key)
        .fetch_optional(executor)
        .await?;
    let Some(row) = row else { return Ok(None) };
    let decision: Option<Value> = row.try_get("decision")?;
    Ok(Some(ExistingRow {
        status: KeyStatus::from_column(row.try_get("status")?)?,
        fingerprint: row.try_get("request_fingerprint")?,
        decision: decision.and_then(|d| serde_json::from_value(d).ok()),
        expired: row.try_get("expired")?,
    }))
}

/// What kind of reservation a won claim was, judged from the row before it.
async fn kind_before<'e, E>(
    executor: E,
    tenant: &str,
    pool_id: &str,
    key: &str,
) -> Result<ReserveKind, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let status: Option<String> = sqlx::query_scalar(STATUS_SQL)
        .bind(tenant)
        .bind(pool_id)
        .bind(key)
        .fetch_optional(executor)
        .await?;
    let before = status.map(KeyStatus::from_column).transpose()?;
    Ok(ReserveKind::judged(before))
}

/// What reserving a key inside the deciding transaction met.
#[derive(Debug)]
pub enum Reserved {
    /// The key is this request's to decide; how the row was taken.
    Won(ReserveKind),
    /// Another row holds the key: its state, to judge the request by.
    Taken(ExistingRow),
}

/// Reserve inside the deciding transaction.
pub async fn reserve_in_tx(
    tx: &mut PgTx<'_, Postgres>,
    request: &RouteRequest,
    key: &str,
    pending_ttl: Duration,
) -> Result<Reserved, sqlx::Error> {
    let start = &request.start;
    let kind = kind_before(&mut **tx, &start.tenant, &start.pool, key).await?;
    let won = reserve(
        &mut **tx,
        &start.tenant,
        &start.pool,
        key,
        &request.fingerprint,
        pending_ttl,
    )
    .await?;
    if won.is_some() {
        return Ok(Reserved::Won(kind));
    }
    let row = existing(&mut **tx, &start.tenant, &start.pool, key)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    Ok(Reserved::Taken(row))
}

/// Checks that a held reservation is still ours; locks the row.
pub async fn fence_in_tx(
    tx: &mut PgTx<'_, Postgres>,
    start: &RunStart,
    key: &str,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    let held = sqlx::query(FENCE_SQL)
        .bind(&start.tenant)
        .bind(&start.pool)
        .bind(key)
        .bind(epoch)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(held.is_some())
}

/// Marks the key completed with its decision and a fresh validity TTL.
pub async fn complete_in_tx(
    tx: &mut PgTx<'_, Postgres>,
    decision: &RoutingDecision,
    key: &str,
    completed_ttl: Duration,
) -> Result<bool, sqlx::Error> {
    let body = serde_json::to_value(decision).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let done = sqlx::query(COMPLETE_SQL)
        .bind(&decision.tenant)
        .bind(&decision.pool)
        .bind(key)
        .bind(&decision.run_id)
        .bind(body)
        .bind(completed_ttl.as_secs_f64())
        .execute(&mut **tx)
        .await?
        .rows_affected();
    Ok(done == 1)
}

/// The duplicate-waiter policy of a pool.
pub fn policy_for(config: &RoutingConfig, pool: &str) -> (DuplicatePolicy, Duration) {
    let pool_cfg = config.pools.get(pool);
    let policy = pool_cfg
        .and_then(|p| p.duplicate_policy)
        .unwrap_or(config.duplicate_policy);
    let wait = pool_cfg
        .and_then(|p| p.wait_timeout_ms)
        .unwrap_or(config.wait_timeout_ms);
    (policy, Duration::from_millis(wait))
}

/// Every `outcome` of `ductor_routing_requests_total`, which starts each
/// at zero: a new decision (`fresh`, or taking over a `reclaimed` or an
/// `expired` key), the decision of an earlier request (`duplicate`, or
/// `waited` for), and the refusals.
pub const OUTCOMES: [&str; 10] = [
    "fresh",
    "reclaimed",
    "expired",
    "duplicate",
    "waited",
    "mismatch",
    "rejected",
    "rejected_request",
    "in_progress",
    "claim_lost",
];

/// Counts a routed start by its outcome; a `mismatch` is also counted as
/// the routed path's idempotency mismatch.
pub fn count(outcome: &'static str) {
    debug_assert!(OUTCOMES.contains(&outcome), "{outcome} is not listed");
    metrics::counter!("ductor_routing_requests_total", "outcome" => outcome).increment(1);
    if outcome == "mismatch" {
        count_mismatch(MismatchPath::RoutedStart);
    }
}

/// The dedup path on which a request reused a key with another meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MismatchPath {
    /// A server-chosen start whose idempotency key holds another request.
    RoutedStart,
    /// A client-chosen start of an existing run, with another request.
    ClientStart,
    /// A signal under a recorded `signal_id`, with another name or payload.
    Signal,
}

impl MismatchPath {
    /// Every path: the mismatch counter starts each at zero.
    pub const ALL: [MismatchPath; 3] = [
        MismatchPath::RoutedStart,
        MismatchPath::ClientStart,
        MismatchPath::Signal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MismatchPath::RoutedStart => "routed_start",
            MismatchPath::ClientStart => "client_start",
            MismatchPath::Signal => "signal",
        }
    }
}

/// Counts one request refused as `idempotency_mismatch`, by its path.
pub fn count_mismatch(path: MismatchPath) {
    metrics::counter!("ductor_routing_idempotency_mismatches_total", "path" => path.as_str())
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: KeyStatus, fingerprint: &str, expired: bool) -> ExistingRow {
        ExistingRow {
            status,
            fingerprint: fingerprint.into(),
            decision: None,
            expired,
        }
    }

    #[test]
    fn a_waiter_follows_the_key_until_it_is_decided_refused_or_free() {
        use KeyStatus::*;
        use WaiterStep::*;
        let wait = DuplicatePolicy::Wait;
        let cases = [
            (row(Pending, "a", false), wait, false, Wait),
            (row(Pending, "a", false), wait, true, TimedOut),
            (
                row(Pending, "a", false),
                DuplicatePolicy::Reject,
                false,
                Busy,
            ),
            (row(Pending, "b", false), wait, false, Mismatch),
            (row(Completed, "a", false), wait, false, Decided(None)),
            (row(Completed, "b", false), wait, false, Mismatch),
            (row(Completed, "b", true), wait, false, Reserve),
            (row(FailedBeforeCommit, "b", false), wait, false, Reserve),
        ];
        for (row, policy, past_deadline, step) in cases {
            assert_eq!(
                waiter_step(&row, "a", policy, past_deadline),
                step,
                "{row:?} {policy:?} past_deadline={past_deadline}"
            );
        }
    }

    #[test]
    fn a_won_reservation_is_judged_by_the_row_before_it() {
        assert_eq!(ReserveKind::judged(None), ReserveKind::Fresh);
        assert_eq!(
            ReserveKind::judged(Some(KeyStatus::Completed)),
            ReserveKind::Expired
        );
        assert_eq!(
            ReserveKind::judged(Some(KeyStatus::FailedBeforeCommit)),
            ReserveKind::Reclaimed
        );
    }
}
