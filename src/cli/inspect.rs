//! `ductor inspect run`: a run's state, attempts and transition history,
//! or, for a finished run that retention deleted, its tombstone.
//!
//! In: a run id and a pool of the application role. Out: one JSON value:
//! the run's `runs` row with its `run_attempts`, its `run_transitions` in
//! `seq` order and its parked `eec_effect_intent` rows; else its
//! `run_tombstones` row, marked `"purged": true`; else `None`. Guarantees:
//! it only reads; a row that does not decode is an error, never a panic.

use serde_json::{Value, json};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

/// The run as JSON, or `None` when no such run exists (or its tombstone
/// expired too).
pub async fn run(pool: &PgPool, run_id: &str) -> anyhow::Result<Option<Value>> {
    let Some(row) = run_row(pool, run_id).await? else {
        return tombstone(pool, run_id).await;
    };
    let history = History {
        attempts: attempts(pool, run_id).await?,
        transitions: transitions(pool, run_id).await?,
        parked_effects: parked_effects(pool, run_id).await?,
    };
    Ok(Some(run_json(&row, history)?))
}

/// What the report lists under a run, each already as JSON.
struct History {
    attempts: Vec<Value>,
    transitions: Vec<Value>,
    parked_effects: Vec<Value>,
}

/// What retention left of the run, if it deleted it: `"purged": true`,
/// what the run was and when it was deleted.
async fn tombstone(pool: &PgPool, run_id: &str) -> anyhow::Result<Option<Value>> {
    let row = sqlx::query(
        "SELECT run_id, tenant_scope, workflow_name, workflow_version, status, \
             last_transition_seq, created_at, finished_at, purged_at \
         FROM run_tombstones WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(pool)
    .await?;
    let Some(r) = row else { return Ok(None) };
    let at = |name: &str| -> anyhow::Result<String> {
        let t: chrono::DateTime<chrono::Utc> = r.try_get(name)?;
        Ok(crate::contract::effects::rfc3339(t))
    };
    Ok(Some(json!({
        "run_id": r.try_get::<String, _>("run_id")?,
        "purged": true,
        "note": "the run finished and retention (runs.retention_ms) deleted it with its \
                 transitions and attempts; late inputs for it change nothing",
        "tenant": r.try_get::<String, _>("tenant_scope")?,
        "workflow": r.try_get::<String, _>("workflow_name")?,
        "workflow_version": r.try_get::<i32, _>("workflow_version")?,
        "status": r.try_get::<String, _>("status")?,
        "last_transition_seq": r.try_get::<i64, _>("last_transition_seq")?,
        "created_at": at("created_at")?,
        "finished_at": at("finished_at")?,
        "purged_at": at("purged_at")?,
    })))
}

/// The run's own record, if there is such a run.
async fn run_row(pool: &PgPool, run_id: &str) -> anyhow::Result<Option<PgRow>> {
    Ok(sqlx::query(
        "SELECT run_id, tenant_scope, pool_id, workflow_name, workflow_version, status, \
             record_version, last_transition_seq, state, created_at, updated_at, finished_at \
         FROM runs WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(pool)
    .await?)
}

/// Every attempt dispatched for the run's steps, in the order they were
/// dispatched.
async fn attempts(pool: &PgPool, run_id: &str) -> anyhow::Result<Vec<Value>> {
    sqlx::query(
        "SELECT stamp, step_index, attempt, status, dispatched_at, deadline, finished_at, error \
         FROM run_attempts WHERE run_id = $1 ORDER BY dispatched_at, step_index, attempt",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?
    .iter()
    .map(attempt_json)
    .collect()
}

/// The run's transitions in the order they were applied.
async fn transitions(pool: &PgPool, run_id: &str) -> anyhow::Result<Vec<Value>> {
    sqlx::query(
        "SELECT seq, input_ref, kind, from_status, to_status, step_index, detail, source_topic, \
             source_partition, source_offset, created_at \
         FROM run_transitions WHERE run_id = $1 ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?
    .iter()
    .map(transition_json)
    .collect()
}

/// Effects that could not be published, with why: they wait for
/// `ductor outbox redrive`.
async fn parked_effects(pool: &PgPool, run_id: &str) -> anyhow::Result<Vec<Value>> {
    sqlx::query(
        "SELECT seq, effect_index, topic, ce_type, publish_failures, last_error, parked_at \
         FROM eec_effect_intent WHERE run_id = $1 AND status = 'parked' \
         ORDER BY seq, effect_index",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?
    .iter()
    .map(parked_effect_json)
    .collect()
}

/// One attempt: which step it ran, how it ended and by when it had to.
fn attempt_json(r: &PgRow) -> anyhow::Result<Value> {
    Ok(json!({
        "stamp": r.try_get::<uuid::Uuid, _>("stamp")?,
        "step_index": r.try_get::<i32, _>("step_index")?,
        "attempt": r.try_get::<i32, _>("attempt")?,
        "status": r.try_get::<String, _>("status")?,
        "dispatched_at": r.try_get::<chrono::DateTime<chrono::Utc>, _>("dispatched_at")?,
        "deadline": r.try_get::<chrono::DateTime<chrono::Utc>, _>("deadline")?,
        "finished_at": r.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>("finished_at")?,
        "error": r.try_get::<Option<String>, _>("error")?,
    }))
}

/// One transition, with the Kafka position of the input that caused it
/// when it came from Kafka.
fn transition_json(r: &PgRow) -> anyhow::Result<Value> {
    let source = match r.try_get::<Option<String>, _>("source_topic")? {
        Some(topic) => json!({
            "topic": topic,
            "partition": r.try_get::<Option<i32>, _>("source_partition")?,
            "offset": r.try_get::<Option<i64>, _>("source_offset")?,
        }),
        None => Value::Null,
    };
    Ok(json!({
        "seq": r.try_get::<i64, _>("seq")?,
        "input": r.try_get::<String, _>("input_ref")?,
        "kind": r.try_get::<String, _>("kind")?,
        "from_status": r.try_get::<Option<String>, _>("from_status")?,
        "to_status": r.try_get::<String, _>("to_status")?,
        "step_index": r.try_get::<i32, _>("step_index")?,
        "detail": r.try_get::<Value, _>("detail")?,
        "source": source,
        "at": r.try_get::<chrono::DateTime<chrono::Utc>, _>("created_at")?,
    }))
}

/// One parked effect: where it was going, how often its publish failed and
/// the last error.
fn parked_effect_json(r: &PgRow) -> anyhow::Result<Value> {
    Ok(json!({
        "seq": r.try_get::<i64, _>("seq")?,
        "effect_index": r.try_get::<i32, _>("effect_index")?,
        "topic": r.try_get::<String, _>("topic")?,
        "type": r.try_get::<String, _>("ce_type")?,
        "publish_failures": r.try_get::<i32, _>("publish_failures")?,
        "error": r.try_get::<Option<String>, _>("last_error")?,
        "parked_at": r.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>("parked_at")?,
    }))
}

/// The whole report: the run's record, then what happened to it.
fn run_json(row: &PgRow, history: History) -> anyhow::Result<Value> {
    Ok(json!({
        "run_id": row.try_get::<String, _>("run_id")?,
        "tenant_scope": row.try_get::<String, _>("tenant_scope")?,
        "pool_id": row.try_get::<String, _>("pool_id")?,
        "workflow": row.try_get::<String, _>("workflow_name")?,
        "workflow_version": row.try_get::<i32, _>("workflow_version")?,
        "status": row.try_get::<String, _>("status")?,
        "record_version": row.try_get::<i64, _>("record_version")?,
        "last_transition_seq": row.try_get::<i64, _>("last_transition_seq")?,
        "created_at": row.try_get::<chrono::DateTime<chrono::Utc>, _>("created_at")?,
        "updated_at": row.try_get::<chrono::DateTime<chrono::Utc>, _>("updated_at")?,
        "finished_at": row.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>("finished_at")?,
        "state": row.try_get::<Value, _>("state")?,
        "attempts": history.attempts,
        "transitions": history.transitions,
        "parked_effects": history.parked_effects,
    }))
}
