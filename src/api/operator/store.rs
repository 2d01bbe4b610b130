//! What the operator's views read from Postgres: pages of runs, their
//! counts, and one run's history with the effects each transition made.
//!
//! In: a [`RunQuery`] or a run id, and the tenant the caller sees (`None`:
//! every tenant). Out: rows as the views' types. Guarantees: only reads;
//! a page is one keyset scan of an index of `runs` in (created_at, run_id)
//! order (see migrations/20261205000019_operator_runs.sql); the counts of
//! a filter of tenant, workflow and version read `run_counts`, any other
//! filter counts at most `server.count_scan_limit` runs and says so; a
//! run of another tenant is never read.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Postgres, QueryBuilder, Row};

use super::query::{Cursor, RunFilter, RunQuery};
use super::views::{
    AttemptView, EffectView, PublishStatus, RunCounts, RunHistory, RunItem, RunPage, TransitionView,
};

const RUN_COLUMNS: &str = "run_id, tenant_scope, pool_id, workflow_name, workflow_version, \
    status, (state->>'step_index')::int AS step_index, (state->>'attempt')::int AS attempt, \
    correlation_id, last_transition_seq, created_at, updated_at, finished_at";

/// Which statement of the views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statement {
    /// A page of runs.
    Page,
    /// Counts by status.
    Counts,
}

/// The statement of `query`'s page (one more run than the page holds,
/// which tells whether another page follows) or of its filter's counts
/// (from the kept counts where they answer, else at most `scan_limit`
/// runs counted), after `prefix`.
fn statement<'a>(
    prefix: &str,
    which: Statement,
    query: &'a RunQuery,
    scan_limit: i64,
) -> QueryBuilder<'a, Postgres> {
    let filter = &query.filter;
    let mut sql = QueryBuilder::<Postgres>::new(prefix);
    match which {
        Statement::Page => {
            sql.push(format!("SELECT {RUN_COLUMNS} FROM runs"));
            push_filter(&mut sql, filter, query.after.as_ref());
            let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
            sql.push(" ORDER BY created_at DESC, run_id DESC LIMIT ")
                .push_bind(limit.saturating_add(1));
        }
        Statement::Counts if filter.counted_exactly() => {
            sql.push("SELECT status, sum(n)::int8 AS n FROM run_counts WHERE true");
            push_eq(&mut sql, "tenant_scope", filter.tenant.as_deref());
            push_eq(&mut sql, "workflow_name", filter.workflow.as_deref());
            if let Some(version) = filter.version {
                sql.push(" AND workflow_version = ").push_bind(version);
            }
            push_eq(&mut sql, "status", filter.status.map(|s| s.as_str()));
            sql.push(" GROUP BY status");
        }
        Statement::Counts => {
            sql.push("SELECT status, count(*) AS n FROM (SELECT status FROM runs");
            push_filter(&mut sql, filter, None);
            sql.push(" LIMIT ")
                .push_bind(scan_limit)
                .push(") s GROUP BY status");
        }
    }
    sql
}

/// Postgres's plan (`EXPLAIN (FORMAT JSON)`) of a statement of the views:
/// what shows that it does not read the whole table.
#[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
pub async fn explain(
    pool: &PgPool,
    which: Statement,
    query: &RunQuery,
    scan_limit: i64,
) -> sqlx::Result<Value> {
    let mut sql = statement("EXPLAIN (FORMAT JSON) ", which, query, scan_limit);
    sql.build().fetch_one(pool).await?.try_get(0)
}

/// One page of the runs `query` finds, newest first.
pub async fn page(pool: &PgPool, query: &RunQuery) -> sqlx::Result<RunPage> {
    let mut sql = statement("", Statement::Page, query, 0);
    let rows = sql.build().fetch_all(pool).await?;
    let mut runs = rows
        .iter()
        .map(run_item)
        .collect::<sqlx::Result<Vec<_>>>()?;
    let next = if runs.len() > query.limit {
        runs.truncate(query.limit);
        runs.last().map(|r| {
            Cursor {
                created_at: r.created_at,
                run_id: r.run_id.clone(),
            }
            .encode()
        })
    } else {
        None
    };
    Ok(RunPage { runs, next })
}

