//! Unit tests: one per branch of the definition checks, the input contract and the fold.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::{Value, json};
use uuid::Uuid;

use super::fold::*;
use super::*;
use crate::contract::*;

/// A state cap no test run reaches unless it means to.
pub(super) const STATE_CAP: usize = 1 << 20;

pub(super) fn t(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap()
}

pub(super) fn stamp(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

pub(super) fn entropy(n: u128) -> Entropy {
    Entropy {
        stamp: stamp(n),
        jitter_unit: 0.5,
    }
}

fn retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        initial_backoff_ms: 100,
        max_backoff_ms: 1000,
        multiplier: 2.0,
        jitter: 0.0,
    }
}

fn def(steps: usize, max_attempts: u32) -> WorkflowDefinition {
    WorkflowDefinition {
        name: "wf".into(),
        version: 1,
        steps: (0..steps)
            .map(|i| StepDefinition {
                retry: retry(max_attempts),
                ..StepDefinition::task(&format!("s{i}"), &format!("pool{i}"), 1000)
            })
            .collect(),
        output_topic: Some("out.topic".into()),
        output: None,
    }
}

/// Workflow `wf` version 1 of `steps`, without an output topic or
/// selection.
pub(super) fn workflow_of(steps: Vec<StepDefinition>) -> WorkflowDefinition {
    WorkflowDefinition {
        name: "wf".into(),
        version: 1,
        steps,
        output_topic: None,
        output: None,
    }
}

fn registry(steps: usize, max_attempts: u32) -> Workflows {
    Workflows::new(vec![def(steps, max_attempts)]).unwrap()
}

pub(super) fn start_input() -> Input {
    Input::Start(RunStart {
        run_id: "r1".into(),
        tenant: "t1".into(),
        workflow: "wf".into(),
        workflow_version: None,
        pool: "default".into(),
        input: json!({"x": 1}),
        correlation_id: Some("c".into()),
        parent: None,
    })
}

/// The start of run `r1` of workflow `wf` (its latest version) with `input`.
pub(super) fn start_with(wf: &Workflows, input: Value) -> Transition {
    let start = Input::Start(RunStart {
        run_id: "r1".into(),
        tenant: "t1".into(),
        workflow: "wf".into(),
        workflow_version: None,
        pool: "default".into(),
        input,
        correlation_id: None,
        parent: None,
    });
    transition(fold(None, &start, wf, STATE_CAP, t(0), &entropy(1)))
}

pub(super) fn result_ok(s: Uuid, output: Value) -> Input {
    Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp: s,
        outcome: AttemptOutcome::Succeeded { output },
    })
}

fn result_err(s: Uuid, retryable: bool) -> Input {
    Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp: s,
        outcome: AttemptOutcome::Failed {
            message: "boom".into(),
            retryable,
        },
    })
}

fn timer(kind: TimerKind, s: Uuid) -> Input {
    Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: kind,
        stamp: s,
    })
}

fn signal(id: &str) -> Input {
    Input::Signal(SignalWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        signal_id: id.into(),
        name: "poke".into(),
        payload: json!(1),
    })
}

fn cancel() -> Input {
    Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: Some("user".into()),
        action_id: None,
    })
}

pub(super) fn transition(d: Decision) -> Transition {
    match d {
        Decision::Transition(t) => *t,
        other => panic!("expected a transition, got {other:?}"),
    }
}

fn started(wf: &Workflows) -> RunState {
    transition(fold(None, &start_input(), wf, STATE_CAP, t(0), &entropy(1))).state
}

pub(super) fn apply(
    state: &RunState,
    input: &Input,
    wf: &Workflows,
    now: i64,
    e: u128,
) -> Transition {
    transition(fold(Some(state), input, wf, STATE_CAP, t(now), &entropy(e)))
}

