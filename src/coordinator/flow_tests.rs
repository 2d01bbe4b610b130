//! Unit tests of choices and loops: where a choice goes, `next` and `end`,
//! the visits that bound a loop and the step keys of each visit, and the
//! definition checks of the graph.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use serde_json::{Value, json};

use super::condition::Condition;
use super::definition::Rule;
use super::fold::*;
use super::tests::{
    apply, dispatch_of, result_ok, stamp, start_with as start, workflow_of as workflow,
};
use super::*;
use crate::contract::*;

fn task(name: &str) -> StepDefinition {
    StepDefinition::task(name, "p", 1000)
}

fn when(pointer: &str, equals: Value) -> Condition {
    Condition {
        pointer: Some(pointer.into()),
        equals: Some(equals),
        ..Condition::default()
    }
}

fn step_of(tr: &Transition) -> Value {
    dispatch_of(tr).expect("a dispatch")["step"].clone()
}

/// `route` sends express orders to `express`, others to `standard`; both
/// end at `done`.
fn routed() -> Workflows {
    Workflows::new(vec![workflow(vec![
        StepDefinition::choice(
            "route",
            vec![("express", when("/input/speed", json!("fast")))],
            "standard",
        ),
        StepDefinition {
            next: Some("done".into()),
            ..task("express")
        },
        task("standard"),
        task("done"),
    ])])
    .unwrap()
}

#[test]
fn a_choice_goes_to_the_first_rule_that_holds_or_its_default() {
    let wf = routed();
    let fast = start(&wf, json!({"speed": "fast"}));
    assert_eq!(step_of(&fast), json!("express"));
    assert_eq!(fast.state.step_index, 1);
    assert_eq!(
        fast.record.detail["passed_steps"],
        json!([{"step_index": 0, "chose": "express"}])
    );
    // express goes on at done (its next), past standard.
    let tr = apply(
        &fast.state,
        &result_ok(stamp(1), json!({"e": 1})),
        &wf,
        10,
        2,
    );
    assert_eq!(step_of(&tr), json!("done"));
    assert_eq!(dispatch_of(&tr).unwrap()["input"], json!({"e": 1}));
    let tr = apply(&tr.state, &result_ok(stamp(2), json!({"d": 1})), &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);

    let slow = start(&wf, json!({"speed": "slow"}));
    assert_eq!(step_of(&slow), json!("standard"));
    // standard goes on in order, to done.
    let tr = apply(&slow.state, &result_ok(stamp(1), json!({})), &wf, 10, 2);
    assert_eq!(step_of(&tr), json!("done"));
    // A straight line that chooses keeps no visits.
    assert!(tr.state.visits.is_empty());
}

