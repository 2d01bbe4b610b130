//! Plan: from a batch's fold results to the one [`BatchWrite`] that commits
//! them. Pure: no database, no clock; what it decides is tested without
//! either.
//!
//! In: the runs as loaded and folded, the attempt's [`Writes`], and the
//! fast lane's claim, if any. Out: a [`Plan`]: the batch's parameters, its
//! intents in the statement's order, and the states as written, for the
//! cache. Guarantees:
//!
//! - a run loaded without a version is inserted at `record_version` 1, a
//!   changed one updated at the version it was loaded with and bumped by
//!   one: a loaded version is never replaced;
//! - the timeout timer of an attempt dispatched and finished in the same
//!   batch is not written at all, and the pending timeout timers of the
//!   attempts the batch finishes are cancelled;
//! - the guard expects every conditional write to match one row per row
//!   sent (a canary build that breaks a guarantee checks nothing);
//! - each run whose status the batch changes leaves the count of its status
//!   before the batch (none for a new run) and joins the count of its
//!   status after, the moves netted per key and sent in key order.

use std::collections::{BTreeMap, HashMap};

use super::ApplyError;
use super::batch::BatchWrite;
use super::rows::{IntentRow, Loaded, Writes};
use crate::contract::timeout_cancel_key;
use crate::coordinator::{AttemptStatus, RunState};

/// Canaries that remove a guarantee also remove the database's second line
/// of defence (a write matching fewer rows than expected is a conflict), or
/// the broken guarantee would never show.
const CANARY_IGNORES_CONFLICTS: bool = cfg!(any(
    feature = "canary-no-version-check",
    feature = "canary-no-stamp-dedup"
));

/// A batch ready to write.
#[derive(Debug)]
pub(crate) struct Plan<'a> {
    pub write: BatchWrite<'a>,
    /// The intents written, in the statement's order (for the fast lane).
    pub intents: Vec<&'a IntentRow>,
    /// The runs as written, with the length of their encoded state, for the
    /// cache once committed.
    pub states: Vec<(RunState, usize)>,
}

/// The fast lane's drainer and the lease of the claims it takes at insert.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FastLaneClaim<'a> {
    pub drainer_id: &'a str,
    pub lease_s: f64,
}

/// Plans the batch of `runs` and `writes`.
pub(crate) fn plan<'a>(
    runs: &'a HashMap<String, Loaded>,
    writes: &'a Writes,
    claim: Option<FastLaneClaim<'a>>,
) -> Result<Plan<'a>, ApplyError> {
    let mut write = BatchWrite::default();
    let states = plan_runs(runs, &mut write)?;
    plan_history(writes, &mut write);
    plan_counts(runs, writes, &mut write);
    let intents = plan_intents(writes, &mut write)?;
    write.claimer = claim.map(|c| c.drainer_id);
    write.writer = Some(writes.writer.as_str()).filter(|w| !w.is_empty());
    write.lease_s = claim.map_or(0.0, |c| c.lease_s);
    write.expected = (!CANARY_IGNORES_CONFLICTS).then(|| write.guarded_counts());
    // UNNEST pads a shorter array with NULLs: a column left behind would
    // write a row silently wrong instead of failing.
    debug_assert!(
        write.columns_aligned(),
        "a batch's columns differ in length"
    );
    Ok(Plan {
        write,
        intents,
        states,
    })
}

/// The runs the batch changed: inserts for new ones, conditional updates for
/// loaded ones.
fn plan_runs<'a>(
    runs: &'a HashMap<String, Loaded>,
    write: &mut BatchWrite<'a>,
) -> Result<Vec<(RunState, usize)>, ApplyError> {
    let mut states = Vec::new();
    for loaded in runs.values().filter(|l| l.changed) {
        let Some(state) = &loaded.state else { continue };
        let mut written = state.clone();
        written.record_version = loaded.loaded_version.map_or(1, |v| v + 1);
        let encoded = serde_json::to_string(&written)?;
        let len = encoded.len();
        let finished_at = state.status.is_terminal().then_some(state.updated_at);
        match loaded.loaded_version {
            None => {
                let n = &mut write.inserts;
                n.run_id.push(&state.run_id);
                n.tenant.push(&state.tenant);
                n.pool.push(&state.pool);
                n.workflow.push(&state.workflow);
                n.version.push(state.workflow_version as i32);
                n.status.push(state.status.as_str());
                n.seq.push(state.last_transition_seq);
                n.state.push(encoded);
                n.created_at.push(state.created_at);
                n.updated_at.push(state.updated_at);
                n.finished_at.push(finished_at);
            }
            Some(version) => {
                // The update is conditional on the version the state was
                // loaded with; a state carrying another would replace a
                // version nobody read.
                debug_assert_eq!(
                    state.record_version, version,
                    "run {} was loaded at one version and folded at another",
                    state.run_id
                );
                let u = &mut write.updates;
                u.run_id.push(&state.run_id);
                u.expected_version.push(version);
                u.status.push(state.status.as_str());
                u.seq.push(state.last_transition_seq);
                u.state.push(encoded);
                u.updated_at.push(state.updated_at);
                u.finished_at.push(finished_at);
            }
        }
        states.push((written, len));
    }
    Ok(states)
}