pub(super) fn rejection_class(d: Decision) -> RejectionClass {
    match d {
        Decision::Rejection(r) => r.class,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

// ---- definitions -------------------------------------------------------------------

#[test]
fn valid_definition_passes() {
    def(3, 3).validate().unwrap();
}

type Mutation = Box<dyn Fn(&mut WorkflowDefinition)>;

#[test]
fn each_definition_rule_names_its_field() {
    let cases: Vec<(Mutation, &str)> = vec![
        (Box::new(|d| d.name = String::new()), "name"),
        (Box::new(|d| d.name = "a b".into()), "name"),
        (Box::new(|d| d.name = "a".repeat(101)), "name"),
        (Box::new(|d| d.version = 0), "version"),
        (Box::new(|d| d.steps.clear()), "steps"),
        (Box::new(|d| d.steps = def(65, 1).steps), "steps"),
        (Box::new(|d| d.steps[1].name = "s0".into()), "steps[1].name"),
        (Box::new(|d| d.steps[1].name = "".into()), "steps[1].name"),
        (
            Box::new(|d| d.steps[1].pool = "a/b".into()),
            "steps[1].pool",
        ),
        (
            Box::new(|d| d.steps[1].timeout_ms = 0),
            "steps[1].timeout_ms",
        ),
        (
            Box::new(|d| d.steps[1].timeout_ms = 86_400_001),
            "steps[1].timeout_ms",
        ),
        (
            Box::new(|d| d.steps[1].retry.max_attempts = 0),
            "steps[1].retry.max_attempts",
        ),
        (
            Box::new(|d| d.steps[1].retry.max_attempts = 101),
            "steps[1].retry.max_attempts",
        ),
        (
            Box::new(|d| d.steps[1].retry.initial_backoff_ms = 1001),
            "steps[1].retry.initial_backoff_ms",
        ),
        (
            Box::new(|d| d.steps[1].retry.max_backoff_ms = 86_400_001),
            "steps[1].retry.max_backoff_ms",
        ),
        (
            Box::new(|d| d.steps[1].retry.multiplier = 0.5),
            "steps[1].retry.multiplier",
        ),
        (
            Box::new(|d| d.steps[1].retry.multiplier = f64::NAN),
            "steps[1].retry.multiplier",
        ),
        (
            Box::new(|d| d.steps[1].retry.multiplier = f64::INFINITY),
            "steps[1].retry.multiplier",
        ),
        (
            Box::new(|d| d.steps[1].retry.jitter = 1.5),
            "steps[1].retry.jitter",
        ),
        (
            Box::new(|d| d.steps[1].retry.jitter = -0.1),
            "steps[1].retry.jitter",
        ),
        (
            Box::new(|d| d.steps[1].retry.jitter = f64::NAN),
            "steps[1].retry.jitter",
        ),
        (
            Box::new(|d| d.output_topic = Some("..".into())),
            "output_topic",
        ),
        (
            Box::new(|d| d.output_topic = Some("a:b".into())),
            "output_topic",
        ),
    ];
    for (mutate, field) in cases {
        let mut d = def(3, 3);
        mutate(&mut d);
        assert_eq!(d.validate().unwrap_err().field, field);
    }
}

#[test]
fn registry_rejects_duplicates_and_finds_latest() {
    let mut v2 = def(1, 1);
    v2.version = 2;
    let wf = Workflows::new(vec![v2.clone(), def(2, 1)]).unwrap();
    assert_eq!(wf.latest("wf").unwrap().version, 2);
    assert_eq!(wf.get("wf", 1).unwrap().steps.len(), 2);
    assert!(wf.get("wf", 3).is_none());
    assert!(wf.latest("nope").is_none());
    assert_eq!(wf.iter().count(), 2);
    let err = Workflows::new(vec![v2.clone(), v2]).unwrap_err();
    assert_eq!(err.field, "version");
    let mut bad = def(1, 1);
    bad.version = 0;
    assert!(Workflows::new(vec![bad]).is_err());
}

#[test]
fn backoff_grows_caps_and_jitters() {
    let p = RetryPolicy {
        max_attempts: 10,
        initial_backoff_ms: 100,
        max_backoff_ms: 1000,
        multiplier: 2.0,
        jitter: 0.2,
    };
    assert_eq!(p.backoff_ms(1, 0.0), 100);
    assert_eq!(p.backoff_ms(2, 0.0), 200);
    assert_eq!(p.backoff_ms(4, 0.0), 800);
    assert_eq!(p.backoff_ms(5, 0.0), 1000);
    assert_eq!(p.backoff_ms(u32::MAX, 0.0), 1000);
    assert_eq!(p.backoff_ms(1, 0.5), 90);
    assert_eq!(p.backoff_ms(1, 0.999_999), 80);
    assert_eq!(p.backoff_ms(0, 0.0), 100);
    assert_eq!(p.backoff_ms(3, f64::NAN), 400);
    let wild = RetryPolicy {
        multiplier: f64::NAN,
        jitter: f64::INFINITY,
        initial_backoff_ms: u64::MAX,
        max_backoff_ms: 5,
        ..p
    };
    assert!(wild.backoff_ms(7, 2.0) <= 5);
}

// ---- inputs ------------------------------------------------------------------------

fn decode(topic: InputTopic, v: Value) -> Result<Input, InputError> {
    decode_input(
        topic,
        v.to_string().as_bytes(),
        &InputLimits::sized(1 << 20),
    )
}

fn class(topic: InputTopic, v: Value) -> InputErrorClass {
    decode(topic, v).unwrap_err().class
}

#[test]
fn decodes_every_type_with_defaults() {
    let start = decode(
        InputTopic::Requests,
        json!({"type":"run.start","schema_version":1,"run_id":"r:1","tenant":"t","workflow":"wf","extra":true}),
    )
    .unwrap();
    let Input::Start(s) = &start else { panic!() };
    assert_eq!(s.pool, "default");
    assert_eq!(s.input, Value::Null);
    assert_eq!(s.workflow_version, None);
    assert_eq!(start.dedup_ref(), "start");
    let st = stamp(7);
    let r = decode(
        InputTopic::AttemptResults,
        json!({"type":"attempt.result","schema_version":1,"run_id":"r","tenant":"t","stamp":st.to_string(),"outcome":"failed","error":{"message":"x","retryable":true}}),
    )
    .unwrap();
    assert_eq!(r.dedup_ref(), format!("result:{st}"));
    let tm = decode(
        InputTopic::Wakeups,
        json!({"type":"wakeup.timer","schema_version":1,"run_id":"r","tenant":"t","timer":"retry","stamp":st.to_string()}),
    )
    .unwrap();
    assert_eq!(tm.dedup_ref(), format!("timer:retry:{st}"));
    let sg = decode(
        InputTopic::Wakeups,
        json!({"type":"wakeup.signal","schema_version":1,"run_id":"r","tenant":"t","signal_id":"s 1","name":"n"}),
    )
    .unwrap();
    assert_eq!(sg.dedup_ref(), "signal:s 1");
    let c = decode(
        InputTopic::Wakeups,
        json!({"type":"wakeup.cancel","schema_version":1,"run_id":"r","tenant":"t","reason":null}),
    )
    .unwrap();
    assert_eq!(c.dedup_ref(), "cancel");
    assert_eq!((c.run_id(), c.tenant()), ("r", "t"));
}

#[test]
fn classifies_bad_inputs() {
    use InputErrorClass::*;
    let w = InputTopic::Wakeups;
    assert_eq!(
        decode_input(w, b"{}", &InputLimits::sized(1))
            .unwrap_err()
            .class,
        TooLarge
    );
    assert_eq!(
        decode_input(w, &[0xff, 0xfe], &InputLimits::sized(10))
            .unwrap_err()
            .class,
        Malformed
    );
    assert_eq!(
        decode_input(w, b"{not json", &InputLimits::sized(100))
            .unwrap_err()
            .class,
        Malformed
    );
    assert_eq!(class(w, json!([1])), Malformed);
    assert_eq!(class(w, json!({"schema_version":1})), Invalid);
    assert_eq!(
        class(w, json!({"type":"nope","schema_version":1})),
        UnknownType
    );
    assert_eq!(
        class(w, json!({"type":"wakeup.cancel","schema_version":2})),
        UnsupportedVersion
    );
    assert_eq!(
        class(w, json!({"type":"wakeup.cancel","schema_version":"1"})),
        Invalid
    );
    assert_eq!(class(w, json!({"type":"wakeup.cancel"})), Invalid);
    let start =
        json!({"type":"run.start","schema_version":1,"run_id":"r","tenant":"t","workflow":"wf"});
    assert_eq!(class(w, start.clone()), WrongTopic);
    assert_eq!(
        class(
            InputTopic::AttemptResults,
            json!({"type":"wakeup.cancel","schema_version":1})
        ),
        WrongTopic
    );
    let cancel = |extra: Value| {
        let mut v = json!({"type":"wakeup.cancel","schema_version":1,"run_id":"r","tenant":"t"});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    for (bad, field) in [
        (json!({"run_id": ""}), "run_id"),
        (json!({"run_id": "a/b"}), "run_id"),
        (json!({"run_id": "a".repeat(129)}), "run_id"),
        (json!({"tenant": 5}), "tenant"),
        (json!({"reason": "x".repeat(1025)}), "reason"),
    ] {
        let e = decode(w, cancel(bad)).unwrap_err();
        assert_eq!(e.class, Invalid);
        assert!(e.message.starts_with(field), "{}", e.message);
    }
    let st = stamp(1).to_string();
    let result = |extra: Value| {
        let mut v = json!({"type":"attempt.result","schema_version":1,"run_id":"r","tenant":"t","stamp":st,"outcome":"failed","error":{"message":"m","retryable":false}});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        decode(InputTopic::AttemptResults, v).unwrap_err().message
    };
    assert!(result(json!({"stamp":"not-a-uuid"})).starts_with("stamp"));
    assert!(result(json!({"outcome":"maybe"})).starts_with("outcome"));
    assert!(result(json!({"error":"x"})).starts_with("error"));
    assert!(result(json!({"error":{"message":"m"}})).starts_with("error.retryable"));
    assert!(
        result(json!({"error":{"message":"m".repeat(4097),"retryable":true}}))
            .starts_with("error.message")
    );
    let start_bad = |extra: Value| {
        let mut v = start.clone();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        decode(InputTopic::Requests, v).unwrap_err().message
    };
    assert!(start_bad(json!({"workflow_version": -1})).starts_with("workflow_version"));
    assert!(start_bad(json!({"workflow_version": 1u64 << 33})).starts_with("workflow_version"));
    assert!(start_bad(json!({"pool": "a b"})).starts_with("pool"));
    assert!(start_bad(json!({"correlation_id": "c".repeat(257)})).starts_with("correlation_id"));
    assert!(start_bad(json!({"workflow": null})).starts_with("workflow"));
    let timer_bad = json!({"type":"wakeup.timer","schema_version":1,"run_id":"r","tenant":"t","timer":"soon","stamp":st});
    assert!(
        decode(w, timer_bad)
            .unwrap_err()
            .message
            .starts_with("timer")
    );
    let signal_bad = json!({"type":"wakeup.signal","schema_version":1,"run_id":"r","tenant":"t","signal_id":"","name":"n"});
    assert!(
        decode(w, signal_bad)
            .unwrap_err()
            .message
            .starts_with("signal_id")
    );
}

#[test]
fn error_messages_are_bounded_and_do_not_echo_payloads() {
    let huge_type = json!({"type": "x".repeat(10_000), "schema_version": 1});
    let e = decode(InputTopic::Wakeups, huge_type).unwrap_err();
    assert!(e.message.chars().count() <= 512);
    let secret = "s3cr3t".repeat(100);
    let e = decode(
        InputTopic::Wakeups,
        json!({"type":"wakeup.cancel","schema_version":1,"run_id":secret,"tenant":"t"}),
    )
    .unwrap_err();
    assert!(!e.message.contains("s3cr3t"));
    assert_eq!(
        InputErrorClass::UnsupportedVersion.as_str(),
        "unsupported_version"
    );
    assert_eq!(InputErrorClass::WrongTopic.as_str(), "wrong_topic");
}

// ---- fold: start -------------------------------------------------------------------

#[test]
fn start_dispatches_step_zero_with_timer_after_event() {
    let wf = registry(2, 3);
    let tr = transition(fold(
        None,
        &start_input(),
        &wf,
        STATE_CAP,
        t(0),
        &entropy(1),
    ));
    let s = &tr.state;
    assert_eq!(
        (s.status, s.step_index, s.attempt, s.last_transition_seq),
        (RunStatus::Running, 0, 1, 1)
    );
    assert_eq!(s.record_version, 0);
    assert_eq!(s.outstanding.as_ref().unwrap().stamp, stamp(1));
    assert_eq!(s.outstanding.as_ref().unwrap().deadline, t(1000));
    assert_eq!(tr.record.kind, TransitionKind::RunStarted);
    assert_eq!(tr.record.from_status, None);
    assert_eq!(tr.record.input_ref, "start");
    assert!(matches!(&tr.attempt_writes[..], [AttemptWrite::Insert(a)] if a.stamp == stamp(1)));
    assert_eq!(tr.effects.len(), 3);
    assert_eq!(tr.effects[0].target, EffectTarget::Events);
    assert_eq!(tr.effects[0].payload["kind"], "run.started");
    assert_eq!(tr.effects[0].payload["seq"], 1);
    assert_eq!(
        tr.effects[1].target,
        EffectTarget::StepQueue {
            pool: "pool0".into()
        }
    );
    let d = &tr.effects[1].payload;
    assert_eq!(d["type"], "step.dispatch");
    assert_eq!(d["input"], json!({"x": 1}));
    assert_eq!(d["stamp"], stamp(1).to_string());
    assert_eq!(d["step"], "s0");
    assert_eq!(d["deadline"], "2023-11-14T22:13:21.000Z");
    assert_eq!(tr.effects[2].target, EffectTarget::Wakeups);
    assert_eq!(tr.effects[2].not_before, Some(t(1000)));
    assert_eq!(
        tr.effects[2].payload,
        timer(TimerKind::Timeout, stamp(1)).to_json()
    );
}

#[test]
fn start_of_unknown_workflow_or_version_is_rejected() {
    let wf = registry(1, 1);
    let mut input = start_input();
    if let Input::Start(s) = &mut input {
        s.workflow_version = Some(9);
    }
    assert_eq!(
        rejection_class(fold(None, &input, &wf, STATE_CAP, t(0), &entropy(1))),
        RejectionClass::UnknownWorkflow
    );
    assert_eq!(
        rejection_class(fold(
            None,
            &start_input(),
            &Workflows::default(),
            STATE_CAP,
            t(0),
            &entropy(1)
        )),
        RejectionClass::UnknownWorkflow
    );
}

#[test]
fn a_second_start_is_a_duplicate_only_if_it_is_the_same_request() {
    let wf = registry(1, 1);
    let s = started(&wf);
    let mut resent = start_input();
    if let Input::Start(x) = &mut resent {
        x.correlation_id = Some("another envelope".into());
    }
    assert_eq!(
        fold(Some(&s), &resent, &wf, STATE_CAP, t(5), &entropy(2)),
        Decision::NoOp(NoOpReason::DuplicateStart)
    );
    let mut other = start_input();
    if let Input::Start(x) = &mut other {
        x.input = json!("different");
    }
    assert_eq!(
        rejection_class(fold(Some(&s), &other, &wf, STATE_CAP, t(5), &entropy(2))),
        RejectionClass::IdempotencyMismatch
    );
    // A run started before fingerprints were kept takes any start as a
    // duplicate, as it did.
    let mut legacy = s.clone();
    legacy.start_fingerprint = None;
    assert_eq!(
        fold(Some(&legacy), &other, &wf, STATE_CAP, t(5), &entropy(2)),
        Decision::NoOp(NoOpReason::DuplicateStart)
    );
}

#[test]
fn a_signal_id_reused_with_another_payload_is_refused_even_after_the_run_ended() {
    let wf = registry(1, 1);
    let s = apply(&started(&wf), &signal("a"), &wf, 5, 2).state;
    let mut other = signal("a");
    if let Input::Signal(x) = &mut other {
        x.payload = json!(2);
    }
    assert_eq!(
        rejection_class(fold(Some(&s), &other, &wf, STATE_CAP, t(6), &entropy(3))),
        RejectionClass::IdempotencyMismatch
    );
    let mut renamed = signal("a");
    if let Input::Signal(x) = &mut renamed {
        x.name = "prod".into();
    }
    assert_eq!(
        rejection_class(fold(Some(&s), &renamed, &wf, STATE_CAP, t(6), &entropy(3))),
        RejectionClass::IdempotencyMismatch
    );
    let ended = apply(&s, &cancel(), &wf, 7, 4).state;
    assert!(ended.status.is_terminal());
    assert_eq!(
        rejection_class(fold(
            Some(&ended),
            &other,
            &wf,
            STATE_CAP,
            t(8),
            &entropy(5)
        )),
        RejectionClass::IdempotencyMismatch
    );
    assert_eq!(
        fold(
            Some(&ended),
            &signal("a"),
            &wf,
            STATE_CAP,
            t(8),
            &entropy(5)
        ),
        Decision::NoOp(NoOpReason::RunTerminal)
    );
    let mut legacy = s.clone();
    legacy.signals[0].fingerprint = None;
    assert_eq!(
        fold(Some(&legacy), &other, &wf, STATE_CAP, t(6), &entropy(3)),
        Decision::NoOp(NoOpReason::DuplicateSignal)
    );
}

#[test]
fn non_start_without_run_and_tenant_mismatch_are_rejected() {
    let wf = registry(1, 1);
    assert_eq!(
        rejection_class(fold(None, &cancel(), &wf, STATE_CAP, t(0), &entropy(1))),
        RejectionClass::UnknownRun
    );
    let s = started(&wf);
    let mut dup = start_input();
    if let Input::Start(x) = &mut dup {
        x.tenant = "other".into();
    }
    assert_eq!(
        rejection_class(fold(Some(&s), &dup, &wf, STATE_CAP, t(1), &entropy(2))),
        RejectionClass::TenantMismatch
    );
    let mut other_run = cancel();
    if let Input::Cancel(c) = &mut other_run {
        c.run_id = "r2".into();
    }
    assert_eq!(
        rejection_class(fold(
            Some(&s),
            &other_run,
            &wf,
            STATE_CAP,
            t(1),
            &entropy(2)
        )),
        RejectionClass::UnknownRun
    );
}

// ---- fold: results -----------------------------------------------------------------

#[test]
fn success_dispatches_next_step_with_previous_output() {
    let wf = registry(2, 3);
    let s = started(&wf);
    let tr = apply(&s, &result_ok(stamp(1), json!("o1")), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(tr.state.output, json!("o1"));
    assert_eq!(tr.record.detail["output"], json!("o1"));
    assert_eq!((tr.state.step_index, tr.state.attempt), (1, 1));
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::Succeeded);
    assert_eq!(tr.state.last_transition_seq, 2);
    assert_eq!(tr.state.updated_at, t(10));
    assert_eq!(tr.attempt_writes.len(), 2);
    assert_eq!(tr.effects[1].payload["input"], json!("o1"));
    assert_eq!(tr.effects[1].payload["step_index"], 1);
    assert_eq!(
        tr.effects[1].target,
        EffectTarget::StepQueue {
            pool: "pool1".into()
        }
    );
    // the same result again is a duplicate
    assert_eq!(
        fold(
            Some(&tr.state),
            &result_ok(stamp(1), json!("o1")),
            &wf,
            STATE_CAP,
            t(11),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateResult)
    );
}

#[test]
fn last_success_completes_run_and_emits_output() {
    let wf = registry(1, 3);
    let s = started(&wf);
    let tr = apply(&s, &result_ok(stamp(1), json!({"done": true})), &wf, 10, 2);
    assert_eq!(tr.state.status, RunStatus::Succeeded);
    assert_eq!(tr.record.kind, TransitionKind::RunSucceeded);
    assert!(tr.state.outstanding.is_none());
    assert_eq!(tr.effects.len(), 2);
    assert_eq!(tr.effects[0].payload["status"], "succeeded");
    assert_eq!(
        tr.effects[1].target,
        EffectTarget::Output {
            topic: "out.topic".into()
        }
    );
    assert_eq!(
        tr.effects[1].payload,
        json!({"type":"run.output","schema_version":1,"run_id":"r1","tenant":"t1","workflow":"wf","output":{"done":true}})
    );
    // terminal: further inputs do nothing
    assert_eq!(
        fold(
            Some(&tr.state),
            &cancel(),
            &wf,
            STATE_CAP,
            t(11),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::RunTerminal)
    );
    assert_eq!(
        fold(
            Some(&tr.state),
            &signal("a"),
            &wf,
            STATE_CAP,
            t(11),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::RunTerminal)
    );
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Timeout, stamp(1)),
            &wf,
            STATE_CAP,
            t(11),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
}

#[test]
fn no_output_effect_without_output_topic() {
    let mut d = def(1, 1);
    d.output_topic = None;
    let wf = Workflows::new(vec![d]).unwrap();
    let tr = apply(&started(&wf), &result_ok(stamp(1), json!(1)), &wf, 10, 2);
    assert_eq!(tr.effects.len(), 1);
}

#[test]
fn permanent_failure_fails_run() {
    let wf = registry(2, 3);
    let tr = apply(&started(&wf), &result_err(stamp(1), false), &wf, 10, 2);
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert!(tr.state.error.as_deref().unwrap().contains("boom"));
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::Failed);
    assert_eq!(tr.effects.len(), 1);
    assert_eq!(
        fold(
            Some(&tr.state),
            &result_err(stamp(1), false),
            &wf,
            STATE_CAP,
            t(11),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateResult)
    );
}

#[test]
fn retryable_failure_schedules_retry_then_retry_timer_dispatches() {
    let wf = registry(1, 2);
    let tr = apply(&started(&wf), &result_err(stamp(1), true), &wf, 10, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepRetryScheduled);
    assert_eq!(tr.state.status, RunStatus::Running);
    let pending = tr.state.pending_retry.clone().unwrap();
    assert_eq!(pending.after_stamp, stamp(1));
    assert_eq!(pending.due_at, t(110));
    assert_eq!(tr.effects.len(), 2);
    assert_eq!(tr.effects[1].not_before, Some(t(110)));
    assert_eq!(
        tr.effects[1].payload,
        timer(TimerKind::Retry, stamp(1)).to_json()
    );
    // the retry timer dispatches attempt 2
    let tr2 = apply(&tr.state, &timer(TimerKind::Retry, stamp(1)), &wf, 110, 3);
    assert_eq!(tr2.record.kind, TransitionKind::StepRetried);
    assert_eq!(
        (
            tr2.state.attempt,
            tr2.state.outstanding.as_ref().unwrap().stamp
        ),
        (2, stamp(3))
    );
    assert!(tr2.state.pending_retry.is_none());
    assert_eq!(tr2.effects.len(), 3);
    assert_eq!(tr2.effects[1].payload["attempt"], 2);
    // the retry timer again is a duplicate
    assert_eq!(
        fold(
            Some(&tr2.state),
            &timer(TimerKind::Retry, stamp(1)),
            &wf,
            STATE_CAP,
            t(111),
            &entropy(4)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
    // attempt 2 of 2 fails retryably: attempts exhausted
    let tr3 = apply(&tr2.state, &result_err(stamp(3), true), &wf, 200, 4);
    assert_eq!(tr3.state.status, RunStatus::Failed);
    assert_eq!(tr3.record.detail["cause"], "attempts_exhausted");
}

#[test]
fn timeout_abandons_attempt_and_late_result_is_stale() {
    let wf = registry(1, 2);
    let tr = apply(
        &started(&wf),
        &timer(TimerKind::Timeout, stamp(1)),
        &wf,
        1000,
        2,
    );
    assert_eq!(tr.record.kind, TransitionKind::StepTimedOut);
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::TimedOut);
    assert!(tr.state.pending_retry.is_some());
    assert_eq!(
        fold(
            Some(&tr.state),
            &result_ok(stamp(1), json!(1)),
            &wf,
            STATE_CAP,
            t(1001),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::StaleResult)
    );
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Timeout, stamp(1)),
            &wf,
            STATE_CAP,
            t(1001),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
    let tr2 = apply(&tr.state, &timer(TimerKind::Retry, stamp(1)), &wf, 1200, 3);
    let tr3 = apply(
        &tr2.state,
        &timer(TimerKind::Timeout, stamp(3)),
        &wf,
        2200,
        4,
    );
    assert_eq!(tr3.state.status, RunStatus::Failed);
    assert!(tr3.state.error.as_deref().unwrap().contains("timed out"));
}

#[test]
fn timer_after_success_is_duplicate_and_unknown_stamps_are_rejected() {
    let wf = registry(2, 2);
    let tr = apply(&started(&wf), &result_ok(stamp(1), json!(1)), &wf, 10, 2);
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Timeout, stamp(1)),
            &wf,
            STATE_CAP,
            t(1000),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Retry, stamp(1)),
            &wf,
            STATE_CAP,
            t(1000),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
    for input in [
        result_ok(stamp(99), json!(1)),
        timer(TimerKind::Timeout, stamp(99)),
        timer(TimerKind::Retry, stamp(99)),
    ] {
        assert_eq!(
            rejection_class(fold(
                Some(&tr.state),
                &input,
                &wf,
                STATE_CAP,
                t(1000),
                &entropy(3)
            )),
            RejectionClass::UnknownStamp
        );
    }
}

