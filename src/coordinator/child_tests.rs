//! Unit tests of child steps: each attempt starts one routed child run
//! named by its stamp, the child's outcome answers that attempt, an
//! abandoned attempt cancels its child, and the definition checks of
//! child steps.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use serde_json::{Value, json};
use uuid::Uuid;

use super::definition::{Rule, Workflows};
use super::fold::*;
use super::tests::{
    STATE_CAP, apply, entropy, failed_with, result_ok, stamp_of, start_with as start, t,
    task_once as task, transition, workflow_of as workflow,
};
use super::*;
use crate::contract::*;

/// `wf`: `prepare` (a task), `ship` (a child run of `shipping`, two
/// attempts), `notify` (a task); and `shipping`, one task `label`.
fn parent_and_child() -> Workflows {
    let ship = StepDefinition {
        retry: RetryPolicy {
            max_attempts: 2,
            initial_backoff_ms: 100,
            ..RetryPolicy::default()
        },
        ..StepDefinition::child("ship", "shipping", 5_000)
    };
    let shipping = WorkflowDefinition {
        name: "shipping".into(),
        ..workflow(vec![task("label")])
    };
    Workflows::new(vec![
        workflow(vec![task("prepare"), ship, task("notify")]),
        shipping,
    ])
    .unwrap()
}

/// `wf`: a parallel step whose branch `a` is a task `a1` and branch `b`
/// a child run of `shipping` (one task).
fn task_beside_child() -> Workflows {
    let both = StepDefinition::parallel(
        "both",
        vec![
            ("a", vec![task("a1")]),
            ("b", vec![StepDefinition::child("b1", "shipping", 5_000)]),
        ],
    );
    Workflows::new(vec![
        workflow(vec![both]),
        WorkflowDefinition {
            name: "shipping".into(),
            ..workflow(vec![task("label")])
        },
    ])
    .unwrap()
}

fn effects_of(tr: &Transition, kind: EffectKind) -> Vec<&Effect> {
    tr.effects.iter().filter(|e| e.kind == kind).collect()
}

/// The run at its child step: `prepare` succeeded with `{"box": 3}`.
fn at_child(wf: &Workflows) -> (Transition, Uuid) {
    let s = start(wf, json!({"order": 9})).state;
    let tr = apply(&s, &result_ok(stamp_of(&s), json!({"box": 3})), wf, 10, 2);
    let child = stamp_of(&tr.state);
    (tr, child)
}

#[test]
fn a_child_step_starts_one_routed_run_named_by_its_attempt_s_stamp() {
    let wf = parent_and_child();
    let (tr, child) = at_child(&wf);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert!(
        effects_of(&tr, EffectKind::StepDispatch).is_empty(),
        "a child step dispatches no task"
    );
    let starts = effects_of(&tr, EffectKind::ChildStart);
    assert_eq!(starts.len(), 1);
    let start = starts[0];
    assert_eq!(
        start.target,
        EffectTarget::Requests {
            run_id: child.to_string()
        }
    );
    let p = &start.payload;
    assert_eq!(p["type"], "run.start");
    assert!(p.get("run_id").is_none(), "the routing plane decides it");
    assert_eq!(p["idempotency_key"], "r1/step/1/child/1");
    assert_eq!(p["workflow"], "shipping");
    assert_eq!(p["tenant"], "t1");
    assert_eq!(p["pool"], "default");
    assert_eq!(p["input"], json!({"box": 3}));
    assert_eq!(
        p["parent"],
        json!({"run_id": "r1", "stamp": child.to_string()})
    );
    // The start decodes as a routed request decided as the stamp.
    let request = crate::routing::decode_route_request(p, None)
        .unwrap()
        .expect("a routed start");
    assert_eq!(request.start.run_id, child.to_string());
    assert_eq!(request.key.as_deref(), Some("r1/step/1/child/1"));
    assert_eq!(
        request.start.parent,
        Some(Box::new(ParentRef {
            run_id: "r1".into(),
            stamp: child
        }))
    );
    // Its attempt times out like a task's.
    assert_eq!(effects_of(&tr, EffectKind::WakeupTimer).len(), 1);
}