#[test]
fn a_step_that_ends_the_run_skips_the_rest() {
    let wf = Workflows::new(vec![workflow(vec![
        StepDefinition {
            end: true,
            ..task("only")
        },
        task("never"),
    ])])
    .unwrap_err();
    // `never` cannot be reached: refused.
    assert_eq!(wf.rule, Rule::UnreachableStep);
    let wf = Workflows::new(vec![workflow(vec![
        StepDefinition::choice(
            "route",
            vec![("quick", when("/input/q", json!(true)))],
            "slow",
        ),
        StepDefinition {
            end: true,
            ..task("quick")
        },
        task("slow"),
    ])])
    .unwrap();
    let tr = start(&wf, json!({"q": true}));
    let tr = apply(&tr.state, &result_ok(stamp(1), json!("q")), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(tr.state.output, json!("q"));
}

/// `charge`, then `check`: back to `charge` until its result says paid, at
/// most three times.
fn looping() -> Workflows {
    looping_with(RetryPolicy::default())
}

fn looping_with(retry: RetryPolicy) -> Workflows {
    Workflows::new(vec![workflow(vec![
        StepDefinition {
            max_visits: Some(3),
            retry,
            ..task("charge")
        },
        StepDefinition {
            max_visits: Some(3),
            ..StepDefinition::choice(
                "check",
                vec![("charge", when("/steps/charge/paid", json!(false)))],
                "ship",
            )
        },
        task("ship"),
    ])])
    .unwrap()
}

#[test]
fn a_loop_runs_a_step_again_under_a_key_of_its_visit_until_its_bound() {
    let wf = looping();
    let tr = start(&wf, json!({}));
    assert_eq!(dispatch_of(&tr).unwrap()["step_key"], json!("r1/step/0"));
    assert_eq!(tr.state.visits.get(&0).map(|v| v.count), Some(1));
    let tr = apply(
        &tr.state,
        &result_ok(stamp(1), json!({"paid": false})),
        &wf,
        10,
        2,
    );
    // Its attempts are numbered on, each number naming one attempt.
    assert_eq!(dispatch_of(&tr).unwrap()["attempt"], json!(2));
    assert_eq!(tr.state.visits[&0].first_attempt, 2);
    assert_eq!(step_of(&tr), json!("charge"));
    assert_eq!(
        dispatch_of(&tr).unwrap()["step_key"],
        json!("r1/step/0/visit/2")
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp(2), json!({"paid": false})),
        &wf,
        20,
        3,
    );
    assert_eq!(
        dispatch_of(&tr).unwrap()["step_key"],
        json!("r1/step/0/visit/3")
    );
    // A fourth start of charge is over its bound.
    let tr = apply(
        &tr.state,
        &result_ok(stamp(3), json!({"paid": false})),
        &wf,
        30,
        4,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], LOOP_BOUND);
    assert!(tr.state.error.as_deref().unwrap().starts_with(LOOP_BOUND));
    assert!(dispatch_of(&tr).is_none());

    // Paid at the second visit: the loop ends at ship.
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp(1), json!({"paid": false})),
        &wf,
        10,
        2,
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp(2), json!({"paid": true})),
        &wf,
        20,
        3,
    );
    assert_eq!(step_of(&tr), json!("ship"));
    assert_eq!(tr.state.visits.get(&1).map(|v| v.count), Some(2));
}

// ---- the definition checks of the graph ------------------------------------------------

fn refusal(steps: Vec<StepDefinition>) -> (Rule, String, Option<String>) {
    let e = workflow(steps).validate().expect_err("a refusal");
    (e.rule, e.field, e.step)
}

