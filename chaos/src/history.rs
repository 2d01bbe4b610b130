//! Per-run checks: the stored state agrees with its history.
//!
//! A run is stored as one `runs` row (columns plus the fold's whole state as
//! `state` jsonb), its append-only `run_transitions`, its `run_attempts` and
//! the `eec_effect_intent` rows its transitions committed. "The stored state
//! agrees with its history" means, precisely, all of the following:
//!
//! 1. **Numbering** (`seq_gap`): the transitions are numbered exactly
//!    `1..=n`, and `runs.last_transition_seq = n`.
//! 2. **Version** (`record_version`): `1 <= runs.record_version <= n` (one
//!    bump per committed batch that touched the run, and a batch applies at
//!    least one transition), and the `record_version` inside `state` equals
//!    the column (the store writes both from the version it read; a write
//!    that skipped the version check leaves them apart).
//! 3. **Shape** (`state_history_mismatch`): `state` decodes; its run id,
//!    tenant, pool, workflow, version, status and `last_transition_seq`
//!    equal the columns; `finished_at` is set iff the status is terminal; the
//!    status equals the last transition's `to_status` and the step index its
//!    `step_index`; the first transition is `run.started` from `start` with
//!    no `from_status`, each later one starts from the previous `to_status`,
//!    and nothing follows a terminal transition but, after a failure, a
//!    signal, a cancel or a retry; the attempts in `state` are
//!    exactly the `run_attempts` rows (stamp, step, number, status, times to
//!    the microsecond, error); every attempt's status is explained by the
//!    history (succeeded/failed: a `result:<stamp>` transition; timed out: a
//!    `timer:timeout:<stamp>` transition; cancelled: the `run.cancelled`
//!    transition, or the `run.failed` one of a state too large or of a
//!    workflow version no longer defined, names it;
//!    still dispatched: it is the outstanding attempt of a running run); the
//!    signals in `state` are, in order, the ids of the `signal:<id>`
//!    transitions that recorded them (`run.signalled`, or the end of an
//!    `await_signal` step's wait); every intent belongs
//!    to a transition.
//! 4. **At most once** (`input_applied_twice`): no two transitions share an
//!    `input_ref`.
//! 5. **No stale result** (`stale_result_applied`): a `result:<stamp>`
//!    transition never names an attempt that timed out or was cancelled.
//! 6. **Replay** (`state_replay_mismatch`, `transition_source_missing`):
//!    every transition's input is read back from Kafka at the
//!    topic/partition/offset the transition recorded (a start decided over
//!    HTTP has no source and is rebuilt from the state), and the pure fold
//!    is run over them in order, each at the transition's recorded time and
//!    with the stamp the transition introduced (jitter is recovered from the
//!    recorded backoff). The one transition made from no input, `serve`
//!    failing a run whose workflow version is no longer defined
//!    (`maintenance:missing_workflow`), has no source either: it must be the
//!    run's last, and is replayed by the same pure function, for a run whose
//!    workflow is gone. Each fold must yield a transition equal to the
//!    stored row (seq, input ref, kind, statuses, step, detail), its effects
//!    must equal the committed intents of that seq (topic, message key,
//!    payload as a JSON value, type, due time; plus the routing plane's
//!    trailing `run.accepted` on a routed start; a step's timeout timer may
//!    be missing once its attempt finished, the store deletes it while
//!    pending), and the final replayed state must
//!    equal the stored `state` (timestamps compared to the microsecond,
//!    `record_version` left out, it is checked by 2).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, SubsecRound, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::snapshot::{AttemptRow, IntentRow, RunRow, TransitionRow};
use super::topics::Msg;
use super::violations::Violations;
use ductor::contract::TopicNames;
use ductor::contract::TransitionKind;
use ductor::contract::{Input, InputTopic, MISSING_WORKFLOW_REF, RunStart, fingerprint};
use ductor::coordinator::{
    Decision, Entropy, MAX_STEPS_IN_ALL, RunState, STATE_TOO_LARGE, Transition, WORKFLOW_MISSING,
    Workflows, derived_stamp, fail_missing_workflow, fold,
};

/// What the replay needs besides the run's own rows.
pub struct Context<'a> {
    pub workflows: &'a Workflows,
    pub topics: &'a TopicNames,
    /// Input messages by (topic, partition, offset).
    pub inputs: &'a HashMap<(String, i32, i64), &'a Msg>,
    pub requests_topic: &'a str,
    pub wakeups_topic: &'a str,
    pub results_topic: &'a str,
    /// The bounds the serves kept (size and shape).
    pub limits: ductor::contract::InputLimits,
    /// The serves' `coordinator.max_state_bytes`.
    pub max_state_bytes: usize,
}

impl Context<'_> {
    fn input_topic(&self, topic: &str) -> Option<InputTopic> {
        InputTopic::classify(
            topic,
            self.requests_topic,
            self.wakeups_topic,
            self.results_topic,
        )
    }
}