#[test]
fn missing_definition_for_existing_run_is_rejected_but_duplicates_stay_noops() {
    let wf = registry(2, 2);
    let s = started(&wf);
    let empty = Workflows::default();
    assert_eq!(
        rejection_class(fold(
            Some(&s),
            &result_ok(stamp(1), json!(1)),
            &empty,
            STATE_CAP,
            t(1),
            &entropy(2)
        )),
        RejectionClass::UnknownWorkflow
    );
    assert_eq!(
        fold(
            Some(&s),
            &start_input(),
            &empty,
            STATE_CAP,
            t(1),
            &entropy(2)
        ),
        Decision::NoOp(NoOpReason::DuplicateStart)
    );
}

// ---- fold: signals and cancel -----------------------------------------------------

#[test]
fn signals_are_recorded_once_and_bounded() {
    let wf = registry(1, 1);
    let mut s = started(&wf);
    let tr = apply(&s, &signal("a"), &wf, 5, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunSignalled);
    assert_eq!(tr.state.status, RunStatus::Running);
    assert_eq!(tr.state.outstanding, s.outstanding);
    assert_eq!(tr.state.signals.len(), 1);
    assert_eq!(tr.effects.len(), 1);
    assert_eq!(
        fold(
            Some(&tr.state),
            &signal("a"),
            &wf,
            STATE_CAP,
            t(6),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateSignal)
    );
    for i in 0..MAX_SIGNALS_PER_RUN {
        s = apply(&s, &signal(&format!("s{i}")), &wf, 5, 2).state;
    }
    assert_eq!(
        rejection_class(fold(
            Some(&s),
            &signal("more"),
            &wf,
            STATE_CAP,
            t(6),
            &entropy(3)
        )),
        RejectionClass::TooManySignals
    );
    assert_eq!(
        fold(Some(&s), &signal("s0"), &wf, STATE_CAP, t(6), &entropy(3)),
        Decision::NoOp(NoOpReason::DuplicateSignal)
    );
}

