//! Unit tests of parallel steps: branches dispatched at once with their
//! own stamps, results in any order, the step's result, the failure
//! policies, retries, timeouts and waits in a branch, a cancel, a retry of
//! the run, nesting, and the definition checks of branches.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use serde_json::{Value, json};
use uuid::Uuid;

use super::definition::{OnFailure, OnTimeout, Rule};
use super::fold::*;
use super::state::LaneStatus;
use super::tests::{
    STATE_CAP, apply, entropy, result_ok, start_with as start, t, transition,
    workflow_of as workflow,
};
use super::*;
use crate::contract::*;

fn task(name: &str) -> StepDefinition {
    StepDefinition {
        retry: RetryPolicy {
            max_attempts: 2,
            jitter: 0.0,
            ..RetryPolicy::default()
        },
        ..StepDefinition::task(name, "p", 1000)
    }
}

/// `reserve` runs `east` (e1 then e2) and `west` (w1) at once; `ship`
/// follows. Indices: reserve 0, ship 1, e1 2, e2 3, w1 4.
fn reserve(on_failure: OnFailure) -> Workflows {
    let parallel = StepDefinition {
        on_failure,
        ..StepDefinition::parallel(
            "reserve",
            vec![
                ("east", vec![task("e1"), task("e2")]),
                ("west", vec![task("w1")]),
            ],
        )
    };
    Workflows::new(vec![workflow(vec![parallel, task("ship")])]).unwrap()
}

fn dispatches(tr: &Transition) -> Vec<Value> {
    tr.effects
        .iter()
        .filter(|e| matches!(e.target, EffectTarget::StepQueue { .. }))
        .map(|e| e.payload.clone())
        .collect()
}

/// The stamp of the attempt outstanding at step `index`, in a branch or not.
fn stamp_at(s: &RunState, index: u32) -> Uuid {
    s.lanes
        .iter()
        .filter_map(|l| l.outstanding.as_ref())
        .chain(s.outstanding.as_ref())
        .find(|o| o.step_index == index)
        .map(|o| o.stamp)
        .unwrap_or_else(|| panic!("no attempt outstanding at step {index}"))
}

fn result_err(stamp: Uuid, retryable: bool) -> Input {
    Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp,
        outcome: AttemptOutcome::Failed {
            message: "no stock".into(),
            retryable,
        },
    })
}

fn timer(kind: TimerKind, stamp: Uuid) -> Input {
    Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: kind,
        stamp,
    })
}

#[test]
fn a_parallel_step_dispatches_each_branch_at_once_with_its_own_stamp() {
    let wf = reserve(OnFailure::FailFast);
    let tr = start(&wf, json!({"order": 7}));
    assert_eq!(tr.record.kind, TransitionKind::RunStarted);
    let sent = dispatches(&tr);
    assert_eq!(sent.len(), 2, "one attempt per branch");
    assert_eq!(sent[0]["step"], "e1");
    assert_eq!(sent[0]["branch"], "east");
    assert_eq!(sent[1]["step"], "w1");
    assert_eq!(sent[1]["branch"], "west");
    assert_eq!(sent[0]["input"], json!({"order": 7}));
    assert_eq!(sent[1]["input"], json!({"order": 7}));
    assert_eq!(sent[0]["step_key"], "r1/step/2");
    assert_eq!(sent[1]["step_key"], "r1/step/4");
    // The first stamp is the entropy's, the detail names it, and the
    // other is derived from it: new, and the same on every replay.
    assert_eq!(sent[0]["stamp"], tests::stamp(1).to_string());
    assert_eq!(tr.record.detail["stamp"], tests::stamp(1).to_string());
    assert_ne!(sent[1]["stamp"], sent[0]["stamp"]);
    let again = start(&wf, json!({"order": 7}));
    assert_eq!(dispatches(&again)[1]["stamp"], sent[1]["stamp"]);
    // Each attempt has its timeout timer; the run's own cursor stays on
    // the parallel step with nothing outstanding.
    let timers = tr
        .effects
        .iter()
        .filter(|e| e.kind == EffectKind::WakeupTimer)
        .count();
    assert_eq!(timers, 2);
    assert_eq!(tr.state.step_index, 0);
    assert_eq!(tr.state.outstanding, None);
    assert_eq!(tr.state.lanes.len(), 2);
    assert!(
        tr.state
            .lanes
            .iter()
            .all(|l| l.status == LaneStatus::Running)
    );
    assert_eq!(tr.state.attempts.len(), 2);
}

/// Runs `reserve` to its end, answering the branches' attempts in the
/// order `order` gives (by step index), and returns the last transition.
fn finish_in_order(wf: &Workflows, order: &[u32]) -> Transition {
    let mut tr = start(wf, json!({"order": 7}));
    for (e, &index) in (10_u32..).zip(order) {
        let s = stamp_at(&tr.state, index);
        let output = json!({ "done": index });
        tr = apply(
            &tr.state,
            &result_ok(s, output),
            wf,
            i64::from(e),
            u128::from(e),
        );
    }
    tr
}