/// The runs `query`'s filter finds, by status: from the kept counts when
/// the filter is one of tenant, workflow, version and status, else by
/// counting at most `scan_limit` runs.
pub async fn counts(pool: &PgPool, query: &RunQuery, scan_limit: i64) -> sqlx::Result<RunCounts> {
    let mut sql = statement("", Statement::Counts, query, scan_limit);
    let rows = sql.build().fetch_all(pool).await?;
    let filter = &query.filter;
    let mut counts = RunCounts::default();
    for row in &rows {
        let status: String = row.try_get("status")?;
        let n: i64 = row.try_get("n")?;
        counts.add(&status, n.max(0));
    }
    counts.exact = filter.counted_exactly() || counts.total < scan_limit;
    Ok(counts)
}

fn push_eq<'a>(sql: &mut QueryBuilder<'a, Postgres>, column: &str, value: Option<&'a str>) {
    if let Some(value) = value {
        sql.push(format!(" AND {column} = ")).push_bind(value);
    }
}

/// ` WHERE ...` of `filter`, and of the page after `after`.
fn push_filter<'a>(
    sql: &mut QueryBuilder<'a, Postgres>,
    filter: &'a RunFilter,
    after: Option<&'a Cursor>,
) {
    sql.push(" WHERE true");
    push_eq(sql, "tenant_scope", filter.tenant.as_deref());
    push_eq(sql, "workflow_name", filter.workflow.as_deref());
    if let Some(version) = filter.version {
        sql.push(" AND workflow_version = ").push_bind(version);
    }
    push_eq(sql, "status", filter.status.map(|s| s.as_str()));
    if let Some(step) = filter.step {
        sql.push(" AND (state->>'step_index')::int = ")
            .push_bind(step);
    }
    push_eq(sql, "correlation_id", filter.correlation_id.as_deref());
    if let Some(t) = filter.created_after {
        sql.push(" AND created_at >= ").push_bind(t);
    }
    if let Some(t) = filter.created_before {
        sql.push(" AND created_at < ").push_bind(t);
    }
    if let Some(cursor) = after {
        sql.push(" AND (created_at, run_id) < (")
            .push_bind(cursor.created_at)
            .push(", ")
            .push_bind(cursor.run_id.as_str())
            .push(")");
    }
}

