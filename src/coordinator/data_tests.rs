//! Unit tests of data between steps: selections, result paths, the run's
//! output selection, and the definition checks of each.

use serde_json::{Value, json};

use super::definition::Rule;
use super::fold::*;
use super::tests::{
    apply, dispatch_of, entropy, result_ok, stamp, start_with as start, t, transition,
};
use super::*;
use crate::contract::*;

fn task(name: &str) -> StepDefinition {
    StepDefinition::task(name, "p", 1000)
}

fn workflow(steps: Vec<StepDefinition>, output: Option<&str>) -> WorkflowDefinition {
    WorkflowDefinition {
        name: "wf".into(),
        version: 1,
        steps,
        output_topic: Some("out.topic".into()),
        output: output.map(str::to_owned),
    }
}

fn registry(def: WorkflowDefinition) -> Workflows {
    Workflows::new(vec![def]).unwrap()
}

fn input_of(tr: &Transition) -> &Value {
    &dispatch_of(tr).expect("a dispatch")["input"]
}

fn run_output(tr: &Transition) -> Value {
    tr.effects
        .iter()
        .find(|e| e.kind == EffectKind::RunOutput)
        .map(|e| e.payload["output"].clone())
        .expect("the run's output")
}

/// An order: `reserve` gets the order's items, `charge` the order's total
/// and puts its receipt at `/payment`, `ship` gets the whole document; the
/// run's output is the receipt.
fn order() -> Workflows {
    registry(workflow(
        vec![
            StepDefinition {
                input: Some("/input/order/items".into()),
                ..task("reserve")
            },
            StepDefinition {
                input: Some("/input/order/total".into()),
                result: Some("/payment".into()),
                ..task("charge")
            },
            StepDefinition {
                input: Some(String::new()),
                ..task("ship")
            },
        ],
        Some("/payment"),
    ))
}

#[test]
fn each_step_gets_its_selection_and_the_run_ends_with_its_output_selection() {
    let wf = order();
    let order = json!({"order": {"items": ["a", "b"], "total": 30}});
    let tr = start(&wf, order.clone());
    assert_eq!(input_of(&tr), &json!(["a", "b"]));
    assert_eq!(tr.state.results, Some(serde_json::Map::new()));

    let tr = apply(
        &tr.state,
        &result_ok(stamp(1), json!({"held": 2})),
        &wf,
        10,
        2,
    );
    assert_eq!(input_of(&tr), &json!(30));
    let tr = apply(
        &tr.state,
        &result_ok(stamp(2), json!({"receipt": "x9"})),
        &wf,
        20,
        3,
    );
    assert_eq!(
        input_of(&tr),
        &json!({
            "input": order,
            "steps": {"reserve": {"held": 2}},
            "payment": {"receipt": "x9"},
        })
    );
    let tr = apply(
        &tr.state,
        &result_ok(stamp(3), json!("shipped")),
        &wf,
        30,
        4,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert_eq!(tr.state.output, json!({"receipt": "x9"}));
    assert_eq!(run_output(&tr), json!({"receipt": "x9"}));
    assert_eq!(
        tr.state.results.map(Value::Object),
        Some(json!({
            "steps": {"reserve": {"held": 2}, "ship": "shipped"},
            "payment": {"receipt": "x9"},
        }))
    );
}

#[test]
fn a_workflow_that_selects_nothing_keeps_no_document_and_passes_outputs_along() {
    let wf = registry(workflow(vec![task("a"), task("b")], None));
    let tr = start(&wf, json!({"n": 1}));
    assert_eq!(tr.state.results, None);
    assert_eq!(input_of(&tr), &json!({"n": 1}));
    let tr = apply(&tr.state, &result_ok(stamp(1), json!({"n": 2})), &wf, 10, 2);
    assert_eq!(input_of(&tr), &json!({"n": 2}));
    assert_eq!(tr.state.results, None);
    let tr = apply(&tr.state, &result_ok(stamp(2), json!({"n": 3})), &wf, 20, 3);
    assert_eq!(run_output(&tr), json!({"n": 3}));
    assert!(
        serde_json::to_value(&tr.state)
            .unwrap()
            .get("results")
            .is_none()
    );
}

#[test]
fn a_step_without_a_selection_gets_the_output_before_it_in_a_run_with_a_document() {
    let wf = registry(workflow(vec![task("a"), task("b")], Some("/steps/a")));
    let tr = start(&wf, json!({"n": 1}));
    let tr = apply(&tr.state, &result_ok(stamp(1), json!({"n": 2})), &wf, 10, 2);
    assert_eq!(input_of(&tr), &json!({"n": 2}));
    let tr = apply(&tr.state, &result_ok(stamp(2), json!({"n": 3})), &wf, 20, 3);
    assert_eq!(run_output(&tr), json!({"n": 2}));
}

#[test]
fn a_selection_that_finds_nothing_fails_the_run_with_its_cause() {
    let wf = registry(workflow(
        vec![
            task("a"),
            StepDefinition {
                input: Some("/steps/a/id".into()),
                ..task("b")
            },
        ],
        None,
    ));
    let tr = start(&wf, json!({}));
    let tr = apply(
        &tr.state,
        &result_ok(stamp(1), json!({"no_id": 1})),
        &wf,
        10,
        2,
    );
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], UNRESOLVED_POINTER);
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.state.step_index, 1);
    assert!(dispatch_of(&tr).is_none());
    let error = tr.state.error.unwrap();
    assert!(error.starts_with(UNRESOLVED_POINTER), "{error}");
    assert!(error.contains("/steps/a/id"), "{error}");

    // The same at the first step, from the start's input.
    let wf = registry(workflow(
        vec![StepDefinition {
            input: Some("/input/order".into()),
            ..task("a")
        }],
        None,
    ));
    let tr = start(&wf, json!({"x": 1}));
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.record.detail["cause"], UNRESOLVED_POINTER);
}

