//! Unit tests of compensation: the steps that succeeded are undone newest
//! first once a catch compensates, each compensation a task with its own
//! attempts, stamps, retries and step key; a compensation that fails
//! leaves the run for a retry; and the definition checks of compensations.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use serde_json::{Value, json};

use super::definition::{Catch, OnFailure, Rule};
use super::fold::*;
use super::tests::{
    apply, dispatch_of, result_ok, stamp_of, start_with as start, task_once as task,
    workflow_of as workflow,
};
use super::*;
use crate::contract::*;

/// `step`, undone by the task `undo` (on pool `undo`, two attempts).
fn undone_by(step: StepDefinition, undo: &str) -> StepDefinition {
    let compensation = StepDefinition {
        retry: RetryPolicy {
            max_attempts: 2,
            initial_backoff_ms: 100,
            ..RetryPolicy::default()
        },
        ..StepDefinition::task(undo, "undo", 1000)
    };
    StepDefinition {
        compensate: Some(Box::new(compensation)),
        ..step
    }
}

fn compensates(step: StepDefinition) -> StepDefinition {
    StepDefinition {
        catch: Some(Catch {
            next: None,
            result: None,
            compensate: true,
        }),
        ..step
    }
}

fn failed(stamp: uuid::Uuid, retryable: bool) -> Input {
    tests::failed_with(stamp, "no courier", retryable)
}

fn lane_stamp(s: &RunState, lane: usize) -> uuid::Uuid {
    s.lanes[lane].outstanding.as_ref().unwrap().stamp
}

/// An order: `charge` (undone by `refund`), a `reserve` in two
/// warehouses at once (each undone by its release), `ship`; a failure of
/// the reservation or the shipping compensates. Indices: charge 0,
/// reserve 1, ship 2, a 3, b 4, then the compensations refund 5,
/// release_a 6, release_b 7.
fn order(on_failure: OnFailure) -> Workflows {
    let reserve = StepDefinition {
        on_failure,
        ..StepDefinition::parallel(
            "reserve",
            vec![
                ("east", vec![undone_by(task("a"), "release_a")]),
                ("west", vec![undone_by(task("b"), "release_b")]),
            ],
        )
    };
    Workflows::new(vec![workflow(vec![
        undone_by(task("charge"), "refund"),
        compensates(reserve),
        compensates(task("ship")),
    ])])
    .unwrap()
}

/// The step, step key and input of a transition's dispatch.
fn sent(tr: &Transition) -> (Value, Value, Value) {
    let d = dispatch_of(tr).expect("a dispatch");
    (d["step"].clone(), d["step_key"].clone(), d["input"].clone())
}