/// Transitions, attempts inserted and finished, and the cancel of the
/// finished attempts' timeout timers.
fn plan_history<'a>(writes: &'a Writes, write: &mut BatchWrite<'a>) {
    let t = &mut write.transitions;
    for r in &writes.transitions {
        t.run_id.push(&r.run_id);
        t.seq.push(r.seq);
        t.input_ref.push(&r.input_ref);
        t.kind.push(r.kind);
        t.from_status.push(r.from_status);
        t.to_status.push(r.to_status);
        t.step_index.push(r.step_index);
        t.detail.push(&r.detail);
        t.source_topic
            .push(r.source.as_ref().map(|s| s.topic.as_str()));
        t.source_partition
            .push(r.source.as_ref().map(|s| s.partition));
        t.source_offset.push(r.source.as_ref().map(|s| s.offset));
        t.at.push(r.at);
    }
    let a = &mut write.attempts;
    for (run_id, r) in &writes.attempt_inserts {
        a.stamp.push(r.stamp);
        a.run_id.push(run_id);
        a.step_index.push(r.step_index as i32);
        a.attempt.push(r.attempt as i32);
        a.status.push(r.status.as_str());
        a.dispatched_at.push(r.dispatched_at);
        a.deadline.push(r.deadline);
        a.finished_at.push(r.finished_at);
        a.error.push(r.error.as_deref());
    }
    let f = &mut write.finishes;
    for finish in &writes.attempt_finishes {
        f.stamp.push(finish.stamp);
        f.status.push(finish.status.as_str());
        f.finished_at.push(finish.finished_at);
        f.error.push(finish.error.as_deref());
    }
    // Timeout timers of attempts finished by this batch will never do
    // anything: drop them while they are still pending.
    write.cancel_keys = writes
        .attempt_finishes
        .iter()
        .map(|f| timeout_cancel_key(&f.stamp.to_string()))
        .collect();
}

/// The moves of the runs' counts by status: for each run, the status its
/// first transition of the batch came from and the one its last went to.
fn plan_counts<'a>(
    runs: &'a HashMap<String, Loaded>,
    writes: &'a Writes,
    write: &mut BatchWrite<'a>,
) {
    // Per run: (seq, status before) of its first transition, (seq, status
    // after) of its last.
    type Span = ((i64, Option<&'static str>), (i64, &'static str));
    let mut spans: HashMap<&str, Span> = HashMap::new();
    for t in &writes.transitions {
        let span = spans
            .entry(t.run_id.as_str())
            .or_insert(((t.seq, t.from_status), (t.seq, t.to_status)));
        if t.seq < span.0.0 {
            span.0 = (t.seq, t.from_status);
        }
        if t.seq > span.1.0 {
            span.1 = (t.seq, t.to_status);
        }
    }
    let mut moves: BTreeMap<(&str, &str, i32, &str), i64> = BTreeMap::new();
    for (run_id, ((_, before), (_, after))) in spans {
        if before == Some(after) {
            continue;
        }
        // Every run with a transition was loaded or made by the batch.
        let Some(state) = runs.get(run_id).and_then(|l| l.state.as_ref()) else {
            debug_assert!(false, "run {run_id} has a transition but no state");
            continue;
        };
        let key = |status| {
            let version = state.workflow_version as i32;
            (
                state.tenant.as_str(),
                state.workflow.as_str(),
                version,
                status,
            )
        };
        if let Some(before) = before {
            *moves.entry(key(before)).or_default() -= 1;
        }
        *moves.entry(key(after)).or_default() += 1;
    }
    let c = &mut write.counts;
    for ((tenant, workflow, version, status), delta) in moves {
        if delta != 0 {
            c.tenant.push(tenant);
            c.workflow.push(workflow);
            c.version.push(version);
            c.status.push(status);
            c.delta.push(delta);
        }
    }
}