#[test]
fn a_result_path_through_a_value_that_is_no_object_fails_the_run() {
    let wf = registry(workflow(
        vec![
            StepDefinition {
                result: Some("/order".into()),
                ..task("a")
            },
            StepDefinition {
                result: Some("/order/charge".into()),
                ..task("b")
            },
        ],
        None,
    ));
    let tr = start(&wf, json!({}));
    let tr = apply(&tr.state, &result_ok(stamp(1), json!("text")), &wf, 10, 2);
    let tr = apply(&tr.state, &result_ok(stamp(2), json!(1)), &wf, 20, 3);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], RESULT_PATH_BLOCKED);
    assert!(tr.state.error.unwrap().contains("string"));
    // The attempt that returned it succeeded: its result is in the history.
    assert_eq!(tr.record.detail["output"], json!(1));
}

#[test]
fn a_result_that_outgrows_the_state_fails_the_run_as_too_large() {
    let wf = registry(workflow(vec![task("a"), task("b")], Some("/steps/a")));
    let tr = start(&wf, json!({}));
    let big = json!("x".repeat(3000));
    let d = fold(
        Some(&tr.state),
        &result_ok(stamp(1), big),
        &wf,
        4096,
        t(10),
        &entropy(2),
    );
    let tr = transition(d);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.detail["cause"], STATE_TOO_LARGE);
}

#[test]
fn a_waiting_step_gets_its_selection_and_keeps_its_output() {
    let wf = registry(workflow(
        vec![
            StepDefinition {
                input: Some("/input/ship".into()),
                until: Some("/at".into()),
                duration_ms: None,
                ..StepDefinition::sleep("nap", 1)
            },
            task("go"),
        ],
        None,
    ));
    let past = "2000-01-01T00:00:00Z";
    let tr = start(&wf, json!({"ship": {"at": past}, "other": 1}));
    let expected = json!({"at": past, "nap": {"until": "2000-01-01T00:00:00.000Z"}});
    assert_eq!(input_of(&tr), &expected);
    assert_eq!(
        tr.state.results.map(Value::Object),
        Some(json!({"steps": {"nap": expected}}))
    );
}