#[test]
fn cancel_finishes_outstanding_attempt_and_clears_retry() {
    let wf = registry(1, 3);
    let s = started(&wf);
    let tr = apply(&s, &cancel(), &wf, 5, 2);
    assert_eq!(tr.state.status, RunStatus::Cancelled);
    assert_eq!(tr.record.kind, TransitionKind::RunCancelled);
    assert_eq!(tr.state.error.as_deref(), Some("user"));
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::Cancelled);
    assert!(matches!(
        tr.attempt_writes[..],
        [AttemptWrite::Finish {
            status: AttemptStatus::Cancelled,
            ..
        }]
    ));
    assert_eq!(
        fold(
            Some(&tr.state),
            &cancel(),
            &wf,
            STATE_CAP,
            t(6),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::RunTerminal)
    );
    assert_eq!(
        fold(
            Some(&tr.state),
            &result_ok(stamp(1), json!(1)),
            &wf,
            STATE_CAP,
            t(6),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::StaleResult)
    );
    // while a retry is pending
    let failed = apply(&s, &result_err(stamp(1), true), &wf, 5, 2);
    let tr = apply(&failed.state, &cancel(), &wf, 6, 3);
    assert!(tr.state.pending_retry.is_none());
    assert!(tr.attempt_writes.is_empty());
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Retry, stamp(1)),
            &wf,
            STATE_CAP,
            t(7),
            &entropy(4)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
}