#[test]
fn a_compensating_failure_undoes_the_steps_that_succeeded_newest_first_then_fails() {
    let wf = order(OnFailure::FailFast);
    let def = wf.get("wf", 1).unwrap();
    assert_eq!(
        (1..8).map(|i| def.compensation_of(i)).collect::<Vec<_>>(),
        [None, None, Some(6), Some(7), None, None, None],
        "the compensations are numbered after every other step"
    );
    assert_eq!(def.compensation_of(0), Some(5));
    let tr = start(&wf, json!({"order": 1}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({"charge": "ch_1"})),
        &wf,
        10,
        2,
    );
    assert_eq!(tr.state.compensable.len(), 1);
    assert_eq!(tr.state.compensable[0].step_key, "r1/step/0");
    // West answers before east: it is the newer, and undone first.
    let west = lane_stamp(&tr.state, 1);
    let east = lane_stamp(&tr.state, 0);
    let tr = apply(
        &tr.state,
        &result_ok(west, json!({"held": "w"})),
        &wf,
        20,
        3,
    );
    let tr = apply(
        &tr.state,
        &result_ok(east, json!({"held": "e"})),
        &wf,
        30,
        4,
    );
    assert_eq!(sent(&tr).0, "ship");
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), false), &wf, 40, 5);
    assert_eq!(tr.record.kind, TransitionKind::RunCompensating);
    assert_eq!(tr.state.status, RunStatus::Running);
    assert_eq!(
        tr.record.detail["compensating"],
        json!({"step": "ship", "cause": "not_retryable", "steps": 3})
    );
    assert_eq!(tr.record.detail.get("cause"), None, "not failed yet");
    assert_eq!(
        sent(&tr),
        (
            json!("release_a"),
            json!("r1/step/3/compensate"),
            json!({"held": "e"})
        )
    );
    assert_eq!(dispatch_of(&tr).unwrap()["attempt"], 1);
    assert_eq!(tr.state.step_index, 6);
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        50,
        6,
    );
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(tr.record.detail["compensated_key"], "r1/step/3");
    assert_eq!(
        sent(&tr),
        (
            json!("release_b"),
            json!("r1/step/4/compensate"),
            json!({"held": "w"})
        )
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        60,
        7,
    );
    assert_eq!(
        sent(&tr),
        (
            json!("refund"),
            json!("r1/step/0/compensate"),
            json!({"charge": "ch_1"})
        )
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        70,
        8,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
    assert_eq!(tr.record.detail["compensated_cause"], "not_retryable");
    assert_eq!(tr.record.detail["compensated_step"], 2);
    assert_eq!(tr.state.step_index, 2, "the run failed in ship");
    assert!(
        tr.state.error.as_deref().unwrap().contains("no courier"),
        "{:?}",
        tr.state.error
    );
    assert!(tr.state.compensable.is_empty() && tr.state.is_compensated());
    assert!(dispatch_of(&tr).is_none());
    // What it did is undone: a retry changes nothing.
    let retry = Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: "again".into(),
        failed_seq: tr.state.failed_seq.unwrap(),
        reason: None,
    });
    assert_eq!(
        fold(
            Some(&tr.state),
            &retry,
            &wf,
            1 << 20,
            tests::t(80),
            &tests::entropy(9)
        ),
        Decision::NoOp(NoOpReason::RunCompensated)
    );
}

#[test]
fn a_failed_branch_compensates_the_branches_that_succeeded_but_not_the_cancelled() {
    let wf = order(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({"charge": "ch_2"})),
        &wf,
        10,
        2,
    );
    let east = lane_stamp(&tr.state, 0);
    let west = lane_stamp(&tr.state, 1);
    let tr = apply(
        &tr.state,
        &result_ok(east, json!({"held": "e"})),
        &wf,
        20,
        3,
    );
    let tr = apply(&tr.state, &failed(west, false), &wf, 30, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunCompensating);
    assert_eq!(tr.record.detail["compensating"]["cause"], BRANCH_FAILED);
    assert_eq!(sent(&tr).0, "release_a");
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        40,
        5,
    );
    assert_eq!(sent(&tr).0, "refund");
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        50,
        6,
    );
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
    assert_eq!(tr.record.detail["compensated_step"], 1);
    let released: Vec<&str> = tr
        .state
        .attempts
        .iter()
        .filter(|a| a.step_index >= 5)
        .map(|a| ["refund", "release_a", "release_b"][a.step_index as usize - 5])
        .collect();
    assert_eq!(released, ["release_a", "refund"]);
}