#[test]
fn each_rule_of_the_graph_names_its_step_and_field() {
    let unknown = refusal(vec![StepDefinition {
        next: Some("nowhere".into()),
        ..task("a")
    }]);
    assert_eq!(
        unknown,
        (Rule::UnknownStep, "steps[0].next".into(), Some("a".into()))
    );
    let unknown = refusal(vec![
        StepDefinition::choice("c", vec![("a", when("/input/x", json!(1)))], "gone"),
        task("a"),
    ]);
    assert_eq!(unknown.0, Rule::UnknownStep);
    assert_eq!(unknown.1, "steps[0].default");
    let unknown = refusal(vec![
        StepDefinition::choice("c", vec![("zz", when("/input/x", json!(1)))], "a"),
        task("a"),
    ]);
    assert_eq!(unknown.1, "steps[0].choices[0].next");

    let unbounded = refusal(vec![
        task("a"),
        StepDefinition::choice("c", vec![("a", when("/input/x", json!(1)))], "b"),
        task("b"),
    ]);
    assert_eq!(
        unbounded,
        (
            Rule::UnboundedBackEdge,
            "steps[1].max_visits".into(),
            Some("c".into())
        )
    );
    let to_itself = refusal(vec![StepDefinition {
        next: Some("a".into()),
        ..task("a")
    }]);
    // A step that only goes back to itself is unbounded first, and even
    // bounded it never reaches the end.
    assert_eq!(to_itself.0, Rule::UnboundedBackEdge);
    let no_end = refusal(vec![StepDefinition {
        next: Some("a".into()),
        max_visits: Some(2),
        ..task("a")
    }]);
    assert_eq!(no_end, (Rule::NoEnd, "steps[0]".into(), Some("a".into())));

    let unreachable = refusal(vec![
        StepDefinition {
            next: Some("c".into()),
            ..task("a")
        },
        task("b"),
        task("c"),
    ]);
    assert_eq!(
        unreachable,
        (Rule::UnreachableStep, "steps[1]".into(), Some("b".into()))
    );

    // A condition reads what may have been placed before the choice.
    let (rule, field, _) = refusal(vec![
        StepDefinition::choice("c", vec![("a", when("/steps/a/x", json!(1)))], "a"),
        task("a"),
    ]);
    assert_eq!(
        (rule, field.as_str()),
        (Rule::UnresolvablePointer, "steps[0].choices[0].when")
    );
    // In a loop, a step's own earlier result is there to read.
    looping();

    for (step, field) in [
        (
            StepDefinition {
                choices: Vec::new(),
                ..StepDefinition::choice("c", vec![], "a")
            },
            "steps[0].choices",
        ),
        (
            StepDefinition {
                default: None,
                ..StepDefinition::choice("c", vec![("a", when("/input/x", json!(1)))], "a")
            },
            "steps[0].default",
        ),
        (
            StepDefinition::choice("c", vec![("a", Condition::default())], "a"),
            "steps[0].choices[0].when",
        ),
        (
            StepDefinition {
                max_visits: Some(0),
                ..task("c")
            },
            "steps[0].max_visits",
        ),
        (
            StepDefinition {
                end: true,
                next: Some("a".into()),
                ..task("c")
            },
            "steps[0].next",
        ),
    ] {
        let (rule, got, _) = refusal(vec![step, task("a")]);
        assert_eq!((rule, got.as_str()), (Rule::Invalid, field));
    }
    for (step, field) in [
        (
            StepDefinition {
                pool: "p".into(),
                ..StepDefinition::choice("c", vec![("a", when("/input/x", json!(1)))], "a")
            },
            "steps[0].pool",
        ),
        (
            StepDefinition {
                next: Some("a".into()),
                ..StepDefinition::choice("c", vec![("a", when("/input/x", json!(1)))], "a")
            },
            "steps[0].next",
        ),
        (
            StepDefinition {
                default: Some("a".into()),
                ..task("c")
            },
            "steps[0].default",
        ),
    ] {
        let (rule, got, _) = refusal(vec![step, task("a")]);
        assert_eq!((rule, got.as_str()), (Rule::FieldOfOtherKind, field));
    }
}

#[test]
fn each_visit_of_a_step_has_its_own_retries() {
    let wf = looping_with(RetryPolicy {
        max_attempts: 2,
        ..RetryPolicy::default()
    });
    let failed = |n: u128| {
        Input::Result(AttemptResult {
            run_id: "r1".into(),
            tenant: "t1".into(),
            stamp: stamp(n),
            outcome: AttemptOutcome::Failed {
                message: "no".into(),
                retryable: true,
            },
        })
    };
    let retry = |n: u128| {
        Input::Timer(TimerWakeup {
            run_id: "r1".into(),
            tenant: "t1".into(),
            timer: TimerKind::Retry,
            stamp: stamp(n),
        })
    };
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp(1), json!({"paid": false})),
        &wf,
        10,
        2,
    );
    // The second visit's first attempt (number 2) fails: it has one retry.
    let tr = apply(&tr.state, &failed(2), &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::StepRetryScheduled);
    let tr = apply(&tr.state, &retry(2), &wf, 2_000, 4);
    assert_eq!(dispatch_of(&tr).unwrap()["attempt"], json!(3));
    let tr = apply(&tr.state, &failed(4), &wf, 2_100, 5);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], "attempts_exhausted");
}
