//! The operator's counts of runs (`GET /v1/runs/counts`, `ductor runs
//! count`) against the runs themselves.
//!
//! The counts of a filter of tenant, workflow and version are read from
//! `run_counts` (migration `20261205000019_operator_runs.sql`), one row per
//! (tenant, workflow, version, status) moved by deltas: by the batch
//! statement that changes a run's status and by retention's purge. Faults
//! must not make them drift: a transaction rolled back after its rows were
//! written, a batch applied twice, a purge cut short would each leave a
//! count the runs table no longer agrees with, and nothing would ever
//! correct it.
//!
//! In: the `run_counts` rows and the runs (or their count per group), read
//! in one snapshot. Out: `run_counts_differ` violations, one per group
//! whose kept count is not the runs table's, naming the group and both
//! numbers. Guarantees: pure; a group missing from either side counts 0, so
//! a row left at 0 after its runs were purged agrees.

use std::collections::BTreeMap;

use super::snapshot::{CountRow, RunRow};
use super::violations::Violations;

/// (tenant, workflow, version, status).
pub type Group = (String, String, i32, String);

/// The kept counts, by group.
pub fn kept(rows: &[CountRow]) -> BTreeMap<Group, i64> {
    tally(rows.iter().map(|r| {
        let group = (&r.tenant, &r.workflow, r.workflow_version, &r.status);
        (group, r.n)
    }))
}

/// The runs counted, by group.
pub fn counted(runs: &[RunRow]) -> BTreeMap<Group, i64> {
    tally(runs.iter().map(|r| {
        let group = (&r.tenant, &r.workflow, r.workflow_version, &r.status);
        (group, 1)
    }))
}

/// The sum of the numbers of each group.
fn tally<'a>(
    items: impl Iterator<Item = ((&'a String, &'a String, i32, &'a String), i64)>,
) -> BTreeMap<Group, i64> {
    let mut out = BTreeMap::new();
    for ((tenant, workflow, version, status), n) in items {
        let group = (tenant.clone(), workflow.clone(), version, status.clone());
        *out.entry(group).or_default() += n;
    }
    out
}

/// Every group whose kept count differs from the runs counted; `when`
/// says which reading (after the load settled, after the purge).
pub fn compare(
    kept: &BTreeMap<Group, i64>,
    counted: &BTreeMap<Group, i64>,
    when: &str,
    v: &mut Violations,
) {
    let groups: std::collections::BTreeSet<&Group> = kept.keys().chain(counted.keys()).collect();
    for group in groups {
        let (k, c) = (
            kept.get(group).copied().unwrap_or(0),
            counted.get(group).copied().unwrap_or(0),
        );
        if k != c {
            let (tenant, workflow, version, status) = group;
            v.add("run_counts_differ", || {
                format!(
                    "{when}: ({tenant}, {workflow}, {version}, {status}): \
                     run_counts says {k}, the runs table {c}"
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, status: &str, n: i64) -> CountRow {
        CountRow {
            tenant: tenant.into(),
            workflow: "chaos".into(),
            workflow_version: 1,
            status: status.into(),
            n,
        }
    }

    fn run(tenant: &str, status: &str) -> RunRow {
        RunRow {
            run_id: format!("r-{tenant}-{status}"),
            tenant: tenant.into(),
            pool: "default".into(),
            workflow: "chaos".into(),
            workflow_version: 1,
            status: status.into(),
            record_version: 1,
            last_transition_seq: 1,
            state: serde_json::Value::Null,
            finished: status != "running",
        }
    }

    /// A count off by one, a group the counts lack, a count left for runs
    /// that are gone: each reported with the group and both numbers; a
    /// group at 0 without runs, and counts that agree, are not.
    #[test]
    fn a_kept_count_that_differs_from_the_runs_is_reported_with_both_numbers() {
        let rows = [
            row("acme", "succeeded", 2),
            row("acme", "failed", 1),
            row("globex", "cancelled", 0),
            row("globex", "failed", 3),
            row("initech", "running", 1),
        ];
        let runs = [
            run("acme", "succeeded"),
            run("acme", "succeeded"),
            run("acme", "failed"),
            run("acme", "failed"),
            run("globex", "succeeded"),
            run("globex", "failed"),
            run("globex", "failed"),
            run("globex", "failed"),
        ];
        let mut v = Violations::default();
        compare(&kept(&rows), &counted(&runs), "settled", &mut v);
        assert_eq!(v.counts.get("run_counts_differ"), Some(&3), "{v:?}");
        assert_eq!(
            v.examples["run_counts_differ"],
            [
                "settled: (acme, chaos, 1, failed): run_counts says 1, the runs table 2",
                "settled: (globex, chaos, 1, succeeded): run_counts says 0, the runs table 1",
                "settled: (initech, chaos, 1, running): run_counts says 1, the runs table 0",
            ]
        );
        let mut clean = Violations::default();
        compare(
            &kept(&rows[..1]),
            &counted(&runs[..2]),
            "settled",
            &mut clean,
        );
        assert_eq!(clean.total(), 0, "{clean:?}");
    }
}