#[test]
fn the_child_s_result_is_the_step_s_and_the_run_goes_on() {
    let wf = parent_and_child();
    let (tr, child) = at_child(&wf);
    let tr = apply(
        &tr.state,
        &result_ok(child, json!({"label": "L-1"})),
        &wf,
        20,
        3,
    );
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(tr.state.output, json!({"label": "L-1"}));
    let notify = stamp_of(&tr.state);
    assert_ne!(notify, child);
    assert_eq!(effects_of(&tr, EffectKind::StepDispatch).len(), 1);
    assert!(effects_of(&tr, EffectKind::ChildCancel).is_empty());
}

#[test]
fn a_timed_out_child_is_cancelled_and_the_retry_starts_another() {
    let wf = parent_and_child();
    let (tr, child) = at_child(&wf);
    let timeout = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Timeout,
        stamp: child,
    });
    let tr = apply(&tr.state, &timeout, &wf, 6_000, 3);
    assert_eq!(tr.record.kind, TransitionKind::StepTimedOut);
    let cancels = effects_of(&tr, EffectKind::ChildCancel);
    assert_eq!(cancels.len(), 1);
    assert_eq!(
        cancels[0].target,
        EffectTarget::Requests {
            run_id: child.to_string()
        }
    );
    assert_eq!(cancels[0].payload["type"], "wakeup.cancel");
    assert_eq!(cancels[0].payload["run_id"], child.to_string());
    // The cancel is the input the ingress reads on the requests topic.
    let decoded = decode_value(InputTopic::Requests, &cancels[0].payload).unwrap();
    assert!(matches!(decoded, Input::Cancel(c) if c.run_id == child.to_string()));
    let retry = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Retry,
        stamp: child,
    });
    let tr = apply(&tr.state, &retry, &wf, 6_200, 4);
    assert_eq!(tr.record.kind, TransitionKind::StepRetried);
    let second = stamp_of(&tr.state);
    let starts = effects_of(&tr, EffectKind::ChildStart);
    assert_eq!(starts.len(), 1);
    assert_eq!(starts[0].payload["idempotency_key"], "r1/step/1/child/2");
    assert_eq!(starts[0].payload["parent"]["stamp"], second.to_string());
    // The first child's late answer changes nothing.
    let late = apply_decision(&tr.state, &result_ok(child, json!(1)), &wf);
    assert_eq!(late, Decision::NoOp(NoOpReason::StaleResult));
}

fn apply_decision(state: &RunState, input: &Input, wf: &Workflows) -> Decision {
    fold(Some(state), input, wf, STATE_CAP, t(30_000), &entropy(40))
}

#[test]
fn a_cancel_of_the_parent_cancels_its_running_child() {
    let wf = parent_and_child();
    let (tr, child) = at_child(&wf);
    let cancel = Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: None,
        action_id: None,
    });
    let tr = apply(&tr.state, &cancel, &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::RunCancelled);
    let cancels = effects_of(&tr, EffectKind::ChildCancel);
    assert_eq!(cancels.len(), 1);
    assert_eq!(cancels[0].payload["run_id"], child.to_string());
}

