//! Everything the checker reads from Postgres once the system has settled:
//! every run with its transitions, attempts and effect intents, every
//! routing decision, every recorded dead letter and the operator's kept
//! counts of runs. [`super::history`]
//! checks one run's rows against each other; [`super::check`] checks them
//! against the log and the topics.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

/// A `runs` row.
#[derive(Debug, Clone)]
pub struct RunRow {
    pub run_id: String,
    pub tenant: String,
    pub pool: String,
    pub workflow: String,
    pub workflow_version: i32,
    pub status: String,
    pub record_version: i64,
    pub last_transition_seq: i64,
    pub state: Value,
    pub finished: bool,
}

/// A `run_transitions` row.
#[derive(Debug, Clone)]
pub struct TransitionRow {
    pub run_id: String,
    pub seq: i64,
    pub input_ref: String,
    pub kind: String,
    pub from_status: Option<String>,
    pub to_status: String,
    pub step_index: i32,
    pub detail: Value,
    pub source: Option<(String, i32, i64)>,
    pub created_at: DateTime<Utc>,
}

/// A `run_attempts` row.
#[derive(Debug, Clone)]
pub struct AttemptRow {
    pub stamp: Uuid,
    pub run_id: String,
    pub step_index: i32,
    pub attempt: i32,
    pub status: String,
    pub dispatched_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
}

/// An `eec_effect_intent` row.
#[derive(Debug, Clone)]
pub struct IntentRow {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub key: String,
    pub tenant: String,
    pub topic: String,
    pub message_key: Vec<u8>,
    pub headers: Value,
    pub payload: Vec<u8>,
    pub ce_type: String,
    pub not_before: DateTime<Utc>,
    /// When it may be published: `not_before`, or later when it was
    /// deferred (a failed publish backing off, a step clock restarted).
    pub due_at: DateTime<Utc>,
    pub status: String,
}

/// An `eec_routing_idempotency` row.
#[derive(Debug, Clone)]
pub struct RoutingRow {
    pub tenant: String,
    pub pool: String,
    pub key: String,
    pub status: String,
    pub decision_id: Option<String>,
}

/// A `dead_letters` row: where its input was, its class, and its replay.
#[derive(Debug, Clone, Default)]
pub struct LetterRow {
    pub id: i64,
    pub source_topic: String,
    pub source_partition: i32,
    pub source_offset: i64,
    pub class: String,
    /// The replay that claimed it, if one did.
    pub replay_id: Option<String>,
    /// The replay recorded where its record landed.
    pub replayed: bool,
    pub replayed_partition: Option<i32>,
    pub replayed_offset: Option<i64>,
}

impl LetterRow {
    /// Where its input was read.
    pub fn source(&self) -> (String, i32, i64) {
        (
            self.source_topic.clone(),
            self.source_partition,
            self.source_offset,
        )
    }
}

/// A `run_counts` row: the runs of one tenant, workflow version and
/// status, as the operator's counts keep them.
#[derive(Debug, Clone)]
pub struct CountRow {
    pub tenant: String,
    pub workflow: String,
    pub workflow_version: i32,
    pub status: String,
    pub n: i64,
}

/// Everything read from Postgres.
#[derive(Default)]
pub struct DbSnapshot {
    pub runs: Vec<RunRow>,
    pub transitions: Vec<TransitionRow>,
    pub attempts: Vec<AttemptRow>,
    pub intents: Vec<IntentRow>,
    pub routing: Vec<RoutingRow>,
    pub letters: Vec<LetterRow>,
    pub run_counts: Vec<CountRow>,
}