#[test]
fn a_compensation_retries_by_its_policy_and_one_that_fails_is_retried_with_the_run() {
    let wf = order(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({"charge": "ch_3"})),
        &wf,
        10,
        2,
    );
    let east = lane_stamp(&tr.state, 0);
    let tr = apply(&tr.state, &failed(east, false), &wf, 20, 3);
    assert_eq!(sent(&tr).0, "refund");
    let first = stamp_of(&tr.state);
    // Its first attempt times out: the second follows its backoff.
    let timeout = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Timeout,
        stamp: first,
    });
    let tr = apply(&tr.state, &timeout, &wf, 2000, 4);
    assert_eq!(tr.record.kind, TransitionKind::StepTimedOut);
    let retry_timer = Input::Timer(TimerWakeup {
        timer: TimerKind::Retry,
        ..match timeout {
            Input::Timer(t) => t,
            _ => unreachable!(),
        }
    });
    let tr = apply(&tr.state, &retry_timer, &wf, 2100, 5);
    assert_eq!(tr.record.kind, TransitionKind::StepRetried);
    assert_eq!(
        (sent(&tr).1, sent(&tr).2),
        (json!("r1/step/0/compensate"), json!({"charge": "ch_3"})),
        "the same key and input on every attempt"
    );
    assert_eq!(dispatch_of(&tr).unwrap()["attempt"], 2);
    // The second fails too: the run fails, the compensation left to do.
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), true), &wf, 2200, 6);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], COMPENSATION_FAILED);
    assert_eq!(tr.record.detail["compensation_cause"], "attempts_exhausted");
    assert_eq!(tr.state.compensable.len(), 1);
    assert!(!tr.state.is_compensated());
    // A retry of the run goes on from it, with its whole policy again.
    let retry = Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: "fixed".into(),
        failed_seq: tr.state.failed_seq.unwrap(),
        reason: None,
    });
    let tr = apply(&tr.state, &retry, &wf, 3000, 7);
    assert_eq!(tr.record.kind, TransitionKind::RunRetried);
    assert_eq!(sent(&tr).1, json!("r1/step/0/compensate"));
    assert_eq!(dispatch_of(&tr).unwrap()["attempt"], 3);
    assert_eq!(tr.state.compensating.as_ref().unwrap().tries, 1);
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), true), &wf, 3100, 8);
    assert_eq!(
        tr.record.kind,
        TransitionKind::StepRetryScheduled,
        "a second attempt after the retry"
    );
    let due = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Retry,
        stamp: tr.state.pending_retry.as_ref().unwrap().after_stamp,
    });
    let tr = apply(&tr.state, &due, &wf, 3300, 9);
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        3400,
        10,
    );
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
    assert_eq!(tr.record.detail["compensated_cause"], BRANCH_FAILED);
    assert!(tr.state.is_compensated());
}

#[test]
fn nothing_to_undo_fails_compensated_at_once_and_items_are_undone_each_by_its_key() {
    let wf = order(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(
        tr.record.detail["cause"], "not_retryable",
        "charge does not compensate"
    );

    let wf = Workflows::new(vec![workflow(vec![
        compensates(task("first")),
        compensates(StepDefinition::map(
            "each",
            vec![undone_by(task("pick"), "put_back")],
        )),
    ])])
    .unwrap();
    let tr = start(&wf, json!({}));
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
    assert_eq!(tr.record.detail["compensating"]["steps"], 0);
    assert!(dispatch_of(&tr).is_none());

    let tr = start(&wf, json!([1, 2, 3]));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!([1, 2, 3])),
        &wf,
        10,
        2,
    );
    let stamps: Vec<_> = (0..3).map(|i| lane_stamp(&tr.state, i)).collect();
    let tr = apply(&tr.state, &result_ok(stamps[2], json!("p2")), &wf, 20, 3);
    let tr = apply(&tr.state, &result_ok(stamps[0], json!("p0")), &wf, 30, 4);
    let tr = apply(&tr.state, &failed(stamps[1], false), &wf, 40, 5);
    assert_eq!(tr.record.kind, TransitionKind::RunCompensating);
    assert_eq!(tr.record.detail["compensating"]["cause"], ITEM_FAILED);
    assert_eq!(
        sent(&tr),
        (
            json!("put_back"),
            json!("r1/step/2/item/0/compensate"),
            json!("p0")
        )
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        50,
        6,
    );
    assert_eq!(
        sent(&tr),
        (
            json!("put_back"),
            json!("r1/step/2/item/2/compensate"),
            json!("p2")
        )
    );
    assert_eq!(
        dispatch_of(&tr).unwrap()["attempt"],
        2,
        "the attempts of a compensation are numbered across the steps it undoes"
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        60,
        7,
    );
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
}