#[test]
fn a_branch_that_fails_fast_cancels_the_child_of_its_sibling() {
    let wf = task_beside_child();
    let tr = start(&wf, json!({}));
    let starts = effects_of(&tr, EffectKind::ChildStart);
    assert_eq!(starts.len(), 1);
    let child: Uuid = starts[0].payload["parent"]["stamp"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let a1 = tr.state.lanes[0].outstanding.as_ref().unwrap().stamp;
    let tr = apply(&tr.state, &failed_with(a1, "no", false), &wf, 10, 2);
    assert_eq!(tr.state.status, RunStatus::Failed);
    let cancels = effects_of(&tr, EffectKind::ChildCancel);
    assert_eq!(cancels.len(), 1);
    assert_eq!(cancels[0].payload["run_id"], child.to_string());
}

/// The start of child run `c1` of `shipping`, answering attempt `stamp`
/// of run `p1`.
fn child_start(stamp: Uuid) -> Input {
    Input::Start(RunStart {
        run_id: "c1".into(),
        tenant: "t1".into(),
        workflow: "shipping".into(),
        workflow_version: None,
        pool: "default".into(),
        input: json!({"box": 3}),
        correlation_id: None,
        parent: Some(Box::new(ParentRef {
            run_id: "p1".into(),
            stamp,
        })),
    })
}

fn child_result(stamp: Uuid, outcome: AttemptOutcome) -> Input {
    Input::Result(AttemptResult {
        run_id: "c1".into(),
        tenant: "t1".into(),
        stamp,
        outcome,
    })
}

fn answer(tr: &Transition) -> Option<(&Effect, Input)> {
    let effect = effects_of(tr, EffectKind::ChildResult).into_iter().next()?;
    let input = decode_value(InputTopic::AttemptResults, &effect.payload).unwrap();
    Some((effect, input))
}

#[test]
fn a_child_run_answers_its_parent_s_attempt_once_it_ends() {
    let wf = parent_and_child();
    let parent_stamp = super::tests::stamp(77);
    let tr = transition(fold(
        None,
        &child_start(parent_stamp),
        &wf,
        STATE_CAP,
        t(0),
        &entropy(1),
    ));
    assert_eq!(tr.record.detail["parent"]["run_id"], "p1");
    assert!(answer(&tr).is_none(), "a child answers when it ends");
    let label = stamp_of(&tr.state);
    let outcome = AttemptOutcome::Succeeded {
        output: json!({"label": "L-1"}),
    };
    let tr = apply(&tr.state, &child_result(label, outcome), &wf, 10, 2);
    assert_eq!(tr.state.status, RunStatus::Succeeded);
    let (effect, input) = answer(&tr).expect("the parent's answer");
    assert_eq!(
        effect.target,
        EffectTarget::AttemptResults {
            run_id: "p1".into()
        }
    );
    let Input::Result(result) = input else {
        panic!("an attempt.result")
    };
    assert_eq!(result.run_id, "p1");
    assert_eq!(result.stamp, parent_stamp);
    assert_eq!(
        result.outcome,
        AttemptOutcome::Succeeded {
            output: json!({"label": "L-1"})
        }
    );
}

#[test]
fn a_failed_or_cancelled_child_answers_for_good_and_each_once() {
    let wf = parent_and_child();
    let parent_stamp = super::tests::stamp(77);
    let started = transition(fold(
        None,
        &child_start(parent_stamp),
        &wf,
        STATE_CAP,
        t(0),
        &entropy(1),
    ));
    let label = stamp_of(&started.state);
    let outcome = AttemptOutcome::Failed {
        message: "no printer".into(),
        retryable: false,
    };
    let failed = apply(&started.state, &child_result(label, outcome), &wf, 10, 2);
    assert_eq!(failed.state.status, RunStatus::Failed);
    let Some((_, Input::Result(result))) = answer(&failed) else {
        panic!("a failed child answers")
    };
    match &result.outcome {
        AttemptOutcome::Failed { message, retryable } => {
            assert!(!*retryable, "its steps retried already");
            assert!(message.contains("no printer"), "{message}");
            assert!(message.starts_with("child run c1 failed"), "{message}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    // A cancel of the failed child ends nothing more: no second answer.
    let cancel = Input::Cancel(CancelWakeup {
        run_id: "c1".into(),
        tenant: "t1".into(),
        reason: None,
        action_id: None,
    });
    if let Decision::Transition(tr) = fold(
        Some(&failed.state),
        &cancel,
        &wf,
        STATE_CAP,
        t(20),
        &entropy(3),
    ) {
        assert!(answer(&tr).is_none());
    }
    // A running child that is cancelled answers, not retryable.
    let cancelled = apply(&started.state, &cancel, &wf, 10, 4);
    assert_eq!(cancelled.state.status, RunStatus::Cancelled);
    let Some((_, Input::Result(result))) = answer(&cancelled) else {
        panic!("a cancelled child answers")
    };
    assert!(matches!(
        result.outcome,
        AttemptOutcome::Failed {
            retryable: false,
            ..
        }
    ));
    // A run without a parent answers nobody.
    let plain = start(&wf, json!({}));
    let plain = apply(&plain.state, &cancel_of("r1"), &wf, 10, 5);
    assert!(answer(&plain).is_none());
}

fn cancel_of(run: &str) -> Input {
    Input::Cancel(CancelWakeup {
        run_id: run.into(),
        tenant: "t1".into(),
        reason: None,
        action_id: None,
    })
}

#[test]
fn a_child_start_keeps_its_parent_in_the_fingerprint_and_on_the_wire() {
    let start = child_start(super::tests::stamp(5));
    let value = start.to_json();
    assert_eq!(decode_value(InputTopic::Requests, &value).unwrap(), start);
    let Input::Start(with) = &start else {
        unreachable!()
    };
    let without = RunStart {
        parent: None,
        ..with.clone()
    };
    assert_ne!(fingerprint::start(with), fingerprint::start(&without));
    let mut bad: Value = value.clone();
    bad["parent"] = json!({"run_id": "p1", "stamp": "not-a-uuid"});
    let e = decode_value(InputTopic::Requests, &bad).unwrap_err();
    assert_eq!(e.class, InputErrorClass::Invalid);
    assert!(e.message.starts_with("parent.stamp"), "{}", e.message);
    // What the screen refuses in any input, and bounds, hold in a parent.
    let nul = serde_json::to_vec(
        &json!({"run_id": "p\u{0}1", "stamp": super::tests::stamp(5).to_string()}),
    )
    .unwrap();
    bad["parent"] = serde_json::from_slice(&nul).unwrap();
    let bytes = serde_json::to_vec(&bad).unwrap();
    let e = decode_input(InputTopic::Requests, &bytes, &InputLimits::sized(1 << 20)).unwrap_err();
    assert!(matches!(e.class, InputErrorClass::Refused(_)), "{e:?}");
    let surrogate = br#"{"type":"run.start","schema_version":1,"idempotency_key":"k","tenant":"t1","workflow":"shipping","parent":{"run_id":"\ud800","stamp":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e"}}"#;
    let e = decode_input(
        InputTopic::Requests,
        surrogate,
        &InputLimits::sized(1 << 20),
    )
    .unwrap_err();
    assert!(matches!(e.class, InputErrorClass::Refused(_)), "{e:?}");
    bad["parent"] = json!({"run_id": "p".repeat(300), "stamp": super::tests::stamp(5).to_string()});
    let e = decode_value(InputTopic::Requests, &bad).unwrap_err();
    assert_eq!(e.class, InputErrorClass::Invalid);
    assert!(e.message.starts_with("parent.run_id"), "{}", e.message);
    bad["parent"] = json!("p1");
    assert_eq!(
        decode_value(InputTopic::Requests, &bad).unwrap_err().class,
        InputErrorClass::Invalid
    );
    // A cancel is read on the wakeups and the requests topics, nothing
    // else is read on the requests topic but a start.
    let cancel = cancel_of("c1").to_json();
    assert!(decode_value(InputTopic::Requests, &cancel).is_ok());
    assert!(decode_value(InputTopic::Wakeups, &cancel).is_ok());
    let signal = Input::Signal(SignalWakeup {
        run_id: "c1".into(),
        tenant: "t1".into(),
        signal_id: "s".into(),
        name: "n".into(),
        payload: Value::Null,
    })
    .to_json();
    assert_eq!(
        decode_value(InputTopic::Requests, &signal)
            .unwrap_err()
            .class,
        InputErrorClass::WrongTopic
    );
}

#[test]
fn child_steps_name_a_defined_workflow_that_does_not_start_them_again() {
    let shipping = || WorkflowDefinition {
        name: "shipping".into(),
        ..workflow(vec![task("label")])
    };
    let rule = |defs: Vec<WorkflowDefinition>| Workflows::new(defs).unwrap_err().rule;
    let child = StepDefinition::child("ship", "shipping", 1_000);
    assert_eq!(
        rule(vec![workflow(vec![child.clone()])]),
        Rule::UnknownWorkflow
    );
    let pinned = StepDefinition {
        version: Some(2),
        ..child.clone()
    };
    assert_eq!(
        rule(vec![workflow(vec![pinned]), shipping()]),
        Rule::UnknownWorkflow
    );
    // wf starts shipping, which starts wf.
    let back = WorkflowDefinition {
        name: "shipping".into(),
        ..workflow(vec![StepDefinition::child("again", "wf", 1_000)])
    };
    assert_eq!(
        rule(vec![workflow(vec![child.clone()]), back]),
        Rule::ChildCycle
    );
    let own = StepDefinition::child("me", "wf", 1_000);
    assert_eq!(rule(vec![workflow(vec![own])]), Rule::ChildCycle);
    // A child without a workflow, with a pool, or with version 0.
    let unnamed = StepDefinition {
        workflow: None,
        ..child.clone()
    };
    let e = workflow(vec![unnamed]).validate().unwrap_err();
    assert_eq!(
        (e.rule, e.field.as_str()),
        (Rule::Invalid, "steps[0].workflow")
    );
    let pooled = StepDefinition {
        pool: "p".into(),
        ..child.clone()
    };
    let e = workflow(vec![pooled]).validate().unwrap_err();
    assert_eq!(
        (e.rule, e.field.as_str()),
        (Rule::FieldOfOtherKind, "steps[0].pool")
    );
    let zero = StepDefinition {
        version: Some(0),
        ..child.clone()
    };
    assert_eq!(
        workflow(vec![zero]).validate().unwrap_err().rule,
        Rule::Invalid
    );
    let on_task = StepDefinition {
        workflow: Some("shipping".into()),
        ..task("t")
    };
    assert_eq!(
        workflow(vec![on_task]).validate().unwrap_err().rule,
        Rule::FieldOfOtherKind
    );
    // A child runs in a branch, and with its workflow defined it loads.
    let in_branch = StepDefinition::parallel("both", vec![("a", vec![child.clone()])]);
    assert!(Workflows::new(vec![workflow(vec![in_branch]), shipping()]).is_ok());
}

#[test]
fn a_parent_failed_for_a_state_too_large_cancels_its_child() {
    let wf = task_beside_child();
    let tr = start(&wf, json!({}));
    let child = effects_of(&tr, EffectKind::ChildStart)[0].payload["parent"]["stamp"].clone();
    let a1 = tr.state.lanes[0].outstanding.as_ref().unwrap().stamp;
    let huge = result_ok(a1, json!("x".repeat(4_096)));
    let Decision::Transition(failed) = fold(Some(&tr.state), &huge, &wf, 2_048, t(10), &entropy(2))
    else {
        panic!("the run fails")
    };
    assert_eq!(failed.record.detail["cause"], "state_too_large");
    let cancels = effects_of(&failed, EffectKind::ChildCancel);
    assert_eq!(cancels.len(), 1);
    assert_eq!(cancels[0].payload["run_id"], child);
}

#[test]
fn only_serve_starts_a_child_run() {
    let body = json!({
        "tenant": "t1", "workflow": "shipping",
        "parent": {"run_id": "p1", "stamp": super::tests::stamp(3).to_string()},
    });
    let refused = crate::api::start::route_request_from_body(body, Some("k".into())).unwrap_err();
    assert!(format!("{refused:?}").contains("parent"), "{refused:?}");
}