/// Reads every table the checks need, in one snapshot (a repeatable-read
/// transaction), so that rows of different tables (runs and their counts)
/// agree as they did at one instant.
pub async fn load_db(pool: &PgPool) -> anyhow::Result<DbSnapshot> {
    let mut tx = pool.begin().await.context("beginning the snapshot")?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await
        .context("making the snapshot repeatable")?;
    let c = &mut *tx;
    let snapshot = DbSnapshot {
        runs: read_table(c, RUNS, "runs", RunRow::decode).await?,
        transitions: read_table(c, TRANSITIONS, "run_transitions", TransitionRow::decode).await?,
        attempts: read_table(c, ATTEMPTS, "run_attempts", AttemptRow::decode).await?,
        intents: read_table(c, INTENTS, "eec_effect_intent", IntentRow::decode).await?,
        routing: read_table(c, ROUTING, "eec_routing_idempotency", RoutingRow::decode).await?,
        letters: read_table(c, LETTERS, "dead_letters", LetterRow::decode).await?,
        run_counts: read_table(c, RUN_COUNTS, "run_counts", CountRow::decode).await?,
    };
    tx.rollback().await.context("ending the snapshot")?;
    Ok(snapshot)
}

/// The operator's kept counts of runs, and the runs counted the same way
/// (by tenant, workflow, version and status), in one statement's snapshot.
pub async fn run_counts(pool: &PgPool) -> anyhow::Result<(Vec<CountRow>, Vec<CountRow>)> {
    let mut tx = pool.begin().await.context("beginning the snapshot")?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await
        .context("making the snapshot repeatable")?;
    let kept = read_table(&mut tx, RUN_COUNTS, "run_counts", CountRow::decode).await?;
    let counted = read_table(&mut tx, RUNS_COUNTED, "runs", CountRow::decode).await?;
    tx.rollback().await.context("ending the snapshot")?;
    Ok((kept, counted))
}

const RUNS: &str = "SELECT run_id, tenant_scope, pool_id, workflow_name, workflow_version, status, \
         record_version, last_transition_seq, state, finished_at IS NOT NULL AS finished \
     FROM runs";

const TRANSITIONS: &str = "SELECT run_id, seq, input_ref, kind, from_status, to_status, step_index, detail, \
         source_topic, source_partition, source_offset, created_at \
     FROM run_transitions ORDER BY run_id, seq";

const ATTEMPTS: &str = "SELECT stamp, run_id, step_index, attempt, status, dispatched_at, deadline, finished_at, error \
     FROM run_attempts";

/// Intents in the order their transitions committed them; `due_at` is when
/// the outbox may publish one.
const INTENTS: &str = "SELECT run_id, seq, effect_index, idempotency_key, tenant_scope, topic, message_key, \
         headers, payload, ce_type, not_before, \
         GREATEST(not_before, deferred_until) AS due_at, status \
     FROM eec_effect_intent ORDER BY run_id, seq, effect_index";

const ROUTING: &str = "SELECT tenant_scope, pool_id, idempotency_key, status, decision_id \
     FROM eec_routing_idempotency";

const LETTERS: &str = "SELECT id, source_topic, source_partition, source_offset, class, \
         replay_id::text AS replay_id, replayed_at IS NOT NULL AS replayed, replayed_partition, \
         replayed_offset \
     FROM dead_letters ORDER BY id";

const RUN_COUNTS: &str = "SELECT tenant_scope, workflow_name, workflow_version, status, n \
     FROM run_counts";

const RUNS_COUNTED: &str = "SELECT tenant_scope, workflow_name, workflow_version, status, \
         count(*) AS n \
     FROM runs GROUP BY 1, 2, 3, 4";

/// Every row `sql` selects from `table`, each decoded by `decode`.
async fn read_table<T>(
    conn: &mut PgConnection,
    sql: &str,
    table: &str,
    decode: impl Fn(&PgRow) -> sqlx::Result<T>,
) -> anyhow::Result<Vec<T>> {
    let rows = sqlx::query(sql)
        .fetch_all(conn)
        .await
        .with_context(|| format!("reading {table}"))?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        out.push(decode(row)?);
    }
    Ok(out)
}