#[test]
fn a_cancel_stops_the_compensation_and_late_results_change_nothing() {
    let wf = order(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let charge = stamp_of(&tr.state);
    let tr = apply(&tr.state, &result_ok(charge, json!({})), &wf, 10, 2);
    let east = lane_stamp(&tr.state, 0);
    let tr = apply(&tr.state, &failed(east, false), &wf, 20, 3);
    let refund = stamp_of(&tr.state);
    // The charge's result again changes nothing.
    let again = fold(
        Some(&tr.state),
        &result_ok(charge, json!({})),
        &wf,
        1 << 20,
        tests::t(25),
        &tests::entropy(9),
    );
    assert_eq!(again, Decision::NoOp(NoOpReason::DuplicateResult));
    let cancel = Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: Some("user".into()),
        action_id: None,
    });
    let tr = apply(&tr.state, &cancel, &wf, 30, 4);
    assert_eq!(tr.record.kind, TransitionKind::RunCancelled);
    assert_eq!(tr.state.status, RunStatus::Cancelled);
    assert!(
        tr.state.compensable.is_empty(),
        "a cancelled run forgets what it would undo"
    );
    let late = fold(
        Some(&tr.state),
        &result_ok(refund, json!({})),
        &wf,
        1 << 20,
        tests::t(40),
        &tests::entropy(10),
    );
    assert!(matches!(late, Decision::NoOp(_)), "{late:?}");
}

#[test]
fn compensations_are_checked() {
    let check =
        |steps: Vec<StepDefinition>| workflow(steps).validate().map_err(|e| (e.rule, e.field));
    let sleep = undone_by(StepDefinition::sleep("nap", 10), "wake");
    assert_eq!(
        check(vec![sleep]),
        Err((Rule::FieldOfOtherKind, "steps[0].compensate".into()))
    );
    let mut with_next = undone_by(task("a"), "undo_a");
    with_next.compensate.as_mut().unwrap().next = Some("a".into());
    assert_eq!(
        check(vec![with_next]),
        Err((Rule::NotInCompensation, "steps[0].compensate.next".into()))
    );
    let mut nested = undone_by(task("a"), "undo_a");
    let inner = undone_by(task("undo_a"), "undo_undo");
    nested.compensate = Some(Box::new(inner));
    assert_eq!(
        check(vec![nested]),
        Err((
            Rule::NotInCompensation,
            "steps[0].compensate.compensate".into()
        ))
    );
    let in_branch = StepDefinition::parallel("p", vec![("x", vec![undone_by(task("x1"), "a")])]);
    assert_eq!(
        check(vec![task("a"), in_branch]),
        Err((
            Rule::DuplicateStep,
            "steps[1].branches[0].steps[0].compensate.name".into()
        )),
        "a compensation's name is unique in the workflow"
    );
    let both = StepDefinition {
        catch: Some(Catch {
            next: Some("b".into()),
            result: None,
            compensate: true,
        }),
        ..task("a")
    };
    assert_eq!(
        check(vec![both, task("b")]),
        Err((Rule::Invalid, "steps[0].catch.next".into()))
    );
    let neither = StepDefinition {
        catch: Some(Catch {
            next: None,
            result: None,
            compensate: false,
        }),
        ..task("a")
    };
    assert_eq!(
        check(vec![neither]),
        Err((Rule::Invalid, "steps[0].catch.next".into()))
    );
    let with_result = StepDefinition {
        catch: Some(Catch {
            next: None,
            result: Some("/errors/x".into()),
            compensate: true,
        }),
        ..task("a")
    };
    assert_eq!(
        check(vec![with_result]),
        Err((Rule::Invalid, "steps[0].catch.result".into()))
    );
    let mut poolless = undone_by(task("a"), "undo_a");
    poolless.compensate.as_mut().unwrap().pool = String::new();
    assert_eq!(
        check(vec![poolless]).unwrap_err().1,
        "steps[0].compensate.pool"
    );
    // A workflow with compensations in and out of branches is fine.
    assert_eq!(
        order(OnFailure::AllSettled)
            .get("wf", 1)
            .unwrap()
            .validate()
            .map_err(|e| e.rule),
        Ok(())
    );
}

#[test]
fn a_run_that_succeeds_forgets_what_it_would_undo() {
    let wf = order(OnFailure::FailFast);
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        10,
        2,
    );
    let (east, west) = (lane_stamp(&tr.state, 0), lane_stamp(&tr.state, 1));
    let tr = apply(&tr.state, &result_ok(east, json!({})), &wf, 20, 3);
    let tr = apply(&tr.state, &result_ok(west, json!({})), &wf, 30, 4);
    assert_eq!(tr.state.compensable.len(), 3, "charge and both holds");
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        40,
        5,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert!(tr.state.compensable.is_empty() && tr.state.compensating.is_none());
}