#[test]
fn a_retried_attempt_gets_the_same_selection() {
    let mut wf = workflow(
        vec![
            task("a"),
            StepDefinition {
                input: Some("/input".into()),
                ..task("b")
            },
        ],
        None,
    );
    wf.steps[1].retry.max_attempts = 2;
    let wf = registry(wf);
    let tr = start(&wf, json!({"k": 1}));
    let tr = apply(&tr.state, &result_ok(stamp(1), json!({"a": 1})), &wf, 10, 2);
    assert_eq!(input_of(&tr), &json!({"k": 1}));
    let failed = Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp: stamp(2),
        outcome: AttemptOutcome::Failed {
            message: "no".into(),
            retryable: true,
        },
    });
    let tr = apply(&tr.state, &failed, &wf, 20, 3);
    let retry = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Retry,
        stamp: stamp(2),
    });
    let tr = apply(&tr.state, &retry, &wf, 500, 4);
    assert_eq!(tr.record.kind, TransitionKind::StepRetried);
    assert_eq!(input_of(&tr), &json!({"k": 1}));
}

// ---- the definition checks ------------------------------------------------------------

fn refusal(def: WorkflowDefinition) -> (Rule, String, Option<String>) {
    let e = def.validate().expect_err("a refusal");
    (e.rule, e.field, e.step)
}

#[test]
fn each_selection_and_result_path_is_checked_where_it_is_read() {
    let with = |i: usize, input: Option<&str>, result: Option<&str>| {
        let mut steps = vec![task("a"), task("b"), task("c")];
        steps[i].input = input.map(str::to_owned);
        steps[i].result = result.map(str::to_owned);
        workflow(steps, None)
    };
    for ok in [
        with(1, Some("/input/x"), None),
        with(1, Some(""), None),
        with(1, Some("/steps/a/id"), None),
        with(1, Some("/steps"), None),
        with(2, Some("/steps/b"), Some("/out/c")),
        with(0, None, Some("/steps/a/deeper")),
    ] {
        ok.validate().unwrap();
    }
    let unresolvable = [
        with(1, Some("/steps/c"), None),
        with(1, Some("/steps/b"), None),
        with(0, Some("/steps/a"), None),
        with(1, Some("/elsewhere"), None),
    ];
    for def in unresolvable {
        let (rule, field, step) = refusal(def);
        assert_eq!(rule, Rule::UnresolvablePointer);
        assert!(field.ends_with(".input"), "{field}");
        assert!(step.is_some());
    }
    for (def, field) in [
        (with(1, None, Some("")), "steps[1].result"),
        (with(1, None, Some("/input/x")), "steps[1].result"),
        (with(1, None, Some("/steps/a")), "steps[1].result"),
        (with(1, None, Some("/steps")), "steps[1].result"),
    ] {
        assert_eq!(
            refusal(def),
            (Rule::ResultPath, field.to_owned(), Some("b".to_owned()))
        );
    }
    for (def, field) in [
        (with(1, Some("input"), None), "steps[1].input"),
        (with(1, Some("/a~2"), None), "steps[1].input"),
        (
            with(1, Some(&format!("/{}", "x".repeat(300))), None),
            "steps[1].input",
        ),
        (with(1, None, Some("nope")), "steps[1].result"),
    ] {
        assert_eq!(
            refusal(def),
            (Rule::Invalid, field.to_owned(), Some("b".to_owned()))
        );
    }
    // A result placed elsewhere is read there, and only after its step.
    let mut steps = vec![task("a"), task("b")];
    steps[0].result = Some("/order/charge".into());
    steps[1].input = Some("/order/charge/id".into());
    workflow(steps.clone(), Some("/order")).validate().unwrap();
    steps[1].input = Some("/steps/a".into());
    assert_eq!(refusal(workflow(steps, None)).0, Rule::UnresolvablePointer);
}

#[test]
fn the_output_selection_reads_what_any_step_places() {
    workflow(vec![task("a"), task("b")], Some("/steps/b/x"))
        .validate()
        .unwrap();
    workflow(vec![task("a")], Some("/input/x"))
        .validate()
        .unwrap();
    let (rule, field, step) = refusal(workflow(vec![task("a")], Some("/steps/z")));
    assert_eq!(
        (rule, field.as_str(), step),
        (Rule::UnresolvablePointer, "output", None)
    );
    let (rule, ..) = refusal(workflow(vec![task("a")], Some("steps")));
    assert_eq!(rule, Rule::Invalid);
}