/// The intents to write: all but the timeout timers of attempts that were
/// dispatched and finished within this batch (pointless at once).
fn plan_intents<'a>(
    writes: &'a Writes,
    write: &mut BatchWrite<'a>,
) -> Result<Vec<&'a IntentRow>, ApplyError> {
    let finished_here: Vec<String> = writes
        .attempt_inserts
        .iter()
        .filter(|(_, a)| a.status != AttemptStatus::Dispatched)
        .map(|(_, a)| timeout_cancel_key(&a.stamp.to_string()))
        .collect();
    let intents: Vec<&IntentRow> = writes
        .intents
        .iter()
        .filter(|i| {
            i.cancel_key
                .as_ref()
                .is_none_or(|k| !finished_here.contains(k))
        })
        .collect();
    let c = &mut write.intents;
    for r in &intents {
        c.run_id.push(&r.run_id);
        c.seq.push(r.seq);
        c.effect_index.push(r.effect_index);
        c.key.push(&r.idempotency_key);
        c.tenant.push(&r.tenant);
        c.topic.push(&r.topic);
        c.message_key.push(&r.message_key);
        c.headers.push(serde_json::to_string(&r.headers)?);
        c.payload.push(&r.payload);
        c.ce_type.push(&r.ce_type);
        c.not_before.push(r.not_before);
        c.cancel_key.push(r.cancel_key.as_deref());
        c.due.push(r.due);
    }
    Ok(intents)
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use uuid::Uuid;

    use super::*;
    use crate::apply::load::tests::started;
    use crate::apply::rows::{AttemptFinish, TransitionRow};
    use crate::coordinator::AttemptRecord;

    fn loaded(mut state: RunState, version: Option<i64>, changed: bool) -> Loaded {
        // A loaded state carries the version it was loaded at.
        if let Some(v) = version {
            state.record_version = v;
        }
        Loaded {
            state: Some(state),
            loaded_version: version,
            changed,
            cached: false,
            purged: None,
        }
    }

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).expect("a valid time")
    }

    fn attempt(stamp: u128, status: AttemptStatus) -> (String, AttemptRecord) {
        let record = AttemptRecord {
            stamp: Uuid::from_u128(stamp),
            step_index: 0,
            attempt: 1,
            status,
            dispatched_at: at(),
            deadline: at(),
            finished_at: None,
            error: None,
        };
        ("b".to_owned(), record)
    }

    fn timer(stamp: u128) -> IntentRow {
        IntentRow {
            run_id: "b".into(),
            seq: 8,
            effect_index: 2,
            idempotency_key: "b/8/2".into(),
            tenant: "acme".into(),
            topic: "ductor.wakeups".into(),
            message_key: b"b".to_vec(),
            headers: serde_json::Map::new(),
            payload: b"{}".to_vec(),
            ce_type: "ductor.wakeup.timer".into(),
            not_before: at(),
            cancel_key: Some(timeout_cancel_key(&Uuid::from_u128(stamp).to_string())),
            due: false,
        }
    }

    fn transition(run_id: &str, seq: i64) -> TransitionRow {
        TransitionRow {
            run_id: run_id.into(),
            seq,
            input_ref: format!("input-{seq}"),
            kind: "step.succeeded",
            from_status: Some("running"),
            to_status: "running",
            step_index: 1,
            detail: "{}".into(),
            source: None,
            at: at(),
        }
    }

    #[test]
    fn new_runs_are_inserted_and_loaded_ones_updated_at_their_version() {
        let mut runs = HashMap::new();
        runs.insert("a".to_owned(), loaded(started("a", 1), None, true));
        runs.insert("b".to_owned(), loaded(started("b", 1), Some(7), true));
        runs.insert("c".to_owned(), loaded(started("c", 1), Some(3), false));
        let writes = Writes {
            transitions: vec![transition("a", 1), transition("b", 8)],
            ..Writes::default()
        };
        let plan = plan(&runs, &writes, None).expect("plans");
        let w = &plan.write;
        assert_eq!(w.inserts.run_id, ["a"]);
        assert_eq!(
            (w.updates.run_id.clone(), w.updates.expected_version.clone()),
            (vec!["b"], vec![7])
        );
        let written: RunState = serde_json::from_str(&w.updates.state[0]).unwrap();
        assert_eq!(written.record_version, 8);
        let inserted: RunState = serde_json::from_str(&w.inserts.state[0]).unwrap();
        assert_eq!(inserted.record_version, 1);
        let versions: HashMap<&str, i64> = plan
            .states
            .iter()
            .map(|(s, _)| (s.run_id.as_str(), s.record_version))
            .collect();
        assert_eq!(versions, HashMap::from([("a", 1), ("b", 8)]));
        assert_eq!(
            w.expected,
            (!CANARY_IGNORES_CONFLICTS).then(|| vec![1, 1, 2, 0, 0])
        );
        assert_eq!(w.claimer, None);
        assert!(!w.is_empty());
    }

    fn moved(
        run_id: &str,
        seq: i64,
        from: Option<&'static str>,
        to: &'static str,
    ) -> TransitionRow {
        TransitionRow {
            from_status: from,
            to_status: to,
            ..transition(run_id, seq)
        }
    }

    fn counts(w: &BatchWrite<'_>) -> Vec<(String, String, i32, String, i64)> {
        let c = &w.counts;
        (0..c.delta.len())
            .map(|k| {
                let (t, w, s) = (c.tenant[k], c.workflow[k], c.status[k]);
                (t.into(), w.into(), c.version[k], s.into(), c.delta[k])
            })
            .collect()
    }

    #[test]
    fn the_counts_move_from_each_runs_first_status_to_its_last_netted_per_key() {
        let mut runs = HashMap::new();
        for (id, version) in [("new", None), ("done", Some(4)), ("busy", Some(2))] {
            runs.insert(id.to_owned(), loaded(started(id, 1), version, true));
        }
        let mut other = started("other", 1);
        other.workflow_version = 2;
        runs.insert("other".to_owned(), loaded(other, Some(3), true));
        let writes = Writes {
            transitions: vec![
                // New, and finished within the batch: from none to failed.
                moved("new", 2, Some("running"), "failed"),
                moved("new", 1, None, "running"),
                // Running to succeeded, in the order the fold wrote them.
                moved("done", 5, Some("running"), "running"),
                moved("done", 6, Some("running"), "succeeded"),
                // Still running: no move.
                moved("busy", 3, Some("running"), "running"),
                // Another version counts apart.
                moved("other", 4, Some("failed"), "running"),
            ],
            ..Writes::default()
        };
        let plan = plan(&runs, &writes, None).expect("plans");
        let key = |v: i32, s: &str, d: i64| ("acme".into(), "example".into(), v, s.into(), d);
        assert_eq!(
            counts(&plan.write),
            [
                key(1, "failed", 1),
                key(1, "running", -1),
                key(1, "succeeded", 1),
                key(2, "failed", -1),
                key(2, "running", 1),
            ]
        );
        assert!(plan.write.columns_aligned());
    }

    #[test]
    fn moves_that_cancel_out_are_not_sent() {
        let mut runs = HashMap::new();
        runs.insert("a".to_owned(), loaded(started("a", 1), None, true));
        runs.insert("b".to_owned(), loaded(started("b", 1), Some(2), true));
        let writes = Writes {
            transitions: vec![
                moved("a", 1, None, "running"),
                moved("b", 3, Some("running"), "cancelled"),
            ],
            ..Writes::default()
        };
        let plan = plan(&runs, &writes, None).expect("plans");
        let cancelled = ("acme".into(), "example".into(), 1, "cancelled".into(), 1);
        assert_eq!(counts(&plan.write), [cancelled]);
    }

    #[test]
    fn a_timer_of_an_attempt_finished_in_the_same_batch_is_not_written() {
        let runs = HashMap::new();
        let writes = Writes {
            attempt_inserts: vec![
                attempt(1, AttemptStatus::Succeeded),
                attempt(2, AttemptStatus::Dispatched),
            ],
            attempt_finishes: vec![AttemptFinish {
                stamp: Uuid::from_u128(3),
                status: AttemptStatus::TimedOut,
                finished_at: at(),
                error: Some("timed out".into()),
            }],
            intents: vec![timer(1), timer(2)],
            ..Writes::default()
        };
        let claim = FastLaneClaim {
            drainer_id: "d1",
            lease_s: 90.0,
        };
        let plan = plan(&runs, &writes, Some(claim)).expect("plans");
        let kept: Vec<_> = plan.intents.iter().map(|i| i.cancel_key.clone()).collect();
        assert_eq!(
            kept,
            [Some(timeout_cancel_key(&Uuid::from_u128(2).to_string()))]
        );
        assert_eq!(plan.write.intents.run_id.len(), 1);
        assert_eq!(
            plan.write.cancel_keys,
            [timeout_cancel_key(&Uuid::from_u128(3).to_string())]
        );
        assert_eq!(plan.write.finishes.status, ["timed_out"]);
        assert_eq!((plan.write.claimer, plan.write.lease_s), (Some("d1"), 90.0));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "loaded at one version and folded at another")]
    fn a_state_folded_at_another_version_than_it_was_loaded_at_is_refused() {
        let mut runs = HashMap::new();
        let mut stale = loaded(started("b", 1), Some(7), true);
        stale.loaded_version = Some(6);
        runs.insert("b".to_owned(), stale);
        let writes = Writes::default();
        let _ = plan(&runs, &writes, None);
    }

    #[test]
    fn a_batch_of_no_ops_plans_nothing_to_write() {
        let mut runs = HashMap::new();
        runs.insert("c".to_owned(), loaded(started("c", 1), Some(3), false));
        let writes = Writes::default();
        let plan = plan(&runs, &writes, None).expect("plans");
        assert!(plan.write.is_empty());
        assert!(plan.states.is_empty());
    }
}