#[test]
fn state_serializes_with_snake_case_and_round_trips() {
    let wf = registry(2, 2);
    let s = apply(
        &started(&wf),
        &timer(TimerKind::Timeout, stamp(1)),
        &wf,
        1000,
        2,
    )
    .state;
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(v["status"], "running");
    assert_eq!(v["attempts"][0]["status"], "timed_out");
    let back: RunState = serde_json::from_value(v).unwrap();
    assert_eq!(back, s);
    assert_eq!(RunStatus::Cancelled.as_str(), "cancelled");
    assert!(RunStatus::Failed.is_terminal() && !RunStatus::Running.is_terminal());
    assert_eq!(NoOpReason::StaleResult.as_str(), "stale_result");
    assert_eq!(RejectionClass::TooManySignals.as_str(), "too_many_signals");
}

#[test]
fn deadlines_saturate_instead_of_overflowing() {
    let wf = registry(1, 1);
    let far = DateTime::<Utc>::MAX_UTC - TimeDelta::milliseconds(10);
    let tr = transition(fold(None, &start_input(), &wf, STATE_CAP, far, &entropy(1)));
    assert_eq!(
        tr.state.outstanding.unwrap().deadline,
        DateTime::<Utc>::MAX_UTC
    );
}

// ---- the size budget ----------------------------------------------------------------

/// Limits whose payload bound is `max` bytes once written back.
fn payload_limits(max: usize) -> InputLimits {
    InputLimits {
        max_payload_bytes: max,
        ..InputLimits::sized(1 << 20)
    }
}

/// Six numbers that each grow from 4 bytes to 18 when written back.
fn growing() -> Value {
    json!([9e15, 9e15, 9e15, 9e15, 9e15, 9e15])
}

#[test]
fn an_output_that_would_outgrow_its_effect_fails_the_attempt_for_good() {
    let input = result_ok(stamp(1), growing());
    let sent = input.to_json().to_string().len();
    let Ok(Input::Result(bounded)) = bound_payload(input, sent, &payload_limits(100)) else {
        panic!("a result stays a result");
    };
    match bounded.outcome {
        AttemptOutcome::Failed { message, retryable } => {
            assert!(!retryable);
            assert!(message.starts_with("payload_too_large"), "{message}");
            assert!(message.chars().count() <= crate::contract::input::MAX_ERROR_MESSAGE_LEN);
        }
        other => panic!("not failed: {other:?}"),
    }
    let fits = result_ok(stamp(1), growing());
    assert_eq!(
        bound_payload(fits.clone(), sent, &payload_limits(200)),
        Ok(fits),
        "an output that fits is left alone"
    );
}

#[test]
fn a_start_or_signal_that_would_outgrow_its_effect_is_refused() {
    let Input::Start(mut start) = start_input() else {
        unreachable!()
    };
    start.input = growing();
    let sent = Input::Start(start.clone()).to_json().to_string().len();
    let refused =
        bound_payload(Input::Start(start.clone()), sent, &payload_limits(100)).unwrap_err();
    assert_eq!(refused.class, InputErrorClass::PayloadTooLarge);
    assert_eq!(refused.class.as_str(), "payload_too_large");
    assert!(bound_start(&start, sent, &payload_limits(200)).is_ok());
    let Input::Signal(mut sig) = signal("s") else {
        unreachable!()
    };
    sig.payload = growing();
    let sent = Input::Signal(sig.clone()).to_json().to_string().len();
    assert_eq!(
        bound_payload(Input::Signal(sig), sent, &payload_limits(100))
            .unwrap_err()
            .class,
        InputErrorClass::PayloadTooLarge
    );
}

#[test]
fn small_messages_are_not_measured_and_pass() {
    // 4 bytes sent can grow to 20 at most: far below a limit of 1000.
    let input = result_ok(stamp(1), growing());
    assert_eq!(
        bound_payload(input.clone(), 4, &payload_limits(1000)),
        Ok(input)
    );
}

// ---- the state's size ---------------------------------------------------------------

fn encoded(state: &RunState) -> String {
    serde_json::to_string(state).unwrap()
}

#[test]
fn a_run_keeps_its_newest_output_in_state_and_every_output_in_history() {
    let wf = registry(3, 1);
    let mut s = started(&wf);
    assert_eq!(s.output, Value::Null);
    let mut details = Vec::new();
    for step in 0..3u128 {
        let output = json!({"from": format!("step {step}"), "pad": "p".repeat(100)});
        let tr = apply(
            &s,
            &result_ok(stamp(step + 1), output.clone()),
            &wf,
            10,
            step + 2,
        );
        assert_eq!(tr.state.output, output, "the newest output only");
        assert_eq!(tr.record.detail["output"], output);
        assert_eq!(tr.record.detail["completed_step"], json!(step));
        if step < 2 {
            assert_eq!(
                tr.effects[1].payload["input"], output,
                "the next step's input"
            );
        }
        details.push(tr.record.detail.clone());
        s = tr.state;
    }
    assert_eq!(s.status, RunStatus::Succeeded);
    let state = encoded(&s);
    assert!(!state.contains("step 0") && !state.contains("step 1"));
    assert!(state.contains("step 2"));
    assert!(serde_json::to_value(&s).unwrap().get("outputs").is_none());
    let history: Vec<&Value> = details.iter().map(|d| &d["output"]["from"]).collect();
    assert_eq!(
        history,
        [&json!("step 0"), &json!("step 1"), &json!("step 2")]
    );
}

#[test]
fn a_signal_payload_is_kept_in_history_not_in_state() {
    let wf = registry(1, 1);
    let Input::Signal(mut sig) = signal("a") else {
        unreachable!()
    };
    sig.payload = json!({"note": "kept in the history"});
    let tr = apply(&started(&wf), &Input::Signal(sig), &wf, 5, 2);
    assert_eq!(tr.record.kind, TransitionKind::RunSignalled);
    assert_eq!(
        tr.record.detail,
        json!({"signal_id": "a", "name": "poke", "payload": {"note": "kept in the history"}})
    );
    assert_eq!(tr.state.signals.len(), 1);
    assert!(!encoded(&tr.state).contains("kept in the history"));
    let v = serde_json::to_value(&tr.state).unwrap();
    assert!(v["signals"][0].get("payload").is_none());
}