fn run_item(row: &PgRow) -> sqlx::Result<RunItem> {
    Ok(RunItem {
        run_id: row.try_get("run_id")?,
        tenant: row.try_get("tenant_scope")?,
        pool: row.try_get("pool_id")?,
        workflow: row.try_get("workflow_name")?,
        workflow_version: row.try_get("workflow_version")?,
        status: row.try_get("status")?,
        step_index: row.try_get::<Option<i32>, _>("step_index")?.unwrap_or(0),
        attempt: row.try_get::<Option<i32>, _>("attempt")?.unwrap_or(0),
        correlation_id: row.try_get("correlation_id")?,
        last_transition_seq: row.try_get("last_transition_seq")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

/// The run `run_id` with its attempts, transitions and their effects, if
/// the caller sees it.
pub async fn history(
    pool: &PgPool,
    run_id: &str,
    tenant: Option<&str>,
    now: DateTime<Utc>,
) -> sqlx::Result<Option<RunHistory>> {
    let row = sqlx::query(&format!(
        "SELECT {RUN_COLUMNS}, state FROM runs \
         WHERE run_id = $1 AND ($2::text IS NULL OR tenant_scope = $2)"
    ))
    .bind(run_id)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let run = run_item(&row)?;
    let state: Value = row.try_get("state")?;
    let attempts = attempts(pool, run_id).await?;
    let mut transitions = transitions(pool, run_id).await?;
    for effect in effects(pool, run_id, now).await? {
        if let Some(t) = transitions.iter_mut().find(|t| t.seq == effect.0) {
            t.effects.push(effect.1);
        }
    }
    Ok(Some(RunHistory {
        input: state.get("input").cloned().unwrap_or(Value::Null),
        output: state.get("output").cloned().unwrap_or(Value::Null),
        error: state.get("error").cloned().unwrap_or(Value::Null),
        waiting: state.get("waiting").cloned().unwrap_or(Value::Null),
        pending_retry: state.get("pending_retry").cloned().unwrap_or(Value::Null),
        run,
        attempts,
        transitions,
    }))
}

async fn attempts(pool: &PgPool, run_id: &str) -> sqlx::Result<Vec<AttemptView>> {
    let rows = sqlx::query(
        "SELECT stamp, step_index, attempt, status, dispatched_at, deadline, finished_at, error \
         FROM run_attempts WHERE run_id = $1 ORDER BY dispatched_at, step_index, attempt",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(AttemptView {
                stamp: r.try_get::<uuid::Uuid, _>("stamp")?.to_string(),
                step_index: r.try_get("step_index")?,
                attempt: r.try_get("attempt")?,
                status: r.try_get("status")?,
                dispatched_at: r.try_get("dispatched_at")?,
                deadline: r.try_get("deadline")?,
                finished_at: r.try_get("finished_at")?,
                error: r.try_get("error")?,
            })
        })
        .collect()
}

async fn transitions(pool: &PgPool, run_id: &str) -> sqlx::Result<Vec<TransitionView>> {
    let rows = sqlx::query(
        "SELECT seq, kind, input_ref, from_status, to_status, step_index, detail, \
             source_topic, source_partition, source_offset, created_at \
         FROM run_transitions WHERE run_id = $1 ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(TransitionView {
                seq: r.try_get("seq")?,
                kind: r.try_get("kind")?,
                input_ref: r.try_get("input_ref")?,
                from_status: r.try_get("from_status")?,
                to_status: r.try_get("to_status")?,
                step_index: r.try_get("step_index")?,
                detail: r.try_get("detail")?,
                source_topic: r.try_get("source_topic")?,
                source_partition: r.try_get("source_partition")?,
                source_offset: r.try_get("source_offset")?,
                created_at: r.try_get("created_at")?,
                effects: Vec::new(),
            })
        })
        .collect()
}

/// The run's effects the outbox still holds, with the transition (`seq`)
/// each belongs to. Delivered ones stay until the outbox purges them
/// (`drainer.retention_ms`).
async fn effects(
    pool: &PgPool,
    run_id: &str,
    now: DateTime<Utc>,
) -> sqlx::Result<Vec<(i64, EffectView)>> {
    let rows = sqlx::query(
        "SELECT seq, effect_index, idempotency_key, topic, ce_type, status, not_before, \
             deferred_until, attempts, publish_failures, last_error, completed_at, parked_at \
         FROM eec_effect_intent WHERE run_id = $1 ORDER BY seq, effect_index",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let status: String = r.try_get("status")?;
            let not_before: DateTime<Utc> = r.try_get("not_before")?;
            let deferred_until: Option<DateTime<Utc>> = r.try_get("deferred_until")?;
            let view = EffectView {
                effect_index: r.try_get("effect_index")?,
                idempotency_key: r.try_get("idempotency_key")?,
                topic: r.try_get("topic")?,
                ce_type: r.try_get("ce_type")?,
                publish_status: PublishStatus::of(&status, not_before, deferred_until, now),
                not_before,
                attempts: r.try_get("attempts")?,
                publish_failures: r.try_get("publish_failures")?,
                last_error: r.try_get("last_error")?,
                completed_at: r.try_get("completed_at")?,
                parked_at: r.try_get("parked_at")?,
            };
            Ok((r.try_get("seq")?, view))
        })
        .collect()
}