/// The rows of one run.
pub struct RunRows<'a> {
    pub run: &'a RunRow,
    /// Sorted by seq.
    pub transitions: &'a [TransitionRow],
    pub attempts: &'a [AttemptRow],
    /// Sorted by (seq, effect_index).
    pub intents: &'a [&'a IntentRow],
}

/// A transition that ends its run's outstanding attempt as cancelled: a
/// cancel, the failure of a run whose state would have grown too large on
/// an input that was not that attempt's result, or the failure of a run
/// whose workflow version is no longer defined.
fn abandons_attempts(t: &TransitionRow) -> bool {
    let cause = t.detail.get("cause").and_then(Value::as_str);
    t.kind == TransitionKind::RunCancelled.as_str()
        || (t.kind == TransitionKind::RunFailed.as_str()
            && matches!(cause, Some(STATE_TOO_LARGE | WORKFLOW_MISSING)))
}

fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    t.trunc_subsecs(6)
}

/// Runs every check of the module docs on one run.
pub fn check_run(ctx: &Context<'_>, rows: &RunRows<'_>, v: &mut Violations) {
    let run = rows.run;
    let id = &run.run_id;
    let ts = rows.transitions;

    numbering(run, ts, v);
    let Some(state) = versioned_state(run, ts.len() as i64, v) else {
        return;
    };
    let by_stamp: HashMap<Uuid, &AttemptRow> = rows.attempts.iter().map(|a| (a.stamp, a)).collect();
    let results = applied_results(ts, &by_stamp);
    stale_results(id, &results, v);
    if let Some(s) = shape_mismatches(&state, rows, &by_stamp, &results)
        .into_iter()
        .next()
    {
        v.add("state_history_mismatch", || format!("{id}: {s}"));
    }
    at_most_once(id, ts, v);
    replay(ctx, rows, v);
}

/// Numbering (point 1): the transitions are numbered `1..=n`, and the run
/// says `n`.
fn numbering(run: &RunRow, ts: &[TransitionRow], v: &mut Violations) {
    let id = &run.run_id;
    let n = ts.len() as i64;
    if let Some((i, t)) = ts.iter().enumerate().find(|(i, t)| t.seq != *i as i64 + 1) {
        v.add("seq_gap", || {
            format!("{id}: transition #{} has seq {}", i + 1, t.seq)
        });
    }
    if run.last_transition_seq != n {
        v.add("seq_gap", || {
            format!(
                "{id}: last_transition_seq {} but {n} transitions",
                run.last_transition_seq
            )
        });
    }
}

/// Version (point 2): the record version is within what `n` transitions
/// allow and the state carries the column's. Returns the stored state,
/// when it decodes (the other checks need it).
fn versioned_state(run: &RunRow, n: i64, v: &mut Violations) -> Option<RunState> {
    let id = &run.run_id;
    if run.record_version < 1 || run.record_version > n.max(1) {
        v.add("record_version", || {
            format!(
                "{id}: record_version {} outside 1..={n}",
                run.record_version
            )
        });
    }
    let state: RunState = match serde_json::from_value(run.state.clone()) {
        Ok(s) => s,
        Err(e) => {
            v.add("state_history_mismatch", || {
                format!("{id}: state does not decode: {e}")
            });
            return None;
        }
    };
    if state.record_version != run.record_version {
        v.add("record_version", || {
            format!(
                "{id}: state says record_version {}, the column {}",
                state.record_version, run.record_version
            )
        });
    }
    Some(state)
}

/// A `result:<stamp>` transition, its stamp, and the status of the attempt
/// it names (`None` when no attempt has that stamp).
struct AppliedResult<'a> {
    seq: i64,
    stamp: &'a str,
    status: Option<&'a str>,
}

fn applied_results<'a>(
    ts: &'a [TransitionRow],
    by_stamp: &HashMap<Uuid, &'a AttemptRow>,
) -> Vec<AppliedResult<'a>> {
    ts.iter()
        .filter_map(|t| {
            let stamp = t.input_ref.strip_prefix("result:")?;
            let row = Uuid::parse_str(stamp).ok().and_then(|s| by_stamp.get(&s));
            Some(AppliedResult {
                seq: t.seq,
                stamp,
                status: row.map(|r| r.status.as_str()),
            })
        })
        .collect()
}

