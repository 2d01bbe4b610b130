//! Retention of recorded dead letters: every `serve`'s maintenance deletes
//! the letters recorded longer than `dead_letters.retention_ms` ago,
//! whatever became of them, through a purge function the migrator owns.
//!
//! In: [`DeadLettersConfig`]. Out: fewer `dead_letters` rows;
//! `ductor_dead_letters_purged_total`. Guarantees: at most
//! `purge_batch` letters per statement (`SKIP LOCKED`, so several `serve`s
//! share the work) and `purge_max_rounds` statements per round; a
//! `retention_ms` of 0 deletes nothing; a failed round is logged and tried
//! again at the next tick, never ending the loop.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::store::PURGE_SQL;
use crate::config::DeadLettersConfig;

/// One round: the letters past the retention; how many went.
pub async fn purge(pool: &PgPool, config: &DeadLettersConfig) -> Result<u64, sqlx::Error> {
    if config.retention_ms == 0 {
        return Ok(0);
    }
    let purged = crate::infra::db::delete_in_rounds(
        pool,
        PURGE_SQL,
        Duration::from_millis(config.retention_ms),
        config.purge_batch,
        config.purge_max_rounds,
    )
    .await?;
    if purged > 0 {
        tracing::info!(letters = purged, "purged recorded dead letters");
        metrics::counter!("ductor_dead_letters_purged_total").increment(purged);
    }
    Ok(purged)
}

/// Runs retention every `purge_interval_ms` until shutdown.
pub async fn run(pool: PgPool, config: DeadLettersConfig, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(config.purge_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {
                if let Err(e) = purge(&pool, &config).await {
                    tracing::warn!(error = %e, "dead-letter retention failed");
                }
            }
        }
    }
}
