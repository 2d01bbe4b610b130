//! Unit tests of catches: a step that fails for good goes on at its
//! catch's step with the error in the run's document; what is not caught;
//! and the definition checks of catches.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use serde_json::json;

use super::definition::{Catch, OnFailure, Rule};
use super::fold::*;
use super::tests::{
    apply, dispatch_of, entropy, result_ok, stamp_of, start_with as start, t, task_once as task,
    workflow_of as workflow,
};
use super::*;
use crate::contract::*;

fn caught_to(step: StepDefinition, next: &str) -> StepDefinition {
    StepDefinition {
        catch: Some(Catch {
            next: Some(next.into()),
            result: None,
            compensate: false,
        }),
        ..step
    }
}

fn failed(stamp: uuid::Uuid, retryable: bool) -> Input {
    tests::failed_with(stamp, "card declined", retryable)
}

/// `charge` catches to `apologize`, which reads the error; `ship` follows
/// a charge that went through. Indices: charge 0, ship 1, apologize 2.
fn shop() -> Workflows {
    Workflows::new(vec![workflow(vec![
        caught_to(task("charge"), "apologize"),
        StepDefinition {
            end: true,
            ..task("ship")
        },
        StepDefinition {
            input: Some("/errors/charge".into()),
            ..task("apologize")
        },
    ])])
    .unwrap()
}

#[test]
fn a_step_that_fails_for_good_goes_on_at_its_catch_with_the_error() {
    let wf = shop();
    let tr = start(&wf, json!({"order": 1}));
    let tr = apply(&tr.state, &failed(stamp_of(&tr.state), false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepCaught);
    assert_eq!(tr.state.status, RunStatus::Running);
    assert_eq!(tr.state.failed_seq, None);
    let error = json!({
        "step": "charge", "cause": "not_retryable",
        "error": "step 0 attempt 1 failed: card declined",
    });
    assert_eq!(tr.record.detail["caught"], error);
    assert_eq!(tr.record.detail.get("cause"), None, "the run did not fail");
    assert_eq!(tr.record.detail["next_stamp"], tests::stamp(2).to_string());
    let sent = dispatch_of(&tr).unwrap();
    assert_eq!(
        (&sent["step"], &sent["input"]),
        (&json!("apologize"), &error)
    );
    assert_eq!(
        tr.state.results.as_ref().unwrap()["errors"]["charge"],
        error
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp_of(&tr.state), json!({"sorry": true})),
        &wf,
        20,
        3,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
}

#[test]
fn a_timeout_that_exhausts_the_attempts_and_a_failed_branch_are_caught_too() {
    let wf = shop();
    let tr = start(&wf, json!({}));
    let timeout = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Timeout,
        stamp: stamp_of(&tr.state),
    });
    let tr = apply(&tr.state, &timeout, &wf, 2000, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepCaught);
    assert_eq!(tr.record.detail["caught"]["cause"], "attempts_exhausted");

    let fan = caught_to(
        StepDefinition {
            on_failure: OnFailure::FailFast,
            ..StepDefinition::parallel(
                "fan",
                vec![("a", vec![task("a1")]), ("b", vec![task("b1")])],
            )
        },
        "mend",
    );
    let wf = Workflows::new(vec![workflow(vec![fan, task("mend")])]).unwrap();
    let tr = start(&wf, json!({}));
    let b1 = tr.state.lanes[1].outstanding.as_ref().unwrap().stamp;
    let tr = apply(&tr.state, &failed(b1, false), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepCaught);
    assert_eq!(tr.record.detail["caught"]["cause"], BRANCH_FAILED);
    assert_eq!(
        tr.record.detail["cancelled_stamps"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(dispatch_of(&tr).unwrap()["step"], "mend");
    assert!(tr.state.lanes.is_empty());
}

#[test]
fn a_failure_at_the_start_is_caught_in_the_start() {
    let map = caught_to(
        StepDefinition {
            input: Some("/input/items".into()),
            ..StepDefinition::map("each", vec![task("one")])
        },
        "none",
    );
    let wf = Workflows::new(vec![workflow(vec![map, task("none")])]).unwrap();
    let tr = start(&wf, json!({"items": "not a list"}));
    assert_eq!(tr.record.kind, TransitionKind::RunStarted);
    assert_eq!(tr.state.status, RunStatus::Running);
    assert_eq!(tr.record.detail["caught"]["cause"], NOT_AN_ARRAY);
    assert_eq!(dispatch_of(&tr).unwrap()["step"], "none");
}

#[test]
fn what_a_catch_does_not_catch() {
    let wf = shop();
    // A retryable failure with attempts left is retried, not caught.
    let wf_retrying = Workflows::new(vec![workflow(vec![
        caught_to(
            StepDefinition {
                retry: RetryPolicy::default(),
                ..task("charge")
            },
            "sorry",
        ),
        task("sorry"),
    ])])
    .unwrap();
    let tr = start(&wf_retrying, json!({}));
    let tr = apply(
        &tr.state,
        &failed(stamp_of(&tr.state), true),
        &wf_retrying,
        10,
        2,
    );
    assert_eq!(tr.record.kind, TransitionKind::StepRetryScheduled);
    // A cancel ends the run.
    let tr = start(&wf, json!({}));
    let cancel = Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: None,
        action_id: None,
    });
    let tr = apply(&tr.state, &cancel, &wf, 10, 2);
    assert_eq!(tr.state.status, RunStatus::Cancelled);
    // A state too large fails the run.
    let tr = start(&wf, json!({}));
    let big = result_ok(stamp_of(&tr.state), json!("x".repeat(5000)));
    let d = fold(Some(&tr.state), &big, &wf, 3000, t(10), &entropy(2));
    let Decision::Transition(tr) = d else {
        panic!("{d:?}")
    };
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.record.detail["cause"], STATE_TOO_LARGE);
    // A step without a catch fails the run as before.
    let plain = Workflows::new(vec![workflow(vec![task("charge")])]).unwrap();
    let tr = start(&plain, json!({}));
    let tr = apply(
        &tr.state,
        &failed(stamp_of(&tr.state), false),
        &plain,
        10,
        2,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
}