/// No stale result (point 5): no result was applied for an attempt that
/// had timed out or was cancelled.
fn stale_results(id: &str, results: &[AppliedResult<'_>], v: &mut Violations) {
    for r in results {
        if let Some(status @ ("timed_out" | "cancelled")) = r.status {
            v.add("stale_result_applied", || {
                format!(
                    "{id}: seq {} applied result:{} of a {status} attempt",
                    r.seq, r.stamp
                )
            });
        }
    }
}

/// Shape (point 3): everything in which the stored state and rows disagree
/// with the history, in the order of the module docs (the first is
/// reported).
fn shape_mismatches(
    state: &RunState,
    rows: &RunRows<'_>,
    by_stamp: &HashMap<Uuid, &AttemptRow>,
    results: &[AppliedResult<'_>],
) -> Vec<String> {
    let ts = rows.transitions;
    let mut shape = Vec::new();
    columns_agree(state, rows.run, &mut shape);
    last_transition_agrees(state, ts, &mut shape);
    chain_agrees(ts, &mut shape);
    attempts_agree(state, rows.attempts, by_stamp, &mut shape);
    attempts_explained(state, rows.attempts, ts, &mut shape);
    for r in results {
        if !matches!(
            r.status,
            Some("timed_out" | "cancelled" | "succeeded" | "failed")
        ) {
            shape.push(format!(
                "seq {} applied a result of an attempt that is {:?}",
                r.seq, r.status
            ));
        }
    }
    signals_agree(state, ts, &mut shape);
    let n = ts.len() as i64;
    if let Some(i) = rows.intents.iter().find(|i| i.seq < 1 || i.seq > n) {
        shape.push(format!("intent {} belongs to no transition", i.key));
    }
    shape
}

/// The state's identity, status and last seq are the columns', and
/// `finished_at` is set iff the status is terminal.
fn columns_agree(state: &RunState, run: &RunRow, shape: &mut Vec<String>) {
    if state.run_id != run.run_id
        || state.tenant != run.tenant
        || state.pool != run.pool
        || state.workflow != run.workflow
        || i64::from(state.workflow_version) != i64::from(run.workflow_version)
    {
        shape.push("identity columns differ from the state".to_string());
    }
    if state.status.as_str() != run.status {
        shape.push(format!(
            "status column {} but state {}",
            run.status,
            state.status.as_str()
        ));
    }
    if state.last_transition_seq != run.last_transition_seq {
        shape.push(format!(
            "state last_transition_seq {} but column {}",
            state.last_transition_seq, run.last_transition_seq
        ));
    }
    if run.finished != state.status.is_terminal() {
        shape.push("finished_at disagrees with the status".into());
    }
}

/// The state's status and step are where the last transition left them.
fn last_transition_agrees(state: &RunState, ts: &[TransitionRow], shape: &mut Vec<String>) {
    let Some(last) = ts.last() else {
        return;
    };
    if last.to_status != state.status.as_str() {
        shape.push(format!(
            "status {} but last transition (seq {}) went to {}",
            state.status.as_str(),
            last.seq,
            last.to_status
        ));
    }
    if i64::from(last.step_index) != i64::from(state.step_index) {
        shape.push("step_index differs from the last transition's".into());
    }
}

/// The history starts with `run.started` from `start`, each transition
/// starts where the previous one ended, and nothing follows a terminal one.
fn chain_agrees(ts: &[TransitionRow], shape: &mut Vec<String>) {
    if let Some(first) = ts.first()
        && (first.from_status.is_some()
            || first.kind != "run.started"
            || first.input_ref != "start")
    {
        shape.push("the first transition is not run.started from start".into());
    }
    for pair in ts.windows(2) {
        let (prev, t) = (&pair[0], &pair[1]);
        if t.from_status.as_deref() != Some(prev.to_status.as_str()) {
            shape.push(format!(
                "seq {} starts from {:?}, seq {} ended in {}",
                t.seq, t.from_status, prev.seq, prev.to_status
            ));
        }
        if !may_follow(prev, t) {
            shape.push(format!("seq {} follows a terminal transition", t.seq));
        }
    }
}

/// Whether `t` may follow `prev`: anything follows a transition that left
/// the run running; a failed run records signals, and is cancelled or
/// retried; nothing follows a success or a cancel.
fn may_follow(prev: &TransitionRow, t: &TransitionRow) -> bool {
    match prev.to_status.as_str() {
        "running" => true,
        "failed" => {
            t.input_ref == "cancel"
                || t.input_ref.starts_with("signal:")
                || t.input_ref.starts_with("retry:")
        }
        _ => false,
    }
}

/// The attempts in the state are exactly the `run_attempts` rows.
fn attempts_agree(
    state: &RunState,
    attempts: &[AttemptRow],
    by_stamp: &HashMap<Uuid, &AttemptRow>,
    shape: &mut Vec<String>,
) {
    if state.attempts.len() != attempts.len() {
        shape.push(format!(
            "{} attempts in state, {} rows",
            state.attempts.len(),
            attempts.len()
        ));
    }
    for a in &state.attempts {
        let Some(row) = by_stamp.get(&a.stamp) else {
            shape.push(format!("attempt {} has no row", a.stamp));
            continue;
        };
        let same = i64::from(row.step_index) == i64::from(a.step_index)
            && i64::from(row.attempt) == i64::from(a.attempt)
            && row.status == a.status.as_str()
            && row.dispatched_at == micros(a.dispatched_at)
            && row.deadline == micros(a.deadline)
            && row.finished_at == a.finished_at.map(micros)
            && row.error == a.error;
        if !same {
            shape.push(format!("attempt {} differs from its row", a.stamp));
        }
    }
}

/// Every attempt's status is explained by a transition of the history.
fn attempts_explained(
    state: &RunState,
    attempts: &[AttemptRow],
    ts: &[TransitionRow],
    shape: &mut Vec<String>,
) {
    let refs: HashSet<&str> = ts.iter().map(|t| t.input_ref.as_str()).collect();
    let last = ts.last();
    for a in attempts {
        let s = a.stamp;
        let explained = match a.status.as_str() {
            "succeeded" | "failed" => refs.contains(format!("result:{s}").as_str()),
            "timed_out" => refs.contains(format!("timer:timeout:{s}").as_str()),
            "cancelled" => {
                last.is_some_and(|t| {
                    abandons_attempts(t)
                        && t.detail.get("stamp").and_then(Value::as_str) == Some(&s.to_string())
                }) || ts.iter().any(|t| cancels(t, s))
            }
            "dispatched" => {
                !state.status.is_terminal()
                    && state
                        .outstanding
                        .iter()
                        .chain(state.lanes.iter().filter_map(|l| l.outstanding.as_ref()))
                        .any(|o| o.stamp == s)
            }
            _ => false,
        };
        if !explained {
            shape.push(format!(
                "attempt {s} is {} without a transition that explains it",
                a.status
            ));
        }
    }
}

/// Whether `t` cancelled the attempt `stamp` of a branch: its own failed
/// first, or the run ended.
pub fn cancels(t: &TransitionRow, stamp: Uuid) -> bool {
    let stamp = stamp.to_string();
    t.detail
        .get("cancelled_stamps")
        .and_then(Value::as_array)
        .is_some_and(|stamps| stamps.iter().any(|s| s.as_str() == Some(&stamp)))
}

/// The signals in the state are, in order, those the history recorded:
/// every transition a signal made (`run.signalled`, or the end of the wait
/// of an `await_signal` step) but one that failed the run because its state
/// would have been too large.
fn signals_agree(state: &RunState, ts: &[TransitionRow], shape: &mut Vec<String>) {
    let signal_ids: Vec<&str> = ts
        .iter()
        .filter(|t| t.detail.get("cause").and_then(Value::as_str) != Some(STATE_TOO_LARGE))
        .filter_map(|t| t.input_ref.strip_prefix("signal:"))
        .collect();
    let state_signals: Vec<&str> = state.signals.iter().map(|s| s.signal_id.as_str()).collect();
    if signal_ids != state_signals {
        shape.push(format!(
            "signals in state {state_signals:?}, in history {signal_ids:?}"
        ));
    }
}

/// At most once (point 4): no two transitions share an input.
fn at_most_once(id: &str, ts: &[TransitionRow], v: &mut Violations) {
    let refs: HashSet<&str> = ts.iter().map(|t| t.input_ref.as_str()).collect();
    if refs.len() != ts.len() {
        v.add("input_applied_twice", || {
            format!(
                "{id}: {} transitions, {} distinct input refs",
                ts.len(),
                refs.len()
            )
        });
    }
}

/// The stamp a transition introduced, if it dispatched an attempt or
/// began a wait: the first of them, from which the others derive (a
/// transition that starts branches introduces several). A transition
/// whose kind names none (a `branch.failed` that started a map's next
/// item) records it as `next_stamp`, or else as `first_stamp`.
pub fn introduced_stamp(t: &TransitionRow) -> Option<Uuid> {
    let field = match t.kind.as_str() {
        "run.started" | "step.retried" => "stamp",
        "step.succeeded" | "run.retried" => "next_stamp",
        _ => "first_stamp",
    };
    t.detail
        .get(field)
        .or_else(|| t.detail.get("next_stamp"))
        .or_else(|| t.detail.get("first_stamp"))
        .and_then(Value::as_str)
        .and_then(|s| Uuid::parse_str(s).ok())
}

/// Whether transition `t` introduced `stamp`: the first stamp it
/// introduced, or one derived from it.
pub fn introduced(t: &TransitionRow, stamp: Uuid) -> bool {
    let Some(first) = introduced_stamp(t) else {
        return false;
    };
    let most = u32::try_from(MAX_STEPS_IN_ALL).unwrap_or(u32::MAX);
    (0..most).any(|n| derived_stamp(first, n) == stamp)
}

enum Rebuild {
    Input(Input),
    Missing(String),
    Mismatch(String),
}

/// The input a transition applied, read back from where it came from.
fn rebuild_input(ctx: &Context<'_>, run: &RunRow, t: &TransitionRow) -> Rebuild {
    let Some((topic, partition, offset)) = &t.source else {
        if t.seq != 1 {
            return Rebuild::Missing(format!("seq {} records no source", t.seq));
        }
        // Decided over HTTP: the request is not in Kafka; the state keeps
        // everything the start carried, and its fingerprint tells whether
        // it asked for the version it runs or for the newest one.
        let s = &run.state;
        let text = |k: &str| s.get(k).and_then(Value::as_str).map(String::from);
        let mut start = RunStart {
            run_id: run.run_id.clone(),
            tenant: run.tenant.clone(),
            workflow: run.workflow.clone(),
            workflow_version: None,
            pool: run.pool.clone(),
            input: s.get("input").cloned().unwrap_or(Value::Null),
            correlation_id: text("correlation_id"),
            parent: None,
        };
        let stored = s.get("start_fingerprint").and_then(Value::as_str);
        if stored != Some(fingerprint::start(&start).as_str()) {
            start.workflow_version = u32::try_from(run.workflow_version).ok();
        }
        return Rebuild::Input(Input::Start(start));
    };
    let Some(msg) = ctx.inputs.get(&(topic.clone(), *partition, *offset)) else {
        return Rebuild::Missing(format!(
            "seq {}: no message at {topic}/{partition}@{offset}",
            t.seq
        ));
    };
    let Some(kind) = ctx.input_topic(topic) else {
        return Rebuild::Mismatch(format!("seq {}: source {topic} is no input topic", t.seq));
    };
    let source = ductor::contract::Source {
        topic: topic.clone(),
        partition: *partition,
        offset: *offset,
    };
    match ductor::harness::classify(kind, &msg.payload, &source, &ctx.limits) {
        Ok(ductor::harness::Classified::Routed(request)) => {
            let mut start = request.start;
            start.run_id = run.run_id.clone();
            Rebuild::Input(Input::Start(start))
        }
        Ok(ductor::harness::Classified::Input(input)) => Rebuild::Input(input),
        Err(e) => Rebuild::Mismatch(format!(
            "seq {}: its source message does not decode: {e}",
            t.seq
        )),
    }
}

/// Runs the fold over the run's inputs; see point 6 of the module docs.
fn replay(ctx: &Context<'_>, rows: &RunRows<'_>, v: &mut Violations) {
    let run = rows.run;
    let id = &run.run_id;
    let mut state: Option<RunState> = None;
    for t in rows.transitions {
        match replay_one(ctx, rows, state.as_ref(), t) {
            Ok(next) => state = Some(next),
            Err((kind, why)) => {
                v.add(kind, || format!("{id}: {why}"));
                return;
            }
        }
    }
    let Some(replayed) = state else { return };
    let Ok(mut replayed) = serde_json::to_value(&replayed) else {
        return;
    };
    let mut stored = run.state.clone();
    normalize(&mut replayed);
    normalize(&mut stored);
    if replayed != stored {
        v.add("state_replay_mismatch", || {
            format!("{id}: stored state differs from the replay of its history")
        });
    }
}

/// One transition replayed on the state before it: the state after it, or
/// the violation kind and why it does not replay to the stored row and
/// intents.
fn replay_one(
    ctx: &Context<'_>,
    rows: &RunRows<'_>,
    state: Option<&RunState>,
    t: &TransitionRow,
) -> Result<RunState, (&'static str, String)> {
    const MISMATCH: &str = "state_replay_mismatch";
    let tr = if t.source.is_none() && t.input_ref == MISSING_WORKFLOW_REF {
        replay_missing_workflow(rows, state, t)?
    } else {
        let input = match rebuild_input(ctx, rows.run, t) {
            Rebuild::Input(i) => i,
            Rebuild::Missing(why) => return Err(("transition_source_missing", why)),
            Rebuild::Mismatch(why) => return Err((MISMATCH, why)),
        };
        match fold_as_recorded(ctx, state, &input, t) {
            Decision::Transition(tr) => *tr,
            Decision::NoOp(r) => {
                let what = format!("a no-op ({})", r.as_str());
                return Err((MISMATCH, replays_to(t, &what)));
            }
            Decision::Rejection(r) => {
                let what = format!("a rejection ({})", r.class.as_str());
                return Err((MISMATCH, replays_to(t, &what)));
            }
        }
    };
    let r = &tr.record;
    let same_record = r.seq == t.seq
        && r.input_ref == t.input_ref
        && r.kind.as_str() == t.kind
        && r.from_status.map(|s| s.as_str()) == t.from_status.as_deref()
        && r.to_status.as_str() == t.to_status
        && i64::from(r.step_index) == i64::from(t.step_index)
        && r.detail == t.detail;
    if !same_record {
        return Err((
            MISMATCH,
            format!(
                "seq {} replays to {} {} {}, stored {} {} {}",
                t.seq,
                r.kind.as_str(),
                r.input_ref,
                r.detail,
                t.kind,
                t.input_ref,
                t.detail
            ),
        ));
    }
    compare_effects(ctx, rows, t, &tr.effects)
        .map_err(|why| (MISMATCH, format!("seq {}: {why}", t.seq)))?;
    Ok(tr.state)
}

/// The transition `serve` makes from no input when the run's workflow
/// version is no longer defined, replayed by the pure function that made
/// it. The checker cannot know what `serve` had in its workflows
/// directory then (its own workflows replay the run's earlier
/// transitions): it checks that the transition is the run's last and is
/// what the coordinator makes of the state before it once the run's
/// workflow is gone.
fn replay_missing_workflow(
    rows: &RunRows<'_>,
    state: Option<&RunState>,
    t: &TransitionRow,
) -> Result<Transition, (&'static str, String)> {
    const MISMATCH: &str = "state_replay_mismatch";
    let last = rows.transitions.last().map(|l| l.seq);
    if last != Some(t.seq) {
        return Err((
            MISMATCH,
            format!("seq {} ({}) is not the run's last", t.seq, t.input_ref),
        ));
    }
    let Some(state) = state else {
        return Err((
            "transition_source_missing",
            format!("seq {} ({}) has no run to fail", t.seq, t.input_ref),
        ));
    };
    let gone = Workflows::default();
    fail_missing_workflow(state, &gone, t.created_at)
        .ok_or_else(|| (MISMATCH, replays_to(t, "nothing (the run is finished)")))
}

/// Why a transition does not replay: its input folds to something else.
fn replays_to(t: &TransitionRow, what: &str) -> String {
    format!("seq {} ({}) replays to {what}", t.seq, t.input_ref)
}

/// The fold of `input` as the coordinator ran it: at the transition's
/// recorded time, with the stamp it introduced, and with the jitter that
/// reproduces its recorded backoff.
fn fold_as_recorded(
    ctx: &Context<'_>,
    state: Option<&RunState>,
    input: &Input,
    t: &TransitionRow,
) -> Decision {
    let fold_with = |entropy: &Entropy| {
        fold(
            state,
            input,
            ctx.workflows,
            ctx.max_state_bytes,
            t.created_at,
            entropy,
        )
    };
    let mut entropy = Entropy {
        stamp: introduced_stamp(t).unwrap_or(Uuid::nil()),
        jitter_unit: 0.0,
    };
    let decision = fold_with(&entropy);
    match recover_jitter(ctx, state, &decision, t) {
        Some(unit) => {
            entropy.jitter_unit = unit;
            fold_with(&entropy)
        }
        None => decision,
    }
}

/// The jitter unit that reproduces the recorded backoff, when the fold with
/// no jitter chose another one.
fn recover_jitter(
    ctx: &Context<'_>,
    state: Option<&RunState>,
    decision: &Decision,
    t: &TransitionRow,
) -> Option<f64> {
    let Decision::Transition(tr) = decision else {
        return None;
    };
    let unjittered = tr.record.detail.get("backoff_ms")?.as_u64()?;
    let recorded = t.detail.get("backoff_ms")?.as_u64()?;
    if unjittered == recorded || unjittered == 0 {
        return None;
    }
    let s = state?;
    let def = ctx.workflows.get(&s.workflow, s.workflow_version)?;
    // The step of the attempt that failed: the run's, or a branch's.
    let failed = t.detail.get("stamp")?.as_str()?;
    let failed = s.attempt_by_stamp(Uuid::parse_str(failed).ok()?)?;
    let jitter = def.step(failed.step_index)?.retry.jitter;
    if jitter <= 0.0 {
        return None;
    }
    Some(((1.0 - recorded as f64 / unjittered as f64) / jitter).clamp(0.0, 0.999_999_999))
}

/// The effects of a replayed transition against the intents its seq committed.
fn compare_effects(
    ctx: &Context<'_>,
    rows: &RunRows<'_>,
    t: &TransitionRow,
    effects: &[ductor::contract::Effect],
) -> Result<(), String> {
    let run = rows.run;
    let mine: Vec<&&IntentRow> = rows.intents.iter().filter(|i| i.seq == t.seq).collect();
    for (index, effect) in effects.iter().enumerate() {
        let Some(intent) = mine.iter().find(|i| i.effect_index as usize == index) else {
            if cancelled_timeout(&effect.payload, rows.attempts) {
                continue;
            }
            return Err(format!("effect {index} has no intent"));
        };
        // Compared as JSON values: the state is reloaded from jsonb between
        // batches, which reorders object keys inside step inputs, so the
        // bytes depend on batch boundaries the history does not record.
        let stored: Option<Value> = serde_json::from_slice(&intent.payload).ok();
        let due = micros(effect.not_before.unwrap_or(t.created_at));
        let differs = [
            ("topic", intent.topic != effect.target.topic(ctx.topics)),
            ("payload", stored.as_ref() != Some(&effect.payload)),
            ("ce_type", intent.ce_type != effect.kind.ce_type()),
            ("not_before", intent.not_before != due),
            ("tenant", intent.tenant != run.tenant),
            (
                "message key",
                intent.message_key != effect.target.other_run().unwrap_or(&run.run_id).as_bytes(),
            ),
        ];
        if let Some((field, _)) = differs.iter().find(|(_, d)| *d) {
            return Err(format!(
                "intent {} differs from the replayed effect in its {field}",
                intent.key
            ));
        }
    }
    for intent in &mine {
        let index = intent.effect_index as usize;
        let routed_accept =
            t.seq == 1 && index == effects.len() && intent.ce_type == "ductor.run.accepted";
        if index >= effects.len() && !routed_accept {
            return Err(format!("intent {} has no replayed effect", intent.key));
        }
    }
    Ok(())
}

/// A step's timeout timer may be deleted while still pending by the
/// transition that finishes its attempt (it could only fold into a no-op):
/// true for such a timer whose attempt is indeed no longer dispatched.
pub fn cancelled_timeout(payload: &Value, attempts: &[AttemptRow]) -> bool {
    let text = |k: &str| payload.get(k).and_then(Value::as_str);
    if text("type") != Some("wakeup.timer") || text("timer") != Some("timeout") {
        return false;
    }
    let Some(stamp) = text("stamp").and_then(|s| Uuid::parse_str(s).ok()) else {
        return false;
    };
    attempts
        .iter()
        .any(|a| a.stamp == stamp && a.status != "dispatched")
}

/// Drops `record_version` and cuts every timestamp to the microsecond, the
/// precision Postgres keeps, so a state can be compared with its replay.
pub fn normalize(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.remove("record_version");
            for (_, x) in map.iter_mut() {
                normalize_inner(x);
            }
        }
        other => normalize_inner(other),
    }
}

