//! The operator's picture of the outbox and of retention: what waits to be
//! published (per topic: due, scheduled, deferred, parked, the oldest due
//! age), the parked intents with their errors, their redrive, and what
//! retention will delete next.
//!
//! In: an `admin` key's requests. Out: JSON. Guarantees: the picture reads
//! only undelivered intents (the outbox's own partial index), never the
//! delivered ones awaiting their purge; the parked list and the counts of
//! runs and tombstones are bounded (`PARKED_SHOWN`,
//! `server.count_scan_limit`); a redrive is the one `ductor outbox
//! redrive` always did, and wakes the drainers.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};

use crate::contract::formats::Timestamp;

/// Parked intents the picture lists, oldest first.
pub const PARKED_SHOWN: i64 = 100;

/// What waits to be published to one topic.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TopicBacklog {
    pub topic: String,
    /// Undelivered and not parked.
    pub backlog: i64,
    /// Of the backlog, due now.
    pub due: i64,
    /// Of the backlog, due later (timers).
    pub scheduled: i64,
    /// Of the backlog, held back after failed publishes.
    pub deferred: i64,
    pub parked: i64,
    /// Seconds the oldest due intent has waited; `null` when none is due.
    pub oldest_due_age_s: Option<f64>,
}

/// A parked intent: set aside after `drainer.park_after_failures` failed
/// publishes, until an operator redrives it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ParkedIntent {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub topic: String,
    pub ce_type: String,
    pub publish_failures: i32,
    pub last_error: Option<String>,
    #[schemars(with = "Option<Timestamp>")]
    pub parked_at: Option<DateTime<Utc>>,
}

/// `GET /v1/outbox`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct OutboxPicture {
    pub backlog: i64,
    pub due: i64,
    pub scheduled: i64,
    pub deferred: i64,
    pub parked: i64,
    pub oldest_due_age_s: Option<f64>,
    pub topics: Vec<TopicBacklog>,
    /// The oldest parked intents, at most 100.
    pub parked_intents: Vec<ParkedIntent>,
}

/// `POST /v1/outbox/redrive`'s body: which parked intents (all without
/// either).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    pub run_id: Option<String>,
    pub topic: Option<String>,
}

/// `POST /v1/outbox/redrive`'s answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Redriven {
    pub redriven: u64,
}

/// `GET /v1/retention`: what retention will delete next.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RetentionPicture {
    /// `runs.retention_ms`: finished runs older than this are deleted.
    pub runs_retention_ms: u64,
    /// `runs.tombstone_retention_ms`.
    pub tombstone_retention_ms: u64,
    /// Finished runs past `runs_retention_ms`, due to be purged (counted
    /// up to `server.count_scan_limit`).
    pub runs_due: i64,
    #[schemars(with = "Option<Timestamp>")]
    pub oldest_finished_at: Option<DateTime<Utc>>,
    /// Tombstones kept (counted up to `server.count_scan_limit`).
    pub tombstones: i64,
    /// Tombstones past `tombstone_retention_ms`, due to be purged.
    pub tombstones_due: i64,
    #[schemars(with = "Option<Timestamp>")]
    pub oldest_tombstone_at: Option<DateTime<Utc>>,
    /// Whether a count stopped at `server.count_scan_limit`.
    pub exact: bool,
}

