//! After the check: retention deletes every finished run (and the outbox
//! its drained intents, as its own retention would), then the good
//! inputs of the load that name a run (client-chosen starts, results,
//! signals, cancels) are delivered again, as a late duplicate would be. No
//! run may come back.
//!
//! Violation kinds:
//!
//! - `purge_incomplete` — after retention deleted every finished run, a run,
//!   transition or attempt row is left, or a purged run has no tombstone.
//! - `run_counts_differ` — after the purge, the operator's kept counts
//!   still count a run that is gone (see [`super::counts`]).
//! - `purged_run_resurrected` — after the redelivery settled, a run row
//!   exists again, or a purged run's tombstone is gone.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use ductor::config::{Config, RunsConfig};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde::Serialize;
use sqlx::PgPool;

use super::log::{EV_INPUT, Record};
use super::topics::Msg;
use super::violations::Violations;

/// Most inputs delivered again.
const MAX_REDELIVERIES: usize = 2_000;

/// What the afterlife did, for the report.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Afterlife {
    pub purged: u64,
    pub redelivered: usize,
}

/// Purges every finished run, delivers the inputs again and checks that
/// every purged run stays purged. `settle` waits until the coordinator
/// consumed what was delivered.
pub async fn run<F, Fut>(
    pool: &PgPool,
    config: &Config,
    records: &[Record],
    msgs: &[Msg],
    settle: F,
    v: &mut Violations,
) -> anyhow::Result<Afterlife>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let everything = RunsConfig {
        retention_ms: 1,
        purge_batch: 10_000,
        purge_max_rounds: 1_000,
        ..RunsConfig::default()
    };
    let purged = ductor::harness::purge_finished_runs(pool, &everything)
        .await
        .context("purging the finished runs")?
        .runs;
    // The outbox's retention deletes drained intents sooner than runs are
    // purged: nothing of a purged run is left but its tombstone.
    sqlx::query("DELETE FROM eec_effect_intent WHERE status = 'completed'")
        .execute(pool)
        .await
        .context("deleting the drained intents")?;
    let tombstones = count(pool, "run_tombstones").await?;
    for table in ["runs", "run_transitions", "run_attempts"] {
        let left = count(pool, table).await?;
        if left > 0 {
            v.add("purge_incomplete", || {
                format!("{left} rows left in {table} after purging every finished run")
            });
        }
    }
    if tombstones != purged as i64 {
        v.add("purge_incomplete", || {
            format!("{purged} runs purged, {tombstones} tombstones")
        });
    }
    // The purge takes its runs out of the operator's counts in the same
    // statement: none may be left counted.
    let (kept, counted) = super::snapshot::run_counts(pool).await?;
    super::counts::compare(
        &super::counts::kept(&kept),
        &super::counts::kept(&counted),
        "purged",
        v,
    );
    let redelivered = redeliver(config, records, msgs).await?;
    settle().await?;
    let runs = resurrected(pool).await?;
    for run_id in &runs {
        v.add("purged_run_resurrected", || {
            format!("{run_id} exists again after its inputs were delivered late")
        });
    }
    let after = count(pool, "run_tombstones").await?;
    if after != tombstones {
        v.add("purged_run_resurrected", || {
            format!("{tombstones} tombstones before the redelivery, {after} after")
        });
    }
    Ok(Afterlife {
        purged,
        redelivered,
    })
}

/// Produces again, byte for byte, the acknowledged good inputs that name
/// a run; returns how many.
async fn redeliver(config: &Config, records: &[Record], msgs: &[Msg]) -> anyhow::Result<usize> {
    let by_offset: HashMap<(&str, i32, i64), &Msg> = msgs
        .iter()
        .map(|m| ((m.topic.as_str(), m.partition, m.offset), m))
        .collect();
    let again: Vec<&Msg> = records
        .iter()
        .filter(|r| r.ev == EV_INPUT && r.good && r.acked)
        .filter(|r| {
            matches!(
                r.kind.as_deref(),
                Some("start" | "signal" | "cancel" | "result")
            )
        })
        .filter_map(|r| {
            let at = (r.topic.as_deref()?, r.partition?, r.offset?);
            by_offset.get(&at).copied()
        })
        .take(MAX_REDELIVERIES)
        .collect();
    let producer = ductor::infra::kafka::producer(&config.kafka, "chaos-afterlife")?;
    let timeout = Duration::from_millis(config.kafka.delivery_timeout_ms);
    for m in &again {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &m.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::to(&m.topic)
            .payload(&m.payload)
            .partition(m.partition)
            .headers(headers);
        if let Some(key) = &m.key {
            record = record.key(key);
        }
        producer
            .send(record, timeout)
            .await
            .map_err(|(e, _)| anyhow::anyhow!("delivering {}/{} again: {e}", m.topic, m.offset))?;
    }
    Ok(again.len())
}

async fn count(pool: &PgPool, table: &str) -> anyhow::Result<i64> {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(pool)
        .await
        .with_context(|| format!("counting {table}"))
}

/// Runs that exist although every run was purged.
async fn resurrected(pool: &PgPool) -> anyhow::Result<Vec<String>> {
    sqlx::query_scalar("SELECT run_id FROM runs ORDER BY run_id LIMIT 20")
        .fetch_all(pool)
        .await
        .context("listing runs")
}