#[test]
fn the_step_ends_when_every_branch_ended_with_their_results_by_name() {
    let wf = reserve(OnFailure::FailFast);
    let mut tr = start(&wf, json!({"order": 7}));
    // west ends first: the step waits for east.
    let w1 = stamp_at(&tr.state, 4);
    tr = apply(&tr.state, &result_ok(w1, json!({"w": 1})), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(tr.record.detail["completed_step"], 4);
    assert!(dispatches(&tr).is_empty());
    assert_eq!(tr.state.step_index, 0, "the step still runs");
    // A duplicate of west's result changes nothing.
    let again = fold(
        Some(&tr.state),
        &result_ok(w1, json!({"w": 1})),
        &wf,
        STATE_CAP,
        t(11),
        &entropy(3),
    );
    assert_eq!(again, Decision::NoOp(NoOpReason::DuplicateResult));
    // east's first step: its second gets e1's output.
    let e1 = stamp_at(&tr.state, 2);
    tr = apply(&tr.state, &result_ok(e1, json!({"e": 1})), &wf, 20, 4);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    let sent = dispatches(&tr);
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (&sent[0]["step"], &sent[0]["branch"]),
        (&json!("e2"), &json!("east"))
    );
    assert_eq!(sent[0]["input"], json!({"e": 1}));
    assert_eq!(tr.record.detail["next_stamp"], tests::stamp(4).to_string());
    // east's last step ends the step: ship gets the branches' results.
    let e2 = stamp_at(&tr.state, 3);
    tr = apply(&tr.state, &result_ok(e2, json!({"e": 2})), &wf, 30, 5);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    let sent = dispatches(&tr);
    assert_eq!(sent[0]["step"], "ship");
    assert_eq!(sent[0].get("branch"), None);
    let both = json!({"east": {"e": 2}, "west": {"w": 1}});
    assert_eq!(sent[0]["input"], both);
    assert_eq!(
        tr.record.detail["passed_steps"],
        json!([{"step_index": 0, "output": both}])
    );
    assert_eq!(tr.state.step_index, 1);
    assert!(tr.state.lanes.is_empty(), "an ended step keeps no lanes");
    let ship = stamp_at(&tr.state, 1);
    tr = apply(
        &tr.state,
        &result_ok(ship, json!({"shipped": true})),
        &wf,
        40,
        6,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
}

#[test]
fn the_branches_results_in_any_order_make_the_same_run() {
    let wf = reserve(OnFailure::FailFast);
    let a = finish_in_order(&wf, &[2, 3, 4]);
    let b = finish_in_order(&wf, &[4, 2, 3]);
    let c = finish_in_order(&wf, &[2, 4, 3]);
    for tr in [&a, &b, &c] {
        assert_eq!(tr.state.step_index, 1);
        assert_eq!(
            dispatches(tr)[0]["input"],
            json!({"east": {"done": 3}, "west": {"done": 4}})
        );
    }
}

#[test]
fn a_failed_branch_fails_the_step_at_once_and_cancels_the_others() {
    let wf = reserve(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let e1 = stamp_at(&tr.state, 2);
    let w1 = stamp_at(&tr.state, 4);
    let failed = apply(&tr.state, &result_err(w1, false), &wf, 10, 2);
    assert_eq!(failed.record.kind, TransitionKind::RunFailed);
    assert_eq!(failed.state.status, RunStatus::Failed);
    let d = &failed.record.detail;
    assert_eq!(d["cause"], BRANCH_FAILED);
    assert_eq!(d["branch_cause"], "not_retryable");
    assert_eq!(d["failed_branch"], "west");
    assert_eq!(d["cancelled_stamps"], json!([e1.to_string()]));
    let error = failed.state.error.clone().unwrap();
    assert!(
        error.starts_with("branch_failed: branch \"west\" of step 0 (reserve) failed: "),
        "{error}"
    );
    let east = failed.state.attempt_by_stamp(e1).unwrap();
    assert_eq!(east.status, AttemptStatus::Cancelled);
    assert!(failed.attempt_writes.iter().any(|w| matches!(w,
        AttemptWrite::Finish { stamp, status: AttemptStatus::Cancelled, .. } if *stamp == e1)));
    assert!(failed.state.lanes.is_empty());
    // east's late result and its timeout change nothing.
    let late = fold(
        Some(&failed.state),
        &result_ok(e1, json!({})),
        &wf,
        STATE_CAP,
        t(20),
        &entropy(3),
    );
    assert_eq!(late, Decision::NoOp(NoOpReason::StaleResult));
    let timeout = fold(
        Some(&failed.state),
        &timer(TimerKind::Timeout, e1),
        &wf,
        STATE_CAP,
        t(2000),
        &entropy(4),
    );
    assert_eq!(timeout, Decision::NoOp(NoOpReason::DuplicateTimer));
}

#[test]
fn with_all_settled_the_step_fails_once_every_branch_ended() {
    let wf = reserve(OnFailure::AllSettled);
    let tr = start(&wf, json!({}));
    let w1 = stamp_at(&tr.state, 4);
    let tr = apply(&tr.state, &result_err(w1, false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::BranchFailed);
    assert_eq!(tr.state.status, RunStatus::Running);
    assert_eq!(tr.record.detail["cause"], "not_retryable");
    let west = tr.state.lanes.iter().find(|l| l.branch == 1).unwrap();
    assert_eq!(west.status, LaneStatus::Failed);
    // east goes on to its end; then the step fails, naming west.
    let e1 = stamp_at(&tr.state, 2);
    let tr = apply(&tr.state, &result_ok(e1, json!({})), &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    let e2 = stamp_at(&tr.state, 3);
    let tr = apply(&tr.state, &result_ok(e2, json!({})), &wf, 30, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], BRANCH_FAILED);
    assert_eq!(tr.record.detail["failed_branch"], "west");
    assert_eq!(tr.record.detail.get("cancelled_stamps"), None);
    assert_eq!(tr.state.step_index, 0);
    // A retry of the run starts every branch again, numbering attempts on.
    let retry = Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: "again".into(),
        failed_seq: tr.state.last_transition_seq,
        reason: None,
    });
    let again = apply(&tr.state, &retry, &wf, 40, 9);
    assert_eq!(again.record.kind, TransitionKind::RunRetried);
    let sent = dispatches(&again);
    assert_eq!(sent.len(), 2);
    assert_eq!(
        (&sent[0]["step"], &sent[0]["attempt"]),
        (&json!("e1"), &json!(2))
    );
    assert_eq!(
        (&sent[1]["step"], &sent[1]["attempt"]),
        (&json!("w1"), &json!(2))
    );
    assert_eq!(
        again.record.detail["next_stamp"],
        tests::stamp(9).to_string()
    );
    assert_eq!(again.state.lanes.len(), 2);
}

#[test]
fn a_branch_retries_and_times_out_on_its_own() {
    let wf = reserve(OnFailure::FailFast);
    let tr = start(&wf, json!({"n": 1}));
    let w1 = stamp_at(&tr.state, 4);
    let e1 = stamp_at(&tr.state, 2);
    // west's attempt fails and is retried after its backoff.
    let tr = apply(&tr.state, &result_err(w1, true), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepRetryScheduled);
    let west = tr.state.lanes.iter().find(|l| l.branch == 1).unwrap();
    assert_eq!(west.pending_retry.as_ref().map(|p| p.after_stamp), Some(w1));
    let tr = apply(&tr.state, &timer(TimerKind::Retry, w1), &wf, 300, 3);
    assert_eq!(tr.record.kind, TransitionKind::StepRetried);
    let sent = dispatches(&tr);
    assert_eq!(
        (&sent[0]["step"], &sent[0]["attempt"], &sent[0]["branch"]),
        (&json!("w1"), &json!(2), &json!("west"))
    );
    assert_eq!(sent[0]["input"], json!({"n": 1}));
    assert_eq!(sent[0]["stamp"], tests::stamp(3).to_string());
    // east's attempt times out: retried too, west untouched.
    let tr = apply(&tr.state, &timer(TimerKind::Timeout, e1), &wf, 1000, 4);
    assert_eq!(tr.record.kind, TransitionKind::StepTimedOut);
    assert_eq!(
        tr.state.attempt_by_stamp(e1).unwrap().status,
        AttemptStatus::TimedOut
    );
    assert_eq!(stamp_at(&tr.state, 4), tests::stamp(3));
    // The retry timer of west, delivered again, changes nothing.
    let dup = fold(
        Some(&tr.state),
        &timer(TimerKind::Retry, w1),
        &wf,
        STATE_CAP,
        t(1001),
        &entropy(5),
    );
    assert_eq!(dup, Decision::NoOp(NoOpReason::DuplicateTimer));
}

#[test]
fn a_cancel_ends_every_branch() {
    let wf = reserve(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let cancel = Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: Some("user".into()),
        action_id: None,
    });
    let tr = apply(&tr.state, &cancel, &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunCancelled);
    assert_eq!(
        tr.record.detail["cancelled_stamps"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    assert!(
        tr.state
            .attempts
            .iter()
            .all(|a| a.status == AttemptStatus::Cancelled)
    );
    assert!(tr.state.lanes.is_empty());
}

#[test]
fn branches_sleep_and_nest() {
    // outer: a runs a sleep then an inner parallel of two tasks; b a task.
    // Indices: outer 0, a.nap 1, a.inner 2, b.t3 3, x 4, y 5.
    let inner = StepDefinition::parallel(
        "inner",
        vec![("x", vec![task("x")]), ("y", vec![task("y")])],
    );
    let outer = StepDefinition::parallel(
        "outer",
        vec![
            ("a", vec![StepDefinition::sleep("nap", 50), inner]),
            ("b", vec![task("t3")]),
        ],
    );
    let wf = Workflows::new(vec![WorkflowDefinition {
        output: Some("/steps/outer".into()),
        ..workflow(vec![outer])
    }])
    .unwrap();
    let tr = start(&wf, json!({"k": 1}));
    assert_eq!(dispatches(&tr).len(), 1, "a sleeps, b dispatches");
    let nap = tr.state.lanes[0].waiting.clone().expect("a sleeps");
    assert_eq!(nap.stamp, tests::stamp(1));
    let tr = apply(&tr.state, &timer(TimerKind::Wake, nap.stamp), &wf, 60, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    let sent = dispatches(&tr);
    assert_eq!(sent.len(), 2);
    assert_eq!(
        (&sent[0]["step"], &sent[0]["branch"]),
        (&json!("x"), &json!("x"))
    );
    assert_eq!(
        sent[0]["input"],
        json!({"k": 1, "nap": {"until": "2023-11-14T22:13:20.050Z"}})
    );
    assert_eq!(tr.state.lanes.len(), 4);
    let (x, y, t3) = (
        stamp_at(&tr.state, 4),
        stamp_at(&tr.state, 5),
        stamp_at(&tr.state, 3),
    );
    let tr = apply(&tr.state, &result_ok(y, json!("y")), &wf, 70, 3);
    let tr = apply(&tr.state, &result_ok(t3, json!("t3")), &wf, 80, 4);
    assert_eq!(tr.state.status, RunStatus::Running);
    let tr = apply(&tr.state, &result_ok(x, json!("x")), &wf, 90, 5);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(
        tr.state.output,
        json!({"a": {"x": "x", "y": "y"}, "b": "t3"})
    );
    assert!(tr.state.lanes.is_empty());
}

#[test]
fn a_nested_branch_that_fails_fails_the_branches_around_it() {
    let inner = StepDefinition::parallel(
        "inner",
        vec![("x", vec![task("x")]), ("y", vec![task("y")])],
    );
    let outer =
        StepDefinition::parallel("outer", vec![("a", vec![inner]), ("b", vec![task("t3")])]);
    let wf = Workflows::new(vec![workflow(vec![outer])]).unwrap();
    let tr = start(&wf, json!({}));
    assert_eq!(dispatches(&tr).len(), 3);
    // Indices: outer 0, inner 1, t3 2, x 3, y 4.
    let x = stamp_at(&tr.state, 3);
    let tr = apply(&tr.state, &result_err(x, false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["failed_branch"], "a");
    assert_eq!(
        tr.record.detail["cancelled_stamps"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    assert!(tr.state.lanes.is_empty());
    let error = tr.state.error.unwrap();
    assert!(
        error.contains(
            "branch \"a\" of step 0 (outer) failed: branch_failed: branch \"x\" of step 1 (inner)"
        ),
        "{error}"
    );
}

#[test]
fn definitions_with_branches_are_checked() {
    let check =
        |steps: Vec<StepDefinition>| workflow(steps).validate().map_err(|e| (e.rule, e.field));
    let branch = |steps| vec![StepDefinition::parallel("p", vec![("a", steps)])];
    // A choice in a branch goes on at a later step of its own branch.
    let fast = || condition::Condition {
        pointer: Some("/input/fast".into()),
        equals: Some(json!(true)),
        ..condition::Condition::default()
    };
    assert_eq!(
        check(branch(vec![
            task("b0"),
            StepDefinition::choice("c", vec![("b0", fast())], "b1"),
            task("b1"),
        ])),
        Err((
            Rule::NotInBranch,
            "steps[0].branches[0].steps[1].choices".into()
        ))
    );
    assert_eq!(
        check(vec![StepDefinition::parallel(
            "p",
            vec![
                (
                    "a",
                    vec![
                        StepDefinition::choice("c", vec![("w1", fast())], "a1"),
                        task("a1")
                    ]
                ),
                ("b", vec![task("w1")]),
            ]
        )]),
        Err((
            Rule::NotInBranch,
            "steps[0].branches[0].steps[0].choices".into()
        ))
    );
    assert_eq!(
        check(branch(vec![StepDefinition {
            next: Some("x".into()),
            ..task("x")
        }])),
        Err((
            Rule::NotInBranch,
            "steps[0].branches[0].steps[0].next".into()
        ))
    );
    assert_eq!(
        check(vec![
            StepDefinition::parallel("p", vec![("a", vec![task("a1")])]),
            task("a1")
        ]),
        Err((
            Rule::DuplicateStep,
            "steps[0].branches[0].steps[0].name".into()
        ))
    );
    assert_eq!(
        check(vec![StepDefinition {
            pool: "p".into(),
            ..StepDefinition::parallel("p", vec![("a", vec![task("a1")])])
        }]),
        Err((Rule::FieldOfOtherKind, "steps[0].pool".into()))
    );
    assert_eq!(
        check(vec![StepDefinition::parallel("p", vec![])]).map_err(|e| e.1),
        Err("steps[0].branches".into())
    );
    let mut deep = task("leaf");
    for depth in 0..4 {
        deep = StepDefinition::parallel(&format!("p{depth}"), vec![("b", vec![deep])]);
    }
    assert_eq!(
        check(vec![deep.clone()]).map_err(|e| e.0),
        Err(Rule::TooDeep)
    );
    // Three deep is allowed.
    let StepDefinition { branches, .. } = deep;
    assert_eq!(check(branches[0].steps.clone()), Ok(()));
    // A branch reads what its parallel step could.
    let reads = |pointer: &str| {
        check(vec![
            task("first"),
            StepDefinition::parallel(
                "p",
                vec![(
                    "a",
                    vec![StepDefinition {
                        input: Some(pointer.into()),
                        ..task("a1")
                    }],
                )],
            ),
        ])
        .map_err(|e| e.0)
    };
    assert_eq!(reads("/steps/first"), Ok(()));
    assert_eq!(reads("/steps/a1"), Err(Rule::UnresolvablePointer));
}

#[test]
fn a_transition_that_dispatches_nothing_of_its_own_introduces_no_stamp() {
    let wf = reserve(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let w1 = stamp_at(&tr.state, 4);
    let tr = transition(fold(
        Some(&tr.state),
        &result_ok(w1, json!({})),
        &wf,
        STATE_CAP,
        t(5),
        &entropy(77),
    ));
    assert_eq!(tr.record.detail.get("next_stamp"), None);
    assert_eq!(tr.record.detail.get("first_stamp"), None);
    assert!(
        tr.state
            .attempts
            .iter()
            .all(|a| a.stamp != tests::stamp(77))
    );
}

/// `pack` wraps each item of `/input/items`, two at once; `ship` gets the
/// wrapped items. Indices: pack 0, ship 1, wrap 2.
fn packing(on_failure: OnFailure, max_items: Option<u32>) -> Workflows {
    let map = StepDefinition {
        input: Some("/input/items".into()),
        max_concurrency: Some(2),
        max_items,
        on_failure,
        ..StepDefinition::map("pack", vec![task("wrap")])
    };
    Workflows::new(vec![workflow(vec![map, task("ship")])]).unwrap()
}

/// The stamp of the attempt outstanding for item `item`.
fn item_stamp(s: &RunState, item: u32) -> Uuid {
    s.lanes
        .iter()
        .find(|l| l.item == Some(item))
        .and_then(|l| l.outstanding.as_ref())
        .map(|o| o.stamp)
        .unwrap_or_else(|| panic!("no attempt outstanding for item {item}"))
}

#[test]
fn a_map_runs_its_steps_for_each_item_a_few_at_once_and_keeps_their_order() {
    let wf = packing(OnFailure::FailFast, None);
    let tr = start(&wf, json!({"items": ["a", "b", "c"]}));
    let sent = dispatches(&tr);
    assert_eq!(sent.len(), 2, "max_concurrency 2");
    for (k, d) in sent.iter().enumerate() {
        assert_eq!(d["step"], "wrap");
        assert_eq!(d["item"], k);
        assert_eq!(d.get("branch"), None);
        assert_eq!(d["step_key"], format!("r1/step/2/item/{k}"));
        assert_eq!(
            d["attempt"],
            k + 1,
            "a step's attempts are numbered across its items"
        );
    }
    assert_eq!(
        (&sent[0]["input"], &sent[1]["input"]),
        (&json!("a"), &json!("b"))
    );
    // Item 1 ends: item 2 starts in the same transition.
    let b = item_stamp(&tr.state, 1);
    let tr = apply(&tr.state, &result_ok(b, json!("B")), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    let sent = dispatches(&tr);
    assert_eq!(
        (&sent[0]["item"], &sent[0]["input"], &sent[0]["attempt"]),
        (&json!(2), &json!("c"), &json!(3))
    );
    assert_eq!(tr.record.detail["next_stamp"], tests::stamp(2).to_string());
    let c = item_stamp(&tr.state, 2);
    let tr = apply(&tr.state, &result_ok(c, json!("C")), &wf, 20, 3);
    assert!(dispatches(&tr).is_empty());
    let a = item_stamp(&tr.state, 0);
    let tr = apply(&tr.state, &result_ok(a, json!("A")), &wf, 30, 4);
    let sent = dispatches(&tr);
    assert_eq!(sent[0]["step"], "ship");
    assert_eq!(
        sent[0]["input"],
        json!(["A", "B", "C"]),
        "results in item order"
    );
    assert_eq!(sent[0].get("item"), None);
    assert!(tr.state.lanes.is_empty());
}

#[test]
fn an_item_retries_on_its_own_count_and_its_failure_fails_the_map() {
    let wf = packing(OnFailure::FailFast, None);
    let tr = start(&wf, json!({"items": [1, 2]}));
    let first = item_stamp(&tr.state, 0);
    let other = item_stamp(&tr.state, 1);
    let tr = apply(&tr.state, &result_err(first, true), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepRetryScheduled);
    let tr = apply(&tr.state, &timer(TimerKind::Retry, first), &wf, 400, 3);
    let sent = dispatches(&tr);
    assert_eq!(
        (&sent[0]["item"], &sent[0]["attempt"]),
        (&json!(0), &json!(3))
    );
    assert_eq!(sent[0]["step_key"], "r1/step/2/item/0");
    // The item's second attempt is its last (max_attempts 2), whatever
    // the step's attempt numbers.
    let second = item_stamp(&tr.state, 0);
    let tr = apply(&tr.state, &result_err(second, true), &wf, 500, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    let d = &tr.record.detail;
    assert_eq!(
        (&d["cause"], &d["failed_item"], &d["branch_cause"]),
        (&json!(ITEM_FAILED), &json!(0), &json!("attempts_exhausted"))
    );
    assert_eq!(d["cancelled_stamps"], json!([other.to_string()]));
    let error = tr.state.error.unwrap();
    assert!(
        error.starts_with("item_failed: item 0 of step 0 (pack) failed: "),
        "{error}"
    );
}

#[test]
fn with_all_settled_every_item_runs_before_the_map_fails() {
    let wf = packing(OnFailure::AllSettled, None);
    let tr = start(&wf, json!({"items": [1, 2, 3]}));
    let first = item_stamp(&tr.state, 0);
    let tr = apply(&tr.state, &result_err(first, false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::BranchFailed);
    assert_eq!(dispatches(&tr)[0]["item"], 2, "the next item starts");
    let tr = apply(
        &tr.state,
        &result_ok(item_stamp(&tr.state, 1), json!(2)),
        &wf,
        20,
        3,
    );
    let tr = apply(
        &tr.state,
        &result_ok(item_stamp(&tr.state, 2), json!(3)),
        &wf,
        30,
        4,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["failed_item"], 0);
}

#[test]
fn a_map_of_nothing_ends_at_once_and_one_of_no_array_or_too_many_items_fails() {
    let wf = packing(OnFailure::FailFast, Some(2));
    let tr = start(&wf, json!({"items": []}));
    let sent = dispatches(&tr);
    assert_eq!(
        (&sent[0]["step"], &sent[0]["input"]),
        (&json!("ship"), &json!([]))
    );
    assert_eq!(
        tr.record.detail["passed_steps"],
        json!([{"step_index": 0, "output": []}])
    );
    for (input, cause) in [
        (json!({"items": {"a": 1}}), NOT_AN_ARRAY),
        (json!({"items": [1, 2, 3]}), TOO_MANY_ITEMS),
    ] {
        let tr = start(&wf, input);
        assert_eq!(tr.state.status, RunStatus::Failed);
        assert_eq!(tr.record.detail["cause"], cause);
        assert!(tr.state.error.as_deref().unwrap().starts_with(cause));
        assert!(dispatches(&tr).is_empty() && tr.state.lanes.is_empty());
    }
}

#[test]
fn a_parallel_step_in_a_map_keys_each_item_and_branch_apart() {
    // Indices: each 0, both 1, x 2, y 3.
    let both =
        StepDefinition::parallel("both", vec![("x", vec![task("x")]), ("y", vec![task("y")])]);
    let wf = Workflows::new(vec![workflow(vec![StepDefinition::map(
        "each",
        vec![both],
    )])])
    .unwrap();
    let tr = start(&wf, json!([10, 20]));
    let keys: Vec<(Value, Value, Value)> = dispatches(&tr)
        .iter()
        .map(|d| {
            (
                d["step_key"].clone(),
                d["branch"].clone(),
                d["item"].clone(),
            )
        })
        .collect();
    assert_eq!(
        keys,
        [
            (json!("r1/step/2/item/0"), json!("x"), json!(0)),
            (json!("r1/step/3/item/0"), json!("y"), json!(0)),
            (json!("r1/step/2/item/1"), json!("x"), json!(1)),
            (json!("r1/step/3/item/1"), json!("y"), json!(1)),
        ]
    );
    let tr = answer_lanes(tr, &wf, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    let out = &tr.state.output;
    assert_eq!(out.as_array().map(Vec::len), Some(2), "{out}");
    assert!(out[0]["x"].is_number() && out[1]["y"].is_number(), "{out}");
}

#[test]
fn a_map_runs_in_a_branch_and_in_a_map() {
    // Indices: both 0, wrap 1 (branch a), nap 2 (branch b), pack 3 (in wrap).
    let wrap = StepDefinition::map("wrap", vec![task("pack")]);
    let both = StepDefinition::parallel(
        "both",
        vec![
            ("a", vec![wrap]),
            ("b", vec![StepDefinition::sleep("nap", 10)]),
        ],
    );
    let wf = Workflows::new(vec![workflow(vec![both])]).unwrap();
    let tr = start(&wf, json!(["cup", "pot"]));
    let keys: Vec<(Value, Value)> = dispatches(&tr)
        .iter()
        .map(|d| (d["step_key"].clone(), d["input"].clone()))
        .collect();
    assert_eq!(
        keys,
        [
            (json!("r1/step/3/item/0"), json!("cup")),
            (json!("r1/step/3/item/1"), json!("pot")),
        ]
    );
    let tr = answer_lanes(tr, &wf, 2);
    let wake = tr
        .state
        .lanes
        .iter()
        .find_map(|l| l.waiting.as_ref())
        .expect("branch b sleeps")
        .stamp;
    let tr = apply(&tr.state, &timer(TimerKind::Wake, wake), &wf, 50, 50);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(tr.state.output["a"], json!([0, 1]));
    assert!(tr.state.lanes.is_empty());

    // A map over each item's own array: items of items, keyed by both.
    let inner = StepDefinition::map("inner", vec![task("leaf")]);
    let wf = Workflows::new(vec![workflow(vec![StepDefinition::map(
        "outer",
        vec![inner],
    )])])
    .unwrap();
    let tr = start(&wf, json!([[1, 2], [3]]));
    let keys: Vec<Value> = dispatches(&tr)
        .iter()
        .map(|d| d["step_key"].clone())
        .collect();
    assert_eq!(
        keys,
        [
            json!("r1/step/2/item/0/0"),
            json!("r1/step/2/item/0/1"),
            json!("r1/step/2/item/1/0"),
        ]
    );
    let tr = answer_lanes(tr, &wf, 3);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    let out = &tr.state.output;
    assert_eq!(out[0].as_array().map(Vec::len), Some(2), "{out}");
    assert_eq!(out[1].as_array().map(Vec::len), Some(1), "{out}");
}

#[test]
fn a_choice_in_a_branch_skips_ahead_in_its_branch() {
    // Indices: both 0, c 1, slow 2, ship 3 (branch a), b1 4 (branch b).
    let fast = condition::Condition {
        pointer: Some("/input/fast".into()),
        equals: Some(json!(true)),
        ..condition::Condition::default()
    };
    let both = StepDefinition::parallel(
        "both",
        vec![
            (
                "a",
                vec![
                    StepDefinition::choice("c", vec![("ship", fast)], "slow"),
                    task("slow"),
                    task("ship"),
                ],
            ),
            ("b", vec![task("b1")]),
        ],
    );
    let wf = Workflows::new(vec![workflow(vec![both])]).unwrap();
    let steps = |tr: &Transition| -> Vec<Value> {
        dispatches(tr).iter().map(|d| d["step"].clone()).collect()
    };
    let quick = start(&wf, json!({"fast": true}));
    assert_eq!(steps(&quick), [json!("ship"), json!("b1")]);
    let slow = start(&wf, json!({"fast": false}));
    assert_eq!(steps(&slow), [json!("slow"), json!("b1")]);
    let next = apply(
        &slow.state,
        &result_ok(stamp_at(&slow.state, 2), json!(1)),
        &wf,
        10,
        2,
    );
    assert_eq!(steps(&next), [json!("ship")], "then on in order");
    let b1 = stamp_at(&quick.state, 4);
    let ship = stamp_at(&quick.state, 3);
    let tr = apply(&quick.state, &result_ok(ship, json!("shipped")), &wf, 10, 3);
    let tr = apply(&tr.state, &result_ok(b1, json!("b")), &wf, 20, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(tr.state.output, json!({"a": "shipped", "b": "b"}));
}

/// Answers `n` attempts outstanding in the run's lanes, the first
/// outstanding each time, with the outputs 0, 1, ...
fn answer_lanes(mut tr: Transition, wf: &Workflows, n: u32) -> Transition {
    for (e, output) in (10..).zip(0..n) {
        let stamp = tr
            .state
            .lanes
            .iter()
            .find_map(|l| l.outstanding.as_ref())
            .expect("an attempt outstanding in a lane")
            .stamp;
        tr = apply(
            &tr.state,
            &result_ok(stamp, json!(output)),
            wf,
            e,
            u128::from(e as u32),
        );
    }
    tr
}

fn go(id: &str) -> Input {
    Input::Signal(SignalWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        signal_id: id.into(),
        name: "go".into(),
        payload: json!({"id": id}),
    })
}

fn await_go(name: &str, on_timeout: OnTimeout) -> StepDefinition {
    StepDefinition::await_signal(name, "go", 5_000, on_timeout)
}

#[test]
fn a_branch_waits_for_its_signal_and_one_that_came_early_is_kept_for_it() {
    // Indices: both 0, a1 1, wait 2 (branch a), b1 3 (branch b).
    let both = StepDefinition::parallel(
        "both",
        vec![
            ("a", vec![task("a1"), await_go("wait", OnTimeout::Fail)]),
            ("b", vec![task("b1")]),
        ],
    );
    let wf = Workflows::new(vec![workflow(vec![both])]).unwrap();
    let tr = start(&wf, json!({}));
    let (a1, b1) = (stamp_at(&tr.state, 1), stamp_at(&tr.state, 3));
    // Branch a waits once a1 succeeded; the signal then ends the wait.
    let waited = apply(&tr.state, &result_ok(a1, json!({"a": 1})), &wf, 10, 2);
    assert!(waited.state.lanes[0].waiting.is_some());
    let signalled = apply(&waited.state, &go("s1"), &wf, 20, 3);
    assert_eq!(signalled.record.kind, TransitionKind::StepSucceeded);
    assert!(signalled.state.lanes[0].waiting.is_none());
    assert_eq!(signalled.state.signals[0].consumed_by, Some(2));
    let done = apply(
        &signalled.state,
        &result_ok(b1, json!({"b": 1})),
        &wf,
        30,
        4,
    );
    assert_eq!(done.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(done.state.output["a"]["wait"]["signal_id"], "s1");
    assert_eq!(
        done.state.output["a"]["wait"]["payload"],
        json!({"id": "s1"})
    );
    // The same signal before branch a waits: kept, then taken at once.
    let early = apply(&tr.state, &go("s1"), &wf, 5, 5);
    assert_eq!(early.record.kind, TransitionKind::RunSignalled);
    assert!(early.state.signals[0].kept);
    let taken = apply(&early.state, &result_ok(a1, json!({"a": 1})), &wf, 10, 6);
    assert!(
        taken.state.lanes[0].waiting.is_none(),
        "the kept signal ends it at once"
    );
    assert_eq!(taken.state.signals[0].consumed_by, Some(2));
    let done = apply(&taken.state, &result_ok(b1, json!({"b": 1})), &wf, 30, 7);
    assert_eq!(done.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(done.state.output["a"]["wait"]["signal_id"], "s1");
}

#[test]
fn each_item_of_a_map_takes_a_signal_of_its_own_kept_or_not_and_a_wait_that_times_out_fails_it() {
    let wf = Workflows::new(vec![workflow(vec![StepDefinition::map(
        "each",
        vec![await_go("wait", OnTimeout::Fail)],
    )])])
    .unwrap();
    let tr = start(&wf, json!(["x", "y"]));
    assert_eq!(
        tr.state
            .lanes
            .iter()
            .filter(|l| l.waiting.is_some())
            .count(),
        2
    );
    let one = apply(&tr.state, &go("s1"), &wf, 10, 2);
    assert_eq!(one.record.kind, TransitionKind::StepSucceeded);
    let again = fold(
        Some(&one.state),
        &go("s1"),
        &wf,
        STATE_CAP,
        t(15),
        &entropy(3),
    );
    assert_eq!(again, Decision::NoOp(NoOpReason::DuplicateSignal));
    let two = apply(&one.state, &go("s2"), &wf, 20, 4);
    assert_eq!(two.record.kind, TransitionKind::RunSucceeded);
    let ids: Vec<&Value> = two
        .state
        .output
        .as_array()
        .unwrap()
        .iter()
        .map(|o| &o["wait"]["signal_id"])
        .collect();
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1], "each item consumed a signal of its own");

    // Nobody signals: the first wait to time out fails its item, and the map.
    let wake = tr.state.lanes[0].waiting.as_ref().unwrap().stamp;
    let late = apply(&tr.state, &timer(TimerKind::Wake, wake), &wf, 6_000, 5);
    assert_eq!(late.state.status, RunStatus::Failed);

    // Signals that come while the items still run their task are kept,
    // one for each item that will wait.
    let wf = Workflows::new(vec![workflow(vec![StepDefinition::map(
        "each",
        vec![task("prep"), await_go("wait", OnTimeout::Fail)],
    )])])
    .unwrap();
    let busy = start(&wf, json!(["x", "y"]));
    let one = apply(&busy.state, &go("s1"), &wf, 5, 2);
    let two = apply(&one.state, &go("s2"), &wf, 6, 3);
    assert_eq!(two.state.signals.iter().filter(|r| r.kept).count(), 2);
    let tr = answer_lanes(two, &wf, 2);
    assert_eq!(
        tr.record.kind,
        TransitionKind::RunSucceeded,
        "each item took a kept signal"
    );
}

#[test]
fn map_definitions_are_checked() {
    let check =
        |steps: Vec<StepDefinition>| workflow(steps).validate().map_err(|e| (e.rule, e.field));
    assert_eq!(
        check(vec![StepDefinition::map("m", vec![])]),
        Err((Rule::Invalid, "steps[0].steps".into()))
    );
    assert_eq!(
        check(vec![StepDefinition {
            max_concurrency: Some(0),
            ..StepDefinition::map("m", vec![task("t")])
        }]),
        Err((Rule::Invalid, "steps[0].max_concurrency".into()))
    );
    assert_eq!(
        check(vec![StepDefinition {
            max_items: Some(1001),
            ..StepDefinition::map("m", vec![task("t")])
        }]),
        Err((Rule::Invalid, "steps[0].max_items".into()))
    );
    assert_eq!(
        check(vec![StepDefinition {
            steps: vec![task("t")],
            ..task("x")
        }]),
        Err((Rule::FieldOfOtherKind, "steps[0].steps".into()))
    );
    assert_eq!(
        check(vec![StepDefinition::map(
            "m",
            vec![StepDefinition {
                end: true,
                ..task("t")
            }]
        )]),
        Err((Rule::NotInBranch, "steps[0].steps[0].end".into()))
    );
}
