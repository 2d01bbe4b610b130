//! Retention of finished runs: the maintenance loop deletes the runs that
//! ended longer than `runs.retention_ms` ago, with their transitions and
//! attempts (`ON DELETE CASCADE`), and leaves a tombstone for each, through
//! purge functions the migrator owns, so that the application role needs
//! no right to delete history itself.
//!
//! In: [`RunsConfig`]. Out: fewer `runs` rows, as many new
//! `run_tombstones` rows, tombstones older than
//! `runs.tombstone_retention_ms` deleted; `ductor_runs_purged_total` and
//! `ductor_run_tombstones_purged_total`.
//!
//! Guarantees: one statement writes a run's tombstone and deletes the run,
//! so a run is always either in `runs` or in `run_tombstones` (until its
//! tombstone expires). Only a finished run is deleted, and nothing writes a
//! finished run, so deleting one races with no writer: an applier that
//! loaded it before finds the row gone when it writes, loses its race and
//! reloads, and then meets the tombstone. Rows are deleted at most
//! `purge_batch` per statement (`SKIP LOCKED`, so several `serve`s share
//! the work), at most `purge_max_rounds` statements per round.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::RunsConfig;

/// Deletes up to `$2` runs finished more than `$1` seconds ago, writing the
/// tombstone of each in the same statement; one row per run deleted.
///
/// Through `ductor_purge_finished_runs` (migration
/// `20261204000018_retention_functions`), a SECURITY DEFINER function of
/// the migrator, rather than a DELETE of serve's own: with it, serve's role
/// needs DELETE on no run, transition, attempt or tombstone, so that it
/// cannot erase a running run or rewrite what happened to a finished one,
/// and the function deletes only what retention would. Relying on the cascade
/// alone (Postgres runs a referential action as the owner of the
/// referencing table, so DELETE on `runs` would have been enough) still
/// left serve free to delete any run, running or not, with its history.
const PURGE_RUNS_SQL: &str =
    "SELECT run_id FROM ductor_purge_finished_runs($1, $2) AS purged(run_id)";

/// Deletes up to `$2` tombstones older than `$1` seconds (through
/// `ductor_purge_tombstones`, for the same reason); one row per tombstone.
const PURGE_TOMBSTONES_SQL: &str =
    "SELECT run_id FROM ductor_purge_tombstones($1, $2) AS purged(run_id)";

/// What one round of retention deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub runs: u64,
    pub tombstones: u64,
}

/// One round: finished runs past the retention, then expired tombstones.
/// A `retention_ms` of 0 keeps every run (tombstones still expire).
pub async fn purge(pool: &PgPool, config: &RunsConfig) -> Result<Purged, sqlx::Error> {
    let mut purged = Purged::default();
    if config.retention_ms > 0 {
        purged.runs = rounds(pool, PURGE_RUNS_SQL, config.retention_ms, config).await?;
    }
    purged.tombstones = rounds(
        pool,
        PURGE_TOMBSTONES_SQL,
        config.tombstone_retention_ms,
        config,
    )
    .await?;
    if purged.runs > 0 {
        tracing::info!(runs = purged.runs, "purged finished runs");
        metrics::counter!("ductor_runs_purged_total").increment(purged.runs);
    }
    if purged.tombstones > 0 {
        tracing::info!(tombstones = purged.tombstones, "purged expired tombstones");
        metrics::counter!("ductor_run_tombstones_purged_total").increment(purged.tombstones);
    }
    Ok(purged)
}

async fn rounds(
    pool: &PgPool,
    sql: &str,
    age_ms: u64,
    config: &RunsConfig,
) -> Result<u64, sqlx::Error> {
    let age = Duration::from_millis(age_ms);
    crate::infra::db::delete_in_rounds(pool, sql, age, config.purge_batch, config.purge_max_rounds)
        .await
}

/// Runs retention every `purge_interval_ms` until shutdown.
pub async fn run(pool: PgPool, config: RunsConfig, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(config.purge_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {
                if let Err(e) = purge(&pool, &config).await {
                    tracing::warn!(error = %e, "run retention failed");
                }
            }
        }
    }
}