fn normalize_inner(v: &mut Value) {
    match v {
        Value::String(s) => {
            if s.len() >= 20
                && s.as_bytes().get(4) == Some(&b'-')
                && let Ok(t) = DateTime::parse_from_rfc3339(s)
            {
                *s = micros(t.with_timezone(&Utc))
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize_inner),
        Value::Object(map) => map.iter_mut().for_each(|(_, x)| normalize_inner(x)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductor::coordinator::{StepDefinition, Transition, WorkflowDefinition};

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    fn workflows() -> Workflows {
        Workflows::new(vec![WorkflowDefinition {
            name: "wf".into(),
            version: 1,
            steps: vec![StepDefinition::task("a", "p", 60_000)],
            output_topic: None,
            output: None,
        }])
        .unwrap()
    }

    #[test]
    fn after_a_failure_only_a_signal_a_cancel_or_a_retry_follows() {
        let row = |input_ref: &str, to: &str| TransitionRow {
            run_id: "r".into(),
            seq: 1,
            input_ref: input_ref.into(),
            kind: "run.signalled".into(),
            from_status: None,
            to_status: to.into(),
            step_index: 0,
            detail: Value::Null,
            source: None,
            created_at: at(0),
        };
        let failed = row("result:x", "failed");
        for next in ["signal:s", "cancel", "retry:a"] {
            assert!(may_follow(&failed, &row(next, "failed")), "{next}");
        }
        assert!(!may_follow(&failed, &row("result:y", "running")));
        assert!(!may_follow(&failed, &row("start", "running")));
        for ended in ["succeeded", "cancelled"] {
            assert!(!may_follow(
                &row("cancel", ended),
                &row("retry:a", "running")
            ));
        }
        assert!(may_follow(
            &row("start", "running"),
            &row("result:x", "running")
        ));
    }

    fn transition_row(t: &Transition) -> TransitionRow {
        let r = &t.record;
        TransitionRow {
            run_id: t.state.run_id.clone(),
            seq: r.seq,
            input_ref: r.input_ref.clone(),
            kind: r.kind.as_str().into(),
            from_status: r.from_status.map(|s| s.as_str().into()),
            to_status: r.to_status.as_str().into(),
            step_index: r.step_index as i32,
            detail: r.detail.clone(),
            source: None,
            created_at: r.at,
        }
    }

    fn intent_rows(topics: &TopicNames, t: &Transition) -> Vec<IntentRow> {
        let s = &t.state;
        t.effects
            .iter()
            .enumerate()
            .map(|(index, effect)| IntentRow {
                run_id: s.run_id.clone(),
                seq: t.record.seq,
                effect_index: index as i32,
                key: ductor::contract::idempotency_key(&s.run_id, t.record.seq, index),
                tenant: s.tenant.clone(),
                topic: effect.target.topic(topics),
                message_key: s.run_id.as_bytes().to_vec(),
                headers: Value::Null,
                payload: serde_json::to_vec(&effect.payload).unwrap(),
                ce_type: effect.kind.ce_type().into(),
                not_before: effect.not_before.unwrap_or(t.record.at),
                due_at: effect.not_before.unwrap_or(t.record.at),
                status: "completed".into(),
            })
            .collect()
    }

    /// The rows a run started over HTTP and then failed by `serve` for its
    /// missing workflow leaves, as the store writes them.
    struct Stored {
        run: RunRow,
        transitions: Vec<TransitionRow>,
        attempts: Vec<AttemptRow>,
        intents: Vec<IntentRow>,
    }

    fn stored(topics: &TopicNames) -> Stored {
        let start = Input::Start(RunStart {
            run_id: "r1".into(),
            tenant: "acme".into(),
            workflow: "wf".into(),
            workflow_version: None,
            pool: "default".into(),
            input: serde_json::json!({"x": 1}),
            correlation_id: None,
            parent: None,
        });
        let entropy = Entropy {
            stamp: Uuid::from_u128(7),
            jitter_unit: 0.0,
        };
        let Decision::Transition(started) =
            fold(None, &start, &workflows(), usize::MAX, at(0), &entropy)
        else {
            panic!("the start applies")
        };
        let failed = fail_missing_workflow(&started.state, &Workflows::default(), at(5))
            .expect("the run fails");
        let mut state = failed.state.clone();
        state.record_version = 2;
        let attempts = state
            .attempts
            .iter()
            .map(|a| AttemptRow {
                stamp: a.stamp,
                run_id: "r1".into(),
                step_index: a.step_index as i32,
                attempt: a.attempt as i32,
                status: a.status.as_str().into(),
                dispatched_at: a.dispatched_at,
                deadline: a.deadline,
                finished_at: a.finished_at,
                error: a.error.clone(),
            })
            .collect();
        let mut intents = intent_rows(topics, &started);
        intents.extend(intent_rows(topics, &failed));
        Stored {
            run: RunRow {
                run_id: "r1".into(),
                tenant: "acme".into(),
                pool: "default".into(),
                workflow: "wf".into(),
                workflow_version: 1,
                status: "failed".into(),
                record_version: 2,
                last_transition_seq: 2,
                state: serde_json::to_value(&state).unwrap(),
                finished: true,
            },
            transitions: vec![transition_row(&started), transition_row(&failed)],
            attempts,
            intents,
        }
    }

    fn check(stored: &Stored, topics: &TopicNames) -> Violations {
        let wf = workflows();
        let inputs = HashMap::new();
        let ctx = Context {
            workflows: &wf,
            topics,
            inputs: &inputs,
            requests_topic: "ductor.requests",
            wakeups_topic: "ductor.wakeups",
            results_topic: "ductor.attempt-results",
            limits: ductor::contract::InputLimits::sized(1 << 20),
            max_state_bytes: 1 << 22,
        };
        let intents: Vec<&IntentRow> = stored.intents.iter().collect();
        let rows = RunRows {
            run: &stored.run,
            transitions: &stored.transitions,
            attempts: &stored.attempts,
            intents: &intents,
        };
        let mut v = Violations::default();
        check_run(&ctx, &rows, &mut v);
        v
    }

    /// A run failed by `serve` because its workflow version is gone checks
    /// clean: its last transition has no source and is replayed by the
    /// coordinator's own function, attempt and event included; the same
    /// transition tampered with, or not the run's last, does not.
    #[test]
    fn a_run_failed_for_its_missing_workflow_replays_and_tampering_is_caught() {
        let topics = TopicNames {
            prefix: "ductor.".into(),
        };
        let clean = stored(&topics);
        assert_eq!(clean.transitions[1].input_ref, MISSING_WORKFLOW_REF);
        assert_eq!(clean.attempts[0].status, "cancelled");
        let v = check(&clean, &topics);
        assert_eq!(v.total(), 0, "{v:?}");

        let mut tampered = stored(&topics);
        tampered.transitions[1].detail["error"] = "something else".into();
        let v = check(&tampered, &topics);
        assert_eq!(v.counts.get("state_replay_mismatch"), Some(&1), "{v:?}");

        let mut another_ref = stored(&topics);
        another_ref.transitions[1].input_ref = "maintenance:other".into();
        let v = check(&another_ref, &topics);
        assert_eq!(v.counts.get("transition_source_missing"), Some(&1), "{v:?}");

        let mut not_last = stored(&topics);
        let mut after = not_last.transitions[1].clone();
        after.seq = 3;
        after.input_ref = "cancel".into();
        not_last.transitions.push(after);
        not_last.run.last_transition_seq = 3;
        let v = check(&not_last, &topics);
        let replay = v.examples.get("state_replay_mismatch").cloned();
        assert!(
            replay.is_some_and(|e| e[0].contains("is not the run's last")),
            "{v:?}"
        );
    }
}
