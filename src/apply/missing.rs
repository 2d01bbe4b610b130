//! The running runs of workflow versions that are no longer defined: found
//! at start by `serve`, and failed when it is told to
//! (`coordinator.fail_runs_of_missing_workflows`).
//!
//! In: the workflows this process defines, and the running runs of the
//! versions it lacks. Out: the versions in use, with how many runs need
//! each; those runs failed (`run.failed`), and how many. Guarantees: every
//! read is bounded ([`MAX_VERSIONS_IN_USE`], a page of `limit` ids); runs
//! fail in batches of [`MAX_FAIL_BATCH_RUNS`], each written as any batch
//! is, conditional on the version it was read at, so a run that moved on
//! meanwhile is read again, never overwritten.
//!
//! Both queries read the partial index of running runs
//! (`runs_running_version_idx`): `finished_at IS NULL` is its predicate,
//! and a run is running exactly while it has no `finished_at`.

use std::time::Instant;

use chrono::Utc;
use sqlx::{PgPool, Row};

use super::load::load_ids;
use super::rows::Writes;
use super::session::Session;
use super::write::write_all;
use super::{Applier, ApplyError};
use crate::coordinator::fail_missing_workflow;
use crate::coordinator::versions::VersionInUse;

/// Most workflow versions running runs may need at once; more is an error
/// rather than a list read without bound.
pub const MAX_VERSIONS_IN_USE: usize = 10_000;
/// Most runs one [`Applier::fail_missing_workflow_runs`] fails: one batch
/// statement.
pub const MAX_FAIL_BATCH_RUNS: usize = 512;

/// The workflow versions the running runs need, each with how many need
/// it, by name and version.
pub async fn versions_in_use(pool: &PgPool) -> anyhow::Result<Vec<VersionInUse>> {
    let rows = sqlx::query(
        "SELECT workflow_name, workflow_version, count(*) AS running FROM runs \
         WHERE finished_at IS NULL \
         GROUP BY workflow_name, workflow_version \
         ORDER BY workflow_name, workflow_version LIMIT $1",
    )
    .bind(MAX_VERSIONS_IN_USE as i64 + 1)
    .fetch_all(pool)
    .await?;
    if rows.len() > MAX_VERSIONS_IN_USE {
        anyhow::bail!("running runs need more than {MAX_VERSIONS_IN_USE} workflow versions");
    }
    rows.iter()
        .map(|row| {
            let version: i32 = row.try_get("workflow_version")?;
            let running: i64 = row.try_get("running")?;
            Ok(VersionInUse {
                workflow: row.try_get("workflow_name")?,
                version: u32::try_from(version)?,
                running: u64::try_from(running)?,
            })
        })
        .collect()
}

/// Up to `limit` running runs of `workflow` `version` whose id sorts after
/// `after` (`""` for the first), in id order.
pub async fn running_runs(
    pool: &PgPool,
    workflow: &str,
    version: u32,
    after: &str,
    limit: usize,
) -> anyhow::Result<Vec<String>> {
    let ids = sqlx::query_scalar(
        "SELECT run_id FROM runs \
         WHERE finished_at IS NULL AND workflow_name = $1 AND workflow_version = $2 \
           AND run_id > $3 \
         ORDER BY run_id LIMIT $4",
    )
    .bind(workflow)
    .bind(i64::from(version))
    .bind(after)
    .bind(limit as i64)
    .fetch_all(pool)
    .await?;
    Ok(ids)
}

impl Applier {
    /// Fails those of `run_ids` that are running a workflow version this
    /// applier's workflows do not define ([`fail_missing_workflow`]), in
    /// batches of [`MAX_FAIL_BATCH_RUNS`]. Written like any batch: each
    /// run's `run.failed` transition with its `run.event` intent, its
    /// attempt cancelled and that attempt's pending timeout timer deleted,
    /// in one statement conditional on the `record_version` each run was
    /// read at; a lost race reads the runs again. Returns how many runs it
    /// failed.
    pub async fn fail_missing_workflow_runs(
        &self,
        run_ids: &[String],
    ) -> Result<usize, ApplyError> {
        let mut failed = 0;
        for batch in run_ids.chunks(MAX_FAIL_BATCH_RUNS) {
            failed += self.fail_missing_batch(batch).await?;
        }
        Ok(failed)
    }

    async fn fail_missing_batch(&self, run_ids: &[String]) -> Result<usize, ApplyError> {
        let batch_runs = || run_ids.iter().map(String::as_str);
        let mut conflicts = 0;
        loop {
            let leased_at = Instant::now();
            let mut session = Session::open(&self.pool, true).await?;
            let mut runs = load_ids(session.conn(), run_ids).await?;
            let now = Utc::now();
            let mut writes = Writes {
                writer: self.writer.label(),
                ..Writes::default()
            };
            let mut failed = 0;
            for id in run_ids {
                let Some(loaded) = runs.get_mut(id) else {
                    continue;
                };
                let Some(state) = loaded.state.as_ref() else {
                    continue;
                };
                if let Some(transition) = fail_missing_workflow(state, &self.workflows, now) {
                    let hop =
                        crate::infra::traces::hop(&tracing::Span::none(), state.trace.as_ref());
                    self.record(transition, None, hop, loaded, &mut writes)?;
                    failed += 1;
                }
            }
            let written = write_all(
                session.conn(),
                &runs,
                &writes,
                self.notify_commits,
                self.handoff.as_ref(),
            )
            .await?;
            let Some(handed) = written else {
                conflicts += 1;
                metrics::counter!("ductor_apply_conflicts_total").increment(1);
                if conflicts > self.conflict_retries {
                    return Err(ApplyError::ConflictsExhausted(conflicts));
                }
                continue;
            };
            self.commit(session, handed, leased_at, batch_runs())
                .await?;
            return Ok(failed);
        }
    }
}