#[test]
fn a_transition_over_the_state_cap_fails_the_run_with_state_too_large() {
    let wf = registry(2, 3);
    let s = started(&wf);
    let big = result_ok(stamp(1), json!("o".repeat(1000)));
    let uncapped = apply(&s, &big, &wf, 10, 2);
    let len = encoded(&uncapped.state).len();
    // At the cap the transition is taken as it is.
    let at_cap = transition(fold(Some(&s), &big, &wf, len, t(10), &entropy(2)));
    assert_eq!(at_cap, uncapped);
    // One byte below, the run fails instead, for good.
    let tr = transition(fold(Some(&s), &big, &wf, len - 1, t(10), &entropy(2)));
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.input_ref, format!("result:{}", stamp(1)));
    assert_eq!(tr.record.detail["cause"], STATE_TOO_LARGE);
    assert_eq!(tr.record.detail["stamp"], stamp(1).to_string());
    assert!(tr.record.detail.get("output").is_none());
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.state.output, Value::Null);
    assert!(tr.state.outstanding.is_none());
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::Failed);
    let error = tr.state.error.clone().unwrap();
    assert!(error.starts_with("state_too_large: "), "{error}");
    assert!(error.contains(&format!("{len} bytes")), "{error}");
    // The lifecycle event says the run failed; nothing is dispatched.
    assert_eq!(tr.effects.len(), 1);
    assert_eq!(tr.effects[0].payload["kind"], "run.failed");
    assert_eq!(tr.effects[0].payload["status"], "failed");
    assert!(matches!(
        &tr.attempt_writes[..],
        [AttemptWrite::Finish {
            status: AttemptStatus::Failed,
            ..
        }]
    ));
    assert_eq!(
        fold(Some(&tr.state), &big, &wf, len - 1, t(11), &entropy(3)),
        Decision::NoOp(NoOpReason::DuplicateResult)
    );
}

#[test]
fn a_cap_hit_by_another_input_abandons_the_outstanding_attempt() {
    let wf = registry(1, 1);
    let s = started(&wf);
    let tr = apply(&s, &signal("a"), &wf, 5, 2);
    let cap = encoded(&tr.state).len() - 1;
    let failed = transition(fold(Some(&s), &signal("a"), &wf, cap, t(5), &entropy(2)));
    assert_eq!(failed.record.kind, TransitionKind::RunFailed);
    assert_eq!(failed.record.detail["cause"], STATE_TOO_LARGE);
    assert!(failed.state.signals.is_empty());
    assert_eq!(failed.state.attempts[0].status, AttemptStatus::Cancelled);
    assert_eq!(
        fold(
            Some(&failed.state),
            &result_ok(stamp(1), json!(1)),
            &wf,
            cap,
            t(6),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::StaleResult)
    );
}

#[test]
fn a_start_over_the_state_cap_is_refused() {
    let wf = registry(1, 1);
    let len = encoded(&started(&wf)).len();
    assert_eq!(
        rejection_class(fold(None, &start_input(), &wf, len - 1, t(0), &entropy(1))),
        RejectionClass::StateTooLarge
    );
    assert_eq!(RejectionClass::StateTooLarge.as_str(), "state_too_large");
    assert!(matches!(
        fold(None, &start_input(), &wf, len, t(0), &entropy(1)),
        Decision::Transition(_)
    ));
}

// Steps that wait: sleep and await_signal.

/// `task a` (pool0), the given waiting step, `task b` (pool1).
fn waits(middle: StepDefinition) -> Workflows {
    let mut d = def(2, 3);
    d.steps.insert(1, middle);
    Workflows::new(vec![d]).unwrap()
}

fn named_signal(id: &str, name: &str, payload: Value) -> Input {
    Input::Signal(SignalWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        signal_id: id.into(),
        name: name.into(),
        payload,
    })
}

/// A task on pool `p` that gets one attempt: its first failure is for good.
pub(super) fn task_once(name: &str) -> StepDefinition {
    StepDefinition {
        retry: RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        },
        ..StepDefinition::task(name, "p", 1000)
    }
}

/// A failed result of attempt `stamp` of run `r1`.
pub(super) fn failed_with(stamp: Uuid, message: &str, retryable: bool) -> Input {
    Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp,
        outcome: AttemptOutcome::Failed {
            message: message.into(),
            retryable,
        },
    })
}

/// The stamp of the run's own outstanding attempt.
pub(super) fn stamp_of(s: &RunState) -> Uuid {
    s.outstanding
        .as_ref()
        .expect("an attempt outstanding")
        .stamp
}

pub(super) fn dispatch_of(tr: &Transition) -> Option<&Value> {
    tr.effects
        .iter()
        .find(|e| matches!(e.target, EffectTarget::StepQueue { .. }))
        .map(|e| &e.payload)
}