#[test]
fn a_start_that_compensates_at_once_stays_a_run_started_and_names_its_failure() {
    let wf = Workflows::new(vec![workflow(vec![
        compensates(StepDefinition::map(
            "each",
            vec![undone_by(task("pick"), "put_back")],
        )),
        task("last"),
    ])])
    .unwrap();
    let tr = start(&wf, json!({"not": "an array"}));
    assert_eq!(tr.record.kind, TransitionKind::RunStarted);
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.record.detail["cause"], COMPENSATED);
    assert_eq!(
        tr.state.failure_seq(),
        Some(1),
        "a retry names the start that failed the run"
    );
}

/// `each` maps `pick` (undone by `put_back`) over the input; `tail` goes
/// back to it once when it fails, so the workflow loops.
fn looping_map() -> Workflows {
    let tail = StepDefinition {
        max_visits: Some(2),
        catch: Some(Catch {
            next: Some("each".into()),
            result: None,
            compensate: false,
        }),
        ..task("tail")
    };
    Workflows::new(vec![workflow(vec![
        compensates(StepDefinition::map(
            "each",
            vec![undone_by(task("pick"), "put_back")],
        )),
        tail,
    ])])
    .unwrap()
}

#[test]
fn an_item_keeps_its_step_key_through_its_retries_and_is_undone_under_it() {
    let wf = looping_map();
    let tr = start(&wf, json!([1, 2]));
    let keys: Vec<Value> = tr
        .effects
        .iter()
        .filter(|e| matches!(e.target, EffectTarget::StepQueue { .. }))
        .map(|e| e.payload["step_key"].clone())
        .collect();
    assert_eq!(keys, [json!("r1/step/2/item/0"), json!("r1/step/2/item/1")]);
    let (s0, s1) = (lane_stamp(&tr.state, 0), lane_stamp(&tr.state, 1));
    let tr = apply(&tr.state, &result_ok(s0, json!("p0")), &wf, 10, 2);
    let tr = apply(&tr.state, &failed(s1, false), &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::RunCompensating);
    assert_eq!(sent(&tr).1, json!("r1/step/2/item/0/compensate"));
}

#[test]
fn a_step_run_again_under_its_key_by_a_retry_of_the_run_is_undone_once() {
    let reserve = StepDefinition::parallel(
        "reserve",
        vec![
            ("east", vec![undone_by(task("a"), "release_a")]),
            ("west", vec![task("b")]),
        ],
    );
    let wf = Workflows::new(vec![workflow(vec![
        undone_by(task("charge"), "refund"),
        reserve,
        compensates(task("ship")),
    ])])
    .unwrap();
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({})),
        &wf,
        10,
        2,
    );
    let (east, west) = (lane_stamp(&tr.state, 0), lane_stamp(&tr.state, 1));
    let tr = apply(&tr.state, &result_ok(east, json!({"held": 1})), &wf, 20, 3);
    let tr = apply(&tr.state, &failed(west, false), &wf, 30, 4);
    let retry = Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: "again".into(),
        failed_seq: tr.state.failed_seq.unwrap(),
        reason: None,
    });
    let tr = apply(&tr.state, &retry, &wf, 40, 5);
    let (east, west) = (lane_stamp(&tr.state, 0), lane_stamp(&tr.state, 1));
    let tr = apply(&tr.state, &result_ok(east, json!({"held": 2})), &wf, 50, 6);
    let tr = apply(&tr.state, &result_ok(west, json!({})), &wf, 60, 7);
    let kept: Vec<(&str, &Value)> = tr
        .state
        .compensable
        .iter()
        .map(|c| (c.step_key.as_str(), &c.output))
        .collect();
    assert_eq!(
        kept,
        [
            ("r1/step/0", &json!({})),
            ("r1/step/3", &json!({"held": 2}))
        ]
    );
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), false), &wf, 70, 8);
    assert_eq!(
        sent(&tr),
        (
            json!("release_a"),
            json!("r1/step/3/compensate"),
            json!({"held": 2})
        )
    );
}