impl RunRow {
    fn decode(row: &PgRow) -> sqlx::Result<RunRow> {
        Ok(RunRow {
            run_id: row.try_get("run_id")?,
            tenant: row.try_get("tenant_scope")?,
            pool: row.try_get("pool_id")?,
            workflow: row.try_get("workflow_name")?,
            workflow_version: row.try_get("workflow_version")?,
            status: row.try_get("status")?,
            record_version: row.try_get("record_version")?,
            last_transition_seq: row.try_get("last_transition_seq")?,
            state: row.try_get("state")?,
            finished: row.try_get("finished")?,
        })
    }
}

impl TransitionRow {
    fn decode(row: &PgRow) -> sqlx::Result<TransitionRow> {
        let topic: Option<String> = row.try_get("source_topic")?;
        let partition: Option<i32> = row.try_get("source_partition")?;
        let offset: Option<i64> = row.try_get("source_offset")?;
        Ok(TransitionRow {
            run_id: row.try_get("run_id")?,
            seq: row.try_get("seq")?,
            input_ref: row.try_get("input_ref")?,
            kind: row.try_get("kind")?,
            from_status: row.try_get("from_status")?,
            to_status: row.try_get("to_status")?,
            step_index: row.try_get("step_index")?,
            detail: row.try_get("detail")?,
            // An input decided over HTTP has no Kafka position.
            source: match (topic, partition, offset) {
                (Some(t), Some(p), Some(o)) => Some((t, p, o)),
                _ => None,
            },
            created_at: row.try_get("created_at")?,
        })
    }
}

impl AttemptRow {
    fn decode(row: &PgRow) -> sqlx::Result<AttemptRow> {
        Ok(AttemptRow {
            stamp: row.try_get("stamp")?,
            run_id: row.try_get("run_id")?,
            step_index: row.try_get("step_index")?,
            attempt: row.try_get("attempt")?,
            status: row.try_get("status")?,
            dispatched_at: row.try_get("dispatched_at")?,
            deadline: row.try_get("deadline")?,
            finished_at: row.try_get("finished_at")?,
            error: row.try_get("error")?,
        })
    }
}

impl IntentRow {
    fn decode(row: &PgRow) -> sqlx::Result<IntentRow> {
        Ok(IntentRow {
            run_id: row.try_get("run_id")?,
            seq: row.try_get("seq")?,
            effect_index: row.try_get("effect_index")?,
            key: row.try_get("idempotency_key")?,
            tenant: row.try_get("tenant_scope")?,
            topic: row.try_get("topic")?,
            message_key: row.try_get("message_key")?,
            headers: row.try_get("headers")?,
            payload: row.try_get("payload")?,
            ce_type: row.try_get("ce_type")?,
            not_before: row.try_get("not_before")?,
            due_at: row.try_get("due_at")?,
            status: row.try_get("status")?,
        })
    }
}

impl RoutingRow {
    fn decode(row: &PgRow) -> sqlx::Result<RoutingRow> {
        Ok(RoutingRow {
            tenant: row.try_get("tenant_scope")?,
            pool: row.try_get("pool_id")?,
            key: row.try_get("idempotency_key")?,
            status: row.try_get("status")?,
            decision_id: row.try_get("decision_id")?,
        })
    }
}

impl LetterRow {
    fn decode(row: &PgRow) -> sqlx::Result<LetterRow> {
        Ok(LetterRow {
            id: row.try_get("id")?,
            source_topic: row.try_get("source_topic")?,
            source_partition: row.try_get("source_partition")?,
            source_offset: row.try_get("source_offset")?,
            class: row.try_get("class")?,
            replay_id: row.try_get("replay_id")?,
            replayed: row.try_get("replayed")?,
            replayed_partition: row.try_get("replayed_partition")?,
            replayed_offset: row.try_get("replayed_offset")?,
        })
    }
}

impl CountRow {
    fn decode(row: &PgRow) -> sqlx::Result<CountRow> {
        Ok(CountRow {
            tenant: row.try_get("tenant_scope")?,
            workflow: row.try_get("workflow_name")?,
            workflow_version: row.try_get("workflow_version")?,
            status: row.try_get("status")?,
            n: row.try_get("n")?,
        })
    }
}