#[test]
fn catches_are_checked() {
    let check =
        |steps: Vec<StepDefinition>| workflow(steps).validate().map_err(|e| (e.rule, e.field));
    assert_eq!(
        check(vec![caught_to(task("a"), "zz")]),
        Err((Rule::UnknownStep, "steps[0].catch.next".into()))
    );
    assert_eq!(
        check(vec![task("a"), caught_to(task("b"), "a")]),
        Err((Rule::UnboundedBackEdge, "steps[1].max_visits".into()))
    );
    assert_eq!(
        check(vec![StepDefinition::parallel(
            "p",
            vec![("x", vec![caught_to(task("a"), "p")])]
        )]),
        Err((
            Rule::NotInBranch,
            "steps[0].branches[0].steps[0].catch".into()
        ))
    );
    let choice = StepDefinition {
        catch: Some(Catch {
            next: Some("a".into()),
            result: None,
            compensate: false,
        }),
        ..StepDefinition::choice(
            "c",
            vec![(
                "a",
                condition::Condition {
                    pointer: Some("/input".into()),
                    exists: Some(true),
                    ..condition::Condition::default()
                },
            )],
            "a",
        )
    };
    assert_eq!(
        check(vec![choice, task("a")]).map_err(|e| e.0),
        Err(Rule::FieldOfOtherKind)
    );
    let into_input = StepDefinition {
        catch: Some(Catch {
            next: Some("b".into()),
            result: Some("/input/e".into()),
            compensate: false,
        }),
        ..task("a")
    };
    assert_eq!(
        check(vec![into_input, task("b")]),
        Err((Rule::ResultPath, "steps[0].catch.result".into()))
    );
    // The step caught to may read the error; one that no catch reaches
    // before it may not.
    let reads = |pointer: &str| StepDefinition {
        input: Some(pointer.into()),
        ..task("b")
    };
    assert_eq!(
        check(vec![caught_to(task("a"), "b"), reads("/errors/a")]),
        Ok(())
    );
    assert_eq!(
        check(vec![task("a"), reads("/errors/a")]).map_err(|e| e.0),
        Err(Rule::UnresolvablePointer)
    );
}