#[test]
fn a_sleep_step_waits_for_its_wake_timer_then_the_run_moves_on() {
    let wf = waits(StepDefinition::sleep("nap", 500));
    let s = started(&wf);
    let tr = apply(&s, &result_ok(stamp(1), json!({"a": 1})), &wf, 100, 2);
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(tr.record.detail["next_stamp"], stamp(2).to_string());
    let w = tr.state.waiting.clone().expect("the run sleeps");
    assert_eq!((w.stamp, w.step_index, w.until), (stamp(2), 1, t(600)));
    assert_eq!(tr.state.outstanding, None);
    assert!(dispatch_of(&tr).is_none(), "a sleep dispatches nothing");
    let wake = timer(TimerKind::Wake, stamp(2));
    assert_eq!(tr.effects.len(), 2);
    assert_eq!(tr.effects[1].payload, wake.to_json());
    assert_eq!(tr.effects[1].not_before, Some(t(600)));

    let other = fold(
        Some(&tr.state),
        &timer(TimerKind::Wake, stamp(9)),
        &wf,
        STATE_CAP,
        t(600),
        &entropy(3),
    );
    assert_eq!(other, Decision::NoOp(NoOpReason::DuplicateTimer));
    let woke = apply(&tr.state, &wake, &wf, 601, 3);
    assert_eq!(woke.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(woke.record.input_ref, format!("timer:wake:{}", stamp(2)));
    assert_eq!(woke.state.waiting, None);
    let expected = json!({"a": 1, "nap": {"until": "2023-11-14T22:13:20.600Z"}});
    assert_eq!(woke.record.detail["output"], expected);
    let d = dispatch_of(&woke).expect("the step after the sleep is dispatched");
    assert_eq!(
        (d["step"].clone(), d["input"].clone()),
        (json!("s1"), expected)
    );
    assert_eq!(
        fold(
            Some(&woke.state),
            &wake,
            &wf,
            STATE_CAP,
            t(700),
            &entropy(4)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
}

#[test]
fn an_await_signal_step_is_ended_by_its_signal_or_by_its_timeout() {
    for on_timeout in [OnTimeout::Fail, OnTimeout::Continue] {
        let wf = waits(StepDefinition::await_signal(
            "approve", "ok", 1000, on_timeout,
        ));
        let s = started(&wf);
        let waiting = apply(&s, &result_ok(stamp(1), json!({"a": 1})), &wf, 100, 2).state;
        assert_eq!(
            waiting.waiting.as_ref().unwrap().signal.as_deref(),
            Some("ok")
        );
        assert_eq!(waiting.waiting.as_ref().unwrap().until, t(1100));

        // Another name is only recorded; the awaited one ends the step.
        let other = apply(&waiting, &named_signal("x", "nope", json!(0)), &wf, 200, 3);
        assert_eq!(other.record.kind, TransitionKind::RunSignalled);
        assert!(other.state.waiting.is_some());
        let got = apply(
            &other.state,
            &named_signal("g", "ok", json!({"by": "ann"})),
            &wf,
            300,
            4,
        );
        assert_eq!(got.record.kind, TransitionKind::StepSucceeded);
        assert_eq!(got.record.detail["signal_id"], "g");
        let expected = json!({"a": 1, "approve": {"signal_id": "g", "payload": {"by": "ann"}}});
        assert_eq!(dispatch_of(&got).unwrap()["input"], expected);
        let record = got
            .state
            .signals
            .iter()
            .find(|r| r.signal_id == "g")
            .unwrap();
        assert_eq!((record.consumed_by, record.kept), (Some(1), false));
        let late_wake = timer(TimerKind::Wake, stamp(2));
        assert_eq!(
            fold(
                Some(&got.state),
                &late_wake,
                &wf,
                STATE_CAP,
                t(1100),
                &entropy(5)
            ),
            Decision::NoOp(NoOpReason::DuplicateTimer)
        );

        // No signal: the timeout fails the run or goes on without one.
        let timed_out = apply(&waiting, &late_wake, &wf, 1100, 5);
        match on_timeout {
            OnTimeout::Fail => {
                assert_eq!(timed_out.record.kind, TransitionKind::RunFailed);
                assert_eq!(timed_out.state.status, RunStatus::Failed);
                assert_eq!(timed_out.record.detail["cause"], "signal_timeout");
                let error = timed_out.state.error.clone().unwrap();
                assert!(error.contains("\"ok\""), "{error}");
            }
            OnTimeout::Continue => {
                assert_eq!(timed_out.record.kind, TransitionKind::StepSucceeded);
                let input = &dispatch_of(&timed_out).unwrap()["input"];
                assert_eq!(input["approve"], json!({"timed_out": true}));
            }
        }
        assert_eq!(timed_out.state.waiting, None);
    }
}

#[test]
fn a_signal_that_came_before_its_step_started_is_kept_and_consumed_by_it() {
    let wf = waits(StepDefinition::await_signal(
        "approve",
        "ok",
        1000,
        OnTimeout::Fail,
    ));
    let s = started(&wf);
    let early = apply(&s, &named_signal("e", "ok", json!(null)), &wf, 10, 2);
    let second = apply(&early.state, &named_signal("f", "ok", json!(2)), &wf, 11, 2);
    let unawaited = apply(
        &second.state,
        &named_signal("u", "nope", json!(3)),
        &wf,
        12,
        2,
    );
    let kept: Vec<(&str, bool, Option<&Value>)> = unawaited
        .state
        .signals
        .iter()
        .map(|r| (r.signal_id.as_str(), r.kept, r.payload.as_ref()))
        .collect();
    // One await of "ok" remains: one signal of it is kept, with its
    // payload (a null one too); the others only deduplicate.
    assert_eq!(
        kept,
        [
            ("e", true, Some(&Value::Null)),
            ("f", false, None),
            ("u", false, None)
        ]
    );

    let tr = apply(
        &unawaited.state,
        &result_ok(stamp(1), json!({"a": 1})),
        &wf,
        100,
        3,
    );
    assert_eq!(tr.record.kind, TransitionKind::StepSucceeded);
    assert_eq!(
        tr.state.waiting, None,
        "the kept signal ended the wait at once"
    );
    assert_eq!(tr.record.detail["passed_steps"][0]["step_index"], 1);
    let expected = json!({"a": 1, "approve": {"signal_id": "e", "payload": null}});
    let d = dispatch_of(&tr).unwrap();
    assert_eq!(
        (d["step_index"].clone(), d["input"].clone()),
        (json!(2), expected)
    );
    assert_eq!(tr.record.detail["next_stamp"], stamp(3).to_string());
    let e = &tr.state.signals[0];
    assert_eq!(
        (e.kept, e.consumed_by, e.payload.clone()),
        (false, Some(1), None)
    );
}

#[test]
fn a_sleep_until_a_time_of_the_input_ends_at_once_if_past_and_fails_if_absent() {
    let sleep = |pointer: &str| StepDefinition {
        duration_ms: None,
        until: Some(pointer.into()),
        ..StepDefinition::sleep("until", 1)
    };
    let one = |step: StepDefinition| {
        let mut d = def(1, 1);
        d.steps = vec![step];
        Workflows::new(vec![d]).unwrap()
    };
    let start_with = |input: Value| {
        Input::Start(RunStart {
            input,
            ..match start_input() {
                Input::Start(s) => s,
                _ => unreachable!(),
            }
        })
    };
    let wf = one(sleep("/at"));
    let past = start_with(json!({"at": "2020-01-01T00:00:00Z"}));
    let tr = transition(fold(None, &past, &wf, STATE_CAP, t(0), &entropy(1)));
    assert_eq!(tr.record.kind, TransitionKind::RunStarted);
    assert_eq!(tr.state.status, RunStatus::Succeeded);
    assert_eq!(
        tr.state.output["until"]["until"],
        "2020-01-01T00:00:00.000Z"
    );
    assert!(tr.effects.iter().any(|e| e.kind == EffectKind::RunOutput));

    let future = start_with(json!({"at": "2023-11-14T22:13:25Z"}));
    let tr = transition(fold(None, &future, &wf, STATE_CAP, t(0), &entropy(1)));
    assert_eq!(tr.state.waiting.as_ref().unwrap().until, t(5000));
    assert_eq!(tr.record.detail["stamp"], stamp(1).to_string());

    for bad in [json!({}), json!({"at": 5}), json!({"at": "tomorrow"})] {
        let tr = transition(fold(
            None,
            &start_with(bad.clone()),
            &wf,
            STATE_CAP,
            t(0),
            &entropy(1),
        ));
        assert_eq!(tr.state.status, RunStatus::Failed, "{bad}");
        assert!(tr.state.error.clone().unwrap().contains("/at"), "{bad}");
    }
}

#[test]
fn a_cancel_ends_a_wait_and_its_wake_changes_nothing() {
    let wf = waits(StepDefinition::sleep("nap", 500));
    let s = started(&wf);
    let waiting = apply(&s, &result_ok(stamp(1), json!({})), &wf, 100, 2).state;
    let cancelled = apply(&waiting, &cancel(), &wf, 200, 3);
    assert_eq!(cancelled.state.status, RunStatus::Cancelled);
    assert_eq!(cancelled.state.waiting, None);
    assert_eq!(
        fold(
            Some(&cancelled.state),
            &timer(TimerKind::Wake, stamp(2)),
            &wf,
            STATE_CAP,
            t(600),
            &entropy(4)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
}

#[test]
fn waiting_steps_are_checked_by_kind() {
    let cases: Vec<(StepDefinition, &str)> = vec![
        (
            StepDefinition {
                pool: "p".into(),
                ..StepDefinition::sleep("s", 5)
            },
            "steps[1].pool",
        ),
        (
            StepDefinition {
                signal: Some("x".into()),
                ..StepDefinition::sleep("s", 5)
            },
            "steps[1].signal",
        ),
        (
            StepDefinition {
                until: Some("/at".into()),
                ..StepDefinition::sleep("s", 5)
            },
            "steps[1].duration_ms",
        ),
        (StepDefinition::sleep("s", 0), "steps[1].duration_ms"),
        (
            StepDefinition {
                duration_ms: None,
                until: Some("at".into()),
                ..StepDefinition::sleep("s", 5)
            },
            "steps[1].until",
        ),
        (
            StepDefinition::await_signal("w", "", 10, OnTimeout::Fail),
            "steps[1].signal",
        ),
        (
            StepDefinition::await_signal("w", "ok", 0, OnTimeout::Fail),
            "steps[1].timeout_ms",
        ),
        (
            StepDefinition {
                retry: retry(5),
                ..StepDefinition::await_signal("w", "ok", 10, OnTimeout::Fail)
            },
            "steps[1].retry",
        ),
        (
            StepDefinition {
                on_timeout: OnTimeout::Continue,
                ..StepDefinition::task("t", "p", 10)
            },
            "steps[1].on_timeout",
        ),
    ];
    for (step, field) in cases {
        let mut d = def(2, 1);
        d.steps[1] = step.clone();
        let err = d.validate().unwrap_err();
        assert_eq!(err.field, field, "{step:?}: {err}");
    }
    let toml = "name = \"w\"\nversion = 1\n\n[[steps]]\nname = \"nap\"\nkind = \"sleep\"\nduration_ms = 5\n\n\
                [[steps]]\nname = \"ok\"\nkind = \"await_signal\"\nsignal = \"go\"\ntimeout_ms = 9\non_timeout = \"continue\"\n";
    let parsed = crate::infra::workflows::parse_str("w.toml", toml).unwrap();
    assert_eq!(parsed.steps[0], StepDefinition::sleep("nap", 5));
    assert_eq!(
        parsed.steps[1],
        StepDefinition::await_signal("ok", "go", 9, OnTimeout::Continue)
    );
}

#[test]
fn a_purged_run_stays_purged_and_still_refuses_another_start() {
    let wf = registry(2, 3);
    let state = started(&wf);
    let tomb = Purged {
        tenant: state.tenant.clone(),
        start_fingerprint: state.start_fingerprint.clone(),
    };
    let s = stamp(1);
    for input in [
        start_input(),
        result_ok(s, json!("late")),
        timer(TimerKind::Timeout, s),
        timer(TimerKind::Wake, s),
        signal("late"),
        cancel(),
    ] {
        assert_eq!(
            fold_purged(&tomb, &input),
            Decision::NoOp(NoOpReason::RunPurged),
            "{input:?}"
        );
    }
    let Input::Start(mut other) = start_input() else {
        unreachable!()
    };
    other.input = json!({"x": 2});
    let other = Input::Start(other);
    assert_eq!(
        rejection_class(fold_purged(&tomb, &other)),
        RejectionClass::IdempotencyMismatch
    );
    // A run purged before fingerprints were kept: any start is a duplicate.
    let old = Purged {
        start_fingerprint: None,
        ..tomb.clone()
    };
    assert_eq!(
        fold_purged(&old, &other),
        Decision::NoOp(NoOpReason::RunPurged)
    );
    let foreign = Purged {
        tenant: "t2".into(),
        ..tomb
    };
    assert_eq!(
        rejection_class(fold_purged(&foreign, &cancel())),
        RejectionClass::TenantMismatch
    );
}

#[test]
fn a_run_whose_workflow_is_gone_fails_and_abandons_its_attempt() {
    let wf = registry(2, 3);
    let s = started(&wf);
    assert_eq!(fail_missing_workflow(&s, &wf, t(5)), None, "still defined");
    let gone = Workflows::default();
    let tr = fail_missing_workflow(&s, &gone, t(5)).expect("the run fails");
    assert_eq!(tr.record.seq, 2);
    assert_eq!(tr.record.input_ref, MISSING_WORKFLOW_REF);
    assert_eq!(tr.record.input_ref, "maintenance:missing_workflow");
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    assert_eq!(tr.record.from_status, Some(RunStatus::Running));
    assert_eq!(tr.record.to_status, RunStatus::Failed);
    assert_eq!(tr.record.at, t(5));
    let error = "workflow_missing: workflow \"wf\" version 1 is no longer defined";
    assert_eq!(
        tr.record.detail,
        json!({"stamp": stamp(1).to_string(), "cause": WORKFLOW_MISSING, "error": error})
    );
    assert_eq!(tr.state.status, RunStatus::Failed);
    assert_eq!(tr.state.error.as_deref(), Some(error));
    assert_eq!(tr.state.last_transition_seq, 2);
    assert!(tr.state.outstanding.is_none());
    assert_eq!(tr.state.attempts[0].status, AttemptStatus::Cancelled);
    assert_eq!(
        tr.attempt_writes,
        [AttemptWrite::Finish {
            stamp: stamp(1),
            status: AttemptStatus::Cancelled,
            finished_at: t(5),
            error: Some(error.into()),
        }]
    );
    // The lifecycle event alone: nothing is dispatched, no timer set.
    assert_eq!(tr.effects.len(), 1);
    assert_eq!(tr.effects[0].target, EffectTarget::Events);
    assert_eq!(tr.effects[0].payload["kind"], "run.failed");
    assert_eq!(tr.effects[0].payload["status"], "failed");
    assert_eq!(tr.effects[0].payload["seq"], 2);
    // A late result of the abandoned attempt changes nothing, and a run
    // already failed is not failed again.
    assert_eq!(
        fold(
            Some(&tr.state),
            &result_ok(stamp(1), json!(1)),
            &wf,
            STATE_CAP,
            t(6),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::StaleResult)
    );
    assert_eq!(fail_missing_workflow(&tr.state, &gone, t(7)), None);
}

#[test]
fn a_run_whose_workflow_is_gone_while_a_retry_is_pending_drops_the_retry() {
    let wf = registry(1, 3);
    let waiting = apply(&started(&wf), &result_err(stamp(1), true), &wf, 5, 2);
    assert!(waiting.state.pending_retry.is_some());
    let other_version = Workflows::new(vec![WorkflowDefinition {
        version: 2,
        ..def(1, 3)
    }])
    .unwrap();
    let tr = fail_missing_workflow(&waiting.state, &other_version, t(6))
        .expect("version 1 is gone although version 2 is defined");
    assert_eq!(tr.record.seq, 3);
    assert!(tr.state.pending_retry.is_none());
    assert!(tr.attempt_writes.is_empty(), "no attempt was outstanding");
    assert!(tr.record.detail.get("stamp").is_none());
    assert_eq!(tr.record.detail["cause"], WORKFLOW_MISSING);
    assert_eq!(
        fold(
            Some(&tr.state),
            &timer(TimerKind::Retry, stamp(1)),
            &wf,
            STATE_CAP,
            t(300),
            &entropy(3)
        ),
        Decision::NoOp(NoOpReason::DuplicateTimer)
    );
}

#[test]
fn a_run_whose_workflow_is_gone_while_it_waits_ends_its_wait() {
    for middle in [
        StepDefinition::sleep("nap", 500),
        StepDefinition::await_signal("approve", "ok", 1000, OnTimeout::Continue),
    ] {
        let wf = waits(middle);
        let waiting = apply(&started(&wf), &result_ok(stamp(1), json!({})), &wf, 100, 2);
        assert!(waiting.state.waiting.is_some() && waiting.state.outstanding.is_none());
        let tr = fail_missing_workflow(&waiting.state, &Workflows::default(), t(200))
            .expect("the waiting run fails");
        assert_eq!(tr.record.kind, TransitionKind::RunFailed);
        assert_eq!(tr.record.seq, 3);
        assert_eq!(tr.state.status, RunStatus::Failed);
        assert_eq!(tr.state.waiting, None, "the wait is over");
        assert!(tr.attempt_writes.is_empty(), "no attempt was outstanding");
        assert_eq!(tr.effects.len(), 1, "the lifecycle event alone");
        // The wait's wake timer changes nothing; its signal, when it comes,
        // is recorded, as a failed run records every signal, and the run
        // stays failed.
        let fold_at =
            |input: &Input| fold(Some(&tr.state), input, &wf, STATE_CAP, t(1100), &entropy(4));
        assert_eq!(
            fold_at(&timer(TimerKind::Wake, stamp(2))),
            Decision::NoOp(NoOpReason::DuplicateTimer)
        );
        let signalled = transition(fold_at(&named_signal("s", "ok", json!(1))));
        assert_eq!(signalled.record.kind, TransitionKind::RunSignalled);
        assert_eq!(signalled.state.status, RunStatus::Failed);
        assert_eq!(signalled.state.waiting, None);
        assert_eq!(signalled.state.failure_seq(), Some(3));
    }
}

#[test]
fn the_versions_missing_are_those_running_runs_need_and_none_defines() {
    use super::versions::{VersionInUse, missing};
    let wf = Workflows::new(vec![
        def(1, 1),
        WorkflowDefinition {
            version: 3,
            ..def(1, 1)
        },
    ])
    .unwrap();
    let v = |workflow: &str, version, running| VersionInUse {
        workflow: workflow.into(),
        version,
        running,
    };
    let in_use = [
        v("other", 1, 4),
        v("wf", 1, 2),
        v("wf", 2, 7),
        v("wf", 3, 1),
        v("wf", 4, 0),
    ];
    assert_eq!(missing(&in_use, &wf), [&in_use[0], &in_use[2]]);
    assert!(missing(&in_use[1..2], &wf).is_empty());
}
