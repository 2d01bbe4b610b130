//! The workflow versions running runs need, against those defined.
//!
//! A run keeps the version it started with to its end, so a version may
//! only leave `coordinator.workflows_dir` once no running run needs it:
//! every later input of such a run would be refused (`unknown_workflow`)
//! and the run would never finish. `serve` compares the two at start
//! ([`missing`]) and either refuses to start or fails those runs
//! ([`super::fail_missing_workflow`]).
//!
//! In: the running runs counted by workflow version ([`VersionInUse`], as
//! the apply stage reads them) and the [`Workflows`] loaded. Out: the
//! versions that still have running runs and no definition. Guarantees:
//! pure; a version with no running run is never reported.

use super::definition::Workflows;

/// The running runs of one workflow version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInUse {
    pub workflow: String,
    pub version: u32,
    /// How many runs of it are running.
    pub running: u64,
}

/// The versions of `in_use` that `workflows` does not define, in the
/// order given.
pub fn missing<'a>(in_use: &'a [VersionInUse], workflows: &Workflows) -> Vec<&'a VersionInUse> {
    in_use
        .iter()
        .filter(|v| v.running > 0 && workflows.get(&v.workflow, v.version).is_none())
        .collect()
}
