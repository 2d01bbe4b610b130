//! The routing plane's upkeep: the **sweep** frees the keys of callers that
//! reserved and never decided, and the **purge** deletes rows whose
//! decision stopped mattering long ago.
//!
//! In: [`RoutingConfig`]'s intervals, batches and retention. Out: `pending`
//! rows past their deadline moved to `failed_before_commit`
//! (`ductor_routing_swept_total`); failed rows, and completed rows past
//! their TTL, deleted once `routing.retention_ms` has passed.
//!
//! Guarantees: the purge never deletes a `pending` row, so a caller still
//! deciding keeps its key; each statement is bounded (`sweep_batch`,
//! `purge_batch`, `purge_max_rounds`), and a failed round is logged and
//! tried again at the next tick, never ending the loop.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::sql::{PURGE_SQL, SWEEP_SQL};
use crate::config::RoutingConfig;

/// Moves expired `pending` rows to `failed_before_commit`, at most `batch`.
pub async fn sweep(pool: &PgPool, batch: usize) -> Result<u64, sqlx::Error> {
    let swept = sqlx::query(SWEEP_SQL)
        .bind(batch as i64)
        .execute(pool)
        .await?
        .rows_affected();
    if swept > 0 {
        tracing::info!(swept, "swept expired pending reservations");
        metrics::counter!("ductor_routing_swept_total").increment(swept);
    }
    Ok(swept)
}

/// Deletes long-dead rows (failed, or completed past their TTL, for longer
/// than `retention`) in batches of `batch`, at most `max_rounds` statements.
/// Never deletes a `pending` row.
pub async fn purge(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
    max_rounds: u32,
) -> Result<u64, sqlx::Error> {
    let total =
        crate::infra::db::delete_in_rounds(pool, PURGE_SQL, retention, batch, max_rounds).await?;
    if total > 0 {
        tracing::info!(purged = total, "purged long-dead idempotency rows");
    }
    Ok(total)
}

/// Sweeps every `sweep_interval_ms` and purges every `purge_interval_ms`
/// until shutdown.
pub async fn run(pool: PgPool, config: RoutingConfig, shutdown: CancellationToken) {
    let mut sweep_tick = tokio::time::interval(Duration::from_millis(config.sweep_interval_ms));
    let mut purge_tick = tokio::time::interval(Duration::from_millis(config.purge_interval_ms));
    sweep_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    purge_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let retention = Duration::from_millis(config.retention_ms);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = sweep_tick.tick() => {
                if let Err(e) = sweep(&pool, config.sweep_batch).await {
                    tracing::warn!(error = %e, "routing sweep failed");
                }
            }
            _ = purge_tick.tick() => {
                let purged = purge(&pool, retention, config.purge_batch, config.purge_max_rounds).await;
                if let Err(e) = purged {
                    tracing::warn!(error = %e, "routing retention failed");
                }
            }
        }
    }
}
