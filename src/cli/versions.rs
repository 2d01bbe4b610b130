//! `serve`'s check, at start, of the workflow versions the running runs
//! need: a version no longer defined in `coordinator.workflows_dir` would
//! leave each of its runs refusing every input, never to finish. `serve`
//! refuses to start and names them, unless told to fail those runs
//! (`coordinator.fail_runs_of_missing_workflows`); it does either before
//! it consumes anything.
//!
//! In: the workflow versions of the running runs (from `runs`) and the
//! [`Workflows`] loaded. Out: `Ok(true)` to go on, `Ok(false)` when
//! shutdown came while failing runs, or the error that keeps `serve` from
//! starting, naming at most `MAX_NAMED_VERSIONS` versions and a few runs of
//! each. Guarantees: runs are failed through the apply stage, a page at a
//! time, by transitions whose writer is `maintenance`; those a shutdown
//! left running are failed at the next start.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::apply::missing::{MAX_FAIL_BATCH_RUNS, running_runs, versions_in_use};
use crate::apply::{Applier, Writer};
use crate::config::Config;
use crate::coordinator::Workflows;
use crate::coordinator::versions::{VersionInUse, missing};

/// The role of the writer of those failures, in `run_transitions.writer`.
const WRITER_ROLE: &str = "maintenance";
/// Most missing versions a refusal names; the rest are counted.
const MAX_NAMED_VERSIONS: usize = 20;
/// Runs a refusal names per missing version, the first by id.
const EXAMPLE_RUNS: usize = 5;

/// Makes sure every running run's workflow version is defined in
/// `workflows`: an error naming the versions that are not, or, with
/// `coordinator.fail_runs_of_missing_workflows`, their runs failed.
/// `Ok(false)`: `shutdown` came while failing them (the rest are failed
/// at the next start).
pub(crate) async fn settle(
    config: &Config,
    pool: &PgPool,
    workflows: &Workflows,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let in_use = versions_in_use(pool)
        .await
        .context("reading the workflow versions of the running runs")?;
    let missing = missing(&in_use, workflows);
    if missing.is_empty() {
        return Ok(true);
    }
    if !config.coordinator.fail_runs_of_missing_workflows {
        return Err(refusal(pool, &missing, &config.coordinator.workflows_dir).await);
    }
    let mut applier = Applier::new(config, pool.clone(), workflows.clone());
    applier.writer = Arc::new(Writer::new(WRITER_ROLE));
    for version in missing {
        if !fail_version(&applier, version, shutdown).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The error that keeps `serve` from starting: the missing versions, with
/// a few runs of each.
async fn refusal(pool: &PgPool, missing: &[&VersionInUse], dir: &Path) -> anyhow::Error {
    let mut named = Vec::with_capacity(missing.len().min(MAX_NAMED_VERSIONS));
    for &version in missing.iter().take(MAX_NAMED_VERSIONS) {
        match running_runs(pool, &version.workflow, version.version, "", EXAMPLE_RUNS).await {
            Ok(examples) => named.push((version, examples)),
            Err(e) => return e.context("reading runs of a workflow version no longer defined"),
        }
    }
    anyhow::anyhow!(refusal_message(&named, missing.len(), dir))
}

/// What [`refusal`] says: each named version with its count of running
/// runs and some of their ids, how many more there are, and the two ways
/// on.
fn refusal_message(named: &[(&VersionInUse, Vec<String>)], missing: usize, dir: &Path) -> String {
    let mut message = format!(
        "running runs need {missing} workflow version{} no longer defined in \
         coordinator.workflows_dir ({}): ",
        if missing == 1 { "" } else { "s" },
        dir.display()
    );
    let versions: Vec<String> = named
        .iter()
        .map(|(version, examples)| {
            let runs = if version.running == 1 { "run" } else { "runs" };
            let some = if (examples.len() as u64) < version.running {
                "such as "
            } else {
                ""
            };
            format!(
                "workflow {:?} version {} ({} running {runs}, {some}{})",
                version.workflow,
                version.version,
                version.running,
                examples.join(", ")
            )
        })
        .collect();
    message.push_str(&versions.join("; "));
    if missing > named.len() {
        message.push_str(&format!("; and {} more", missing - named.len()));
    }
    message.push_str(
        ". Put those definitions back in coordinator.workflows_dir (a version may go once \
         no running run needs it), or have serve fail those runs as it starts, each with \
         the error \"workflow_missing: workflow ... is no longer defined\", by setting \
         coordinator.fail_runs_of_missing_workflows = true \
         (DUCTOR__COORDINATOR__FAIL_RUNS_OF_MISSING_WORKFLOWS=true)",
    );
    message
}

/// Fails every running run of `version`, a page of runs at a time, in id
/// order. `Ok(false)`: stopped by `shutdown` between two pages.
async fn fail_version(
    applier: &Applier,
    version: &VersionInUse,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let (workflow, number) = (&version.workflow, version.version);
    let mut after = String::new();
    let mut failed = 0;
    loop {
        if shutdown.is_cancelled() {
            return Ok(false);
        }
        let page = running_runs(&applier.pool, workflow, number, &after, MAX_FAIL_BATCH_RUNS)
            .await
            .context("reading runs of a workflow version no longer defined")?;
        let Some(last) = page.last() else {
            break;
        };
        after.clone_from(last);
        failed += applier
            .fail_missing_workflow_runs(&page)
            .await
            .with_context(|| format!("failing runs of workflow {workflow:?} version {number}"))?;
    }
    tracing::warn!(
        workflow = %workflow,
        version = number,
        runs = failed,
        "failed the running runs of a workflow version no longer defined"
    );
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_use(workflow: &str, version: u32, running: u64) -> VersionInUse {
        VersionInUse {
            workflow: workflow.into(),
            version,
            running,
        }
    }

    fn ids(n: usize) -> Vec<String> {
        (1..=n).map(|k| format!("r{k}")).collect()
    }

    #[test]
    fn the_refusal_names_each_version_its_count_some_runs_and_the_ways_on() {
        let (order, single) = (in_use("order", 1, 12), in_use("refund", 3, 1));
        let named = [(&order, ids(5)), (&single, ids(1))];
        let message = refusal_message(&named, 2, Path::new("/etc/ductor/workflows"));
        assert!(
            message.starts_with(
                "running runs need 2 workflow versions no longer defined in \
                 coordinator.workflows_dir (/etc/ductor/workflows): "
            ),
            "{message}"
        );
        assert!(
            message.contains(
                "workflow \"order\" version 1 (12 running runs, such as r1, r2, r3, r4, r5); \
                 workflow \"refund\" version 3 (1 running run, r1)."
            ),
            "{message}"
        );
        assert!(!message.contains("more"), "{message}");
        assert!(
            message.contains("coordinator.fail_runs_of_missing_workflows = true")
                && message.contains("DUCTOR__COORDINATOR__FAIL_RUNS_OF_MISSING_WORKFLOWS=true"),
            "{message}"
        );
    }

    #[test]
    fn the_refusal_counts_the_versions_it_does_not_name() {
        let order = in_use("order", 2, 3);
        let message = refusal_message(&[(&order, ids(3))], 25, Path::new("w"));
        assert!(message.contains("need 25 workflow versions"), "{message}");
        assert!(
            message.contains("(3 running runs, r1, r2, r3); and 24 more."),
            "{message}"
        );
    }
}