/// The outbox now.
pub async fn picture(pool: &PgPool) -> sqlx::Result<OutboxPicture> {
    let rows = sqlx::query(
        "SELECT topic, \
             count(*) FILTER (WHERE status <> 'parked') AS backlog, \
             count(*) FILTER (WHERE status <> 'parked' AND not_before <= now() \
                 AND (deferred_until IS NULL OR deferred_until <= now())) AS due, \
             count(*) FILTER (WHERE status <> 'parked' AND not_before > now()) AS scheduled, \
             count(*) FILTER (WHERE status <> 'parked' AND not_before <= now() \
                 AND deferred_until > now()) AS deferred, \
             count(*) FILTER (WHERE status = 'parked') AS parked, \
             EXTRACT(EPOCH FROM now() - min(not_before) FILTER (WHERE status <> 'parked' \
                 AND not_before <= now()))::float8 AS oldest_due_age_s \
         FROM eec_effect_intent WHERE status <> 'completed' GROUP BY topic ORDER BY topic",
    )
    .fetch_all(pool)
    .await?;
    let topics = rows
        .iter()
        .map(|r| {
            Ok(TopicBacklog {
                topic: r.try_get("topic")?,
                backlog: r.try_get("backlog")?,
                due: r.try_get("due")?,
                scheduled: r.try_get("scheduled")?,
                deferred: r.try_get("deferred")?,
                parked: r.try_get("parked")?,
                oldest_due_age_s: r.try_get("oldest_due_age_s")?,
            })
        })
        .collect::<sqlx::Result<Vec<_>>>()?;
    let sum = |f: fn(&TopicBacklog) -> i64| topics.iter().map(f).sum::<i64>();
    Ok(OutboxPicture {
        backlog: sum(|t| t.backlog),
        due: sum(|t| t.due),
        scheduled: sum(|t| t.scheduled),
        deferred: sum(|t| t.deferred),
        parked: sum(|t| t.parked),
        oldest_due_age_s: topics
            .iter()
            .filter_map(|t| t.oldest_due_age_s)
            .max_by(f64::total_cmp),
        parked_intents: parked(pool).await?,
        topics,
    })
}

async fn parked(pool: &PgPool) -> sqlx::Result<Vec<ParkedIntent>> {
    let rows = sqlx::query(
        "SELECT run_id, seq, effect_index, topic, ce_type, publish_failures, last_error, \
             parked_at \
         FROM eec_effect_intent WHERE status = 'parked' ORDER BY parked_at, intent_id LIMIT $1",
    )
    .bind(PARKED_SHOWN)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(ParkedIntent {
                run_id: r.try_get("run_id")?,
                seq: r.try_get("seq")?,
                effect_index: r.try_get("effect_index")?,
                topic: r.try_get("topic")?,
                ce_type: r.try_get("ce_type")?,
                publish_failures: r.try_get("publish_failures")?,
                last_error: r.try_get("last_error")?,
                parked_at: r.try_get("parked_at")?,
            })
        })
        .collect()
}

/// What retention will delete next, counting at most `scan_limit` rows
/// of each kind.
pub async fn retention(
    pool: &PgPool,
    runs_retention_ms: u64,
    tombstone_retention_ms: u64,
    scan_limit: i64,
) -> sqlx::Result<RetentionPicture> {
    let seconds = |ms: u64| ms as f64 / 1000.0;
    let row = sqlx::query(
        "SELECT \
             (SELECT count(*) FROM (SELECT 1 FROM runs \
                 WHERE finished_at < now() - make_interval(secs => $1) LIMIT $3) d) AS runs_due, \
             (SELECT min(finished_at) FROM runs WHERE finished_at IS NOT NULL) AS oldest_finished_at, \
             (SELECT count(*) FROM (SELECT 1 FROM run_tombstones LIMIT $3) t) AS tombstones, \
             (SELECT count(*) FROM (SELECT 1 FROM run_tombstones \
                 WHERE purged_at < now() - make_interval(secs => $2) LIMIT $3) t) \
                 AS tombstones_due, \
             (SELECT min(purged_at) FROM run_tombstones) AS oldest_tombstone_at",
    )
    .bind(seconds(runs_retention_ms))
    .bind(seconds(tombstone_retention_ms))
    .bind(scan_limit)
    .fetch_one(pool)
    .await?;
    let (runs_due, tombstones, tombstones_due): (i64, i64, i64) = (
        row.try_get("runs_due")?,
        row.try_get("tombstones")?,
        row.try_get("tombstones_due")?,
    );
    Ok(RetentionPicture {
        runs_retention_ms,
        tombstone_retention_ms,
        runs_due,
        oldest_finished_at: row.try_get("oldest_finished_at")?,
        tombstones,
        tombstones_due,
        oldest_tombstone_at: row.try_get("oldest_tombstone_at")?,
        exact: [runs_due, tombstones, tombstones_due]
            .iter()
            .all(|n| *n < scan_limit),
    })
}
