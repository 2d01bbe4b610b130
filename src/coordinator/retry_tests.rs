//! Unit tests of a failed run's afterlife: its retry from the step it
//! failed in, the signals and the cancel it takes while failed.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use uuid::Uuid;

use super::fold::*;
use super::*;
use crate::contract::*;

const STATE_CAP: usize = 1 << 20;

fn t(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap()
}

fn entropy(n: u128) -> Entropy {
    Entropy {
        stamp: Uuid::from_u128(n),
        jitter_unit: 0.5,
    }
}

/// Two tasks of at most two attempts, the second after a wait for `ok`.
fn workflows() -> Workflows {
    let task = |name: &str| StepDefinition {
        retry: RetryPolicy {
            max_attempts: 2,
            initial_backoff_ms: 100,
            max_backoff_ms: 1000,
            multiplier: 2.0,
            jitter: 0.0,
        },
        ..StepDefinition::task(name, "pool", 1000)
    };
    Workflows::new(vec![WorkflowDefinition {
        name: "wf".into(),
        version: 1,
        steps: vec![
            task("charge"),
            StepDefinition::await_signal("approve", "ok", 1000, OnTimeout::Fail),
            task("ship"),
        ],
        output_topic: None,
        output: None,
    }])
    .unwrap()
}

fn start() -> Input {
    Input::Start(RunStart {
        run_id: "r1".into(),
        tenant: "t1".into(),
        workflow: "wf".into(),
        workflow_version: None,
        pool: "default".into(),
        input: json!({"order": 1}),
        correlation_id: None,
        parent: None,
    })
}

fn answer(stamp: Uuid, outcome: AttemptOutcome) -> Input {
    Input::Result(AttemptResult {
        run_id: "r1".into(),
        tenant: "t1".into(),
        stamp,
        outcome,
    })
}

fn declined() -> AttemptOutcome {
    AttemptOutcome::Failed {
        message: "card declined".into(),
        retryable: false,
    }
}

fn retry(action_id: &str, failed_seq: i64) -> Input {
    Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: action_id.into(),
        failed_seq,
        reason: Some("the card was replaced".into()),
    })
}

fn signal(id: &str, name: &str) -> Input {
    Input::Signal(SignalWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        signal_id: id.into(),
        name: name.into(),
        payload: json!({"by": id}),
    })
}

fn cancel(action_id: &str) -> Input {
    Input::Cancel(CancelWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        reason: None,
        action_id: Some(action_id.into()),
    })
}

fn fold_at(state: &RunState, input: &Input, now: i64, e: u128) -> Decision {
    fold(
        Some(state),
        input,
        &workflows(),
        STATE_CAP,
        t(now),
        &entropy(e),
    )
}

fn transition(d: Decision) -> Transition {
    match d {
        Decision::Transition(t) => *t,
        other => panic!("expected a transition, got {other:?}"),
    }
}

/// A run whose first step was declined: failed by its transition 2.
fn failed() -> RunState {
    let wf = workflows();
    let s = transition(fold(None, &start(), &wf, STATE_CAP, t(0), &entropy(1))).state;
    let tr = transition(fold_at(&s, &answer(Uuid::from_u128(1), declined()), 10, 2));
    assert_eq!(tr.record.kind, TransitionKind::RunFailed);
    tr.state
}

#[test]
fn a_retry_dispatches_the_failed_step_again_with_a_fresh_attempt_and_stamp() {
    let s = failed();
    assert_eq!(s.failure_seq(), Some(2));
    let tr = transition(fold_at(&s, &retry("a1", 2), 50, 7));
    assert_eq!(tr.record.kind, TransitionKind::RunRetried);
    assert_eq!(tr.record.input_ref, "retry:a1");
    assert_eq!(
        (tr.record.from_status, tr.record.to_status),
        (Some(RunStatus::Failed), RunStatus::Running)
    );
    assert_eq!(tr.record.detail["action_id"], json!("a1"));
    assert_eq!(tr.record.detail["retried_step"], json!(0));
    assert_eq!(
        tr.record.detail["previous_error"],
        json!(s.error.clone().unwrap())
    );
    assert_eq!(tr.state.error, None);
    assert_eq!(tr.state.failed_seq, None);
    // Attempt 2 of step 0, under the fresh stamp, past `max_attempts` of 2
    // counted from 1: the operator asked for it.
    let outstanding = tr.state.outstanding.clone().unwrap();
    assert_eq!(
        (
            outstanding.stamp,
            outstanding.step_index,
            outstanding.attempt
        ),
        (Uuid::from_u128(7), 0, 2)
    );
    let dispatch = &tr.effects[1];
    assert_eq!(dispatch.payload["type"], json!("step.dispatch"));
    assert_eq!(dispatch.payload["attempt"], json!(2));
    assert_eq!(dispatch.payload["input"], json!({"order": 1}));
    assert_eq!(tr.effects[0].payload["kind"], json!("run.retried"));
    assert!(matches!(
        &tr.attempt_writes[..],
        [AttemptWrite::Insert(a)] if a.attempt == 2 && a.stamp == Uuid::from_u128(7)
    ));
    // The declined attempt stays declined: its answer again is a duplicate.
    assert_eq!(
        fold_at(&tr.state, &answer(Uuid::from_u128(1), declined()), 60, 8),
        Decision::NoOp(NoOpReason::DuplicateResult)
    );
    // The retried attempt's success moves the run on.
    let ok = AttemptOutcome::Succeeded {
        output: json!({"charged": true}),
    };
    let next = transition(fold_at(&tr.state, &answer(Uuid::from_u128(7), ok), 70, 9));
    assert_eq!(next.state.status, RunStatus::Running);
    assert_eq!(next.state.step_index, 1);
}

#[test]
fn each_action_id_and_each_failure_is_retried_once() {
    let s = failed();
    let retried = transition(fold_at(&s, &retry("a1", 2), 50, 7)).state;
    // The same retry again, and another one for the same failure.
    assert_eq!(
        fold_at(&retried, &retry("a1", 2), 51, 8),
        Decision::NoOp(NoOpReason::DuplicateRetry)
    );
    assert_eq!(
        fold_at(&retried, &retry("a2", 2), 51, 8),
        Decision::NoOp(NoOpReason::RunNotFailed)
    );
    // It fails again, by its transition 4: only a retry naming that one
    // applies, and never one whose id the run applied.
    let again = transition(fold_at(
        &retried,
        &answer(Uuid::from_u128(7), declined()),
        60,
        9,
    ));
    assert_eq!(again.record.seq, 4);
    assert_eq!(again.state.failure_seq(), Some(4));
    assert_eq!(
        fold_at(&again.state, &retry("a2", 2), 70, 10),
        Decision::NoOp(NoOpReason::StaleRetry)
    );
    assert_eq!(
        fold_at(&again.state, &retry("a1", 4), 70, 10),
        Decision::NoOp(NoOpReason::DuplicateRetry)
    );
    let third = transition(fold_at(&again.state, &retry("a2", 4), 70, 10));
    assert_eq!(third.state.attempt, 3);
    assert_eq!(third.state.retries.len(), 2);
}

#[test]
fn only_a_failed_run_is_retried() {
    let wf = workflows();
    let running = transition(fold(None, &start(), &wf, STATE_CAP, t(0), &entropy(1))).state;
    assert_eq!(
        fold_at(&running, &retry("a1", 1), 5, 2),
        Decision::NoOp(NoOpReason::RunNotFailed)
    );
    let cancelled = transition(fold_at(&running, &cancel("c1"), 5, 2));
    assert_eq!(cancelled.record.detail["action_id"], json!("c1"));
    assert_eq!(
        fold_at(&cancelled.state, &retry("a1", 1), 6, 3),
        Decision::NoOp(NoOpReason::RunNotFailed)
    );
}

#[test]
fn a_failed_run_is_cancelled_for_good() {
    let s = failed();
    let tr = transition(fold_at(&s, &cancel("c1"), 20, 3));
    assert_eq!(
        (tr.record.from_status, tr.record.to_status),
        (Some(RunStatus::Failed), RunStatus::Cancelled)
    );
    assert_eq!(tr.state.failed_seq, None);
    assert_eq!(
        fold_at(&tr.state, &retry("a1", 2), 30, 4),
        Decision::NoOp(NoOpReason::RunNotFailed)
    );
    assert_eq!(
        fold_at(&tr.state, &cancel("c2"), 30, 4),
        Decision::NoOp(NoOpReason::RunTerminal)
    );
}

#[test]
fn a_failed_run_keeps_the_signal_its_retried_wait_consumes() {
    // The wait for `ok` times out and fails the run.
    let s = failed();
    let charged = transition(fold_at(&s, &retry("a1", 2), 20, 7)).state;
    let ok = AttemptOutcome::Succeeded {
        output: json!({"charged": true}),
    };
    let waiting = transition(fold_at(&charged, &answer(Uuid::from_u128(7), ok), 30, 8)).state;
    let wait = waiting.waiting.clone().unwrap();
    let wake = Input::Timer(TimerWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        timer: TimerKind::Wake,
        stamp: wait.stamp,
    });
    let timed_out = transition(fold_at(&waiting, &wake, 2000, 9));
    assert_eq!(timed_out.state.status, RunStatus::Failed);
    assert_eq!(timed_out.state.step_index, 1);
    let failed_seq = timed_out.record.seq;
    // The signal comes late: the failed run records it, and keeps it for
    // the step it failed in, still failed by the same transition.
    let signalled = transition(fold_at(&timed_out.state, &signal("s1", "ok"), 2100, 10));
    assert_eq!(signalled.record.kind, TransitionKind::RunSignalled);
    assert_eq!(signalled.state.status, RunStatus::Failed);
    assert_eq!(signalled.state.failure_seq(), Some(failed_seq));
    assert!(signalled.state.signals[0].kept);
    // The retry starts the wait again, which takes the kept signal at once
    // and dispatches the last step.
    let tr = transition(fold_at(
        &signalled.state,
        &retry("a2", failed_seq),
        2200,
        11,
    ));
    assert_eq!(tr.record.kind, TransitionKind::RunRetried);
    assert_eq!(tr.state.step_index, 2);
    assert_eq!(tr.state.signals[0].consumed_by, Some(1));
    let dispatch: Vec<&Value> = tr.effects.iter().map(|e| &e.payload["type"]).collect();
    assert!(dispatch.contains(&&json!("step.dispatch")), "{dispatch:?}");
    // The same signal again is a duplicate, not a new one.
    assert_eq!(
        fold_at(&tr.state, &signal("s1", "ok"), 2300, 12),
        Decision::NoOp(NoOpReason::DuplicateSignal)
    );
}

#[test]
fn a_retry_that_would_outgrow_the_state_is_refused_and_the_run_stays_failed() {
    let s = failed();
    let size = serde_json::to_string(&s).unwrap().len();
    let d = fold(
        Some(&s),
        &retry("a1", 2),
        &workflows(),
        size,
        t(20),
        &entropy(3),
    );
    match d {
        Decision::Rejection(r) => assert_eq!(r.class, RejectionClass::StateTooLarge),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn a_run_applies_at_most_its_bound_of_retries() {
    let mut s = failed();
    for n in 0..MAX_RETRIES_PER_RUN {
        let seq = s.failure_seq().unwrap();
        let e = 100 + n as u128;
        s = transition(fold_at(&s, &retry(&format!("a{n}"), seq), 20, e)).state;
        let stamp = s.outstanding.as_ref().unwrap().stamp;
        s = transition(fold_at(&s, &answer(stamp, declined()), 30, e + 1000)).state;
    }
    let seq = s.failure_seq().unwrap();
    match fold_at(&s, &retry("one-more", seq), 40, 5000) {
        Decision::Rejection(r) => assert_eq!(r.class, RejectionClass::TooManyRetries),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn a_retry_decodes_with_its_action_id_and_failure_and_nothing_less() {
    let decode = |v: Value| decode_value(InputTopic::Wakeups, &v);
    let good = json!({"type": "wakeup.retry", "schema_version": 1, "run_id": "r1", "tenant": "t1",
                      "action_id": "a1", "failed_seq": 2});
    assert_eq!(decode(good.clone()), Ok(retry_without_reason()));
    assert_eq!(retry("a1", 2).dedup_ref(), "retry:a1");
    for (field, bad) in [
        ("action_id", json!(null)),
        ("action_id", json!("has space")),
        ("failed_seq", json!(0)),
        ("failed_seq", json!("2")),
        ("failed_seq", json!(null)),
    ] {
        let mut v = good.clone();
        v[field] = bad.clone();
        let e = decode(v).unwrap_err();
        assert_eq!(e.class, InputErrorClass::Invalid, "{field}: {bad}");
        assert!(e.message.starts_with(field), "{}", e.message);
    }
    assert_eq!(
        decode_value(InputTopic::Requests, &good).unwrap_err().class,
        InputErrorClass::WrongTopic
    );
}

fn retry_without_reason() -> Input {
    Input::Retry(RetryWakeup {
        run_id: "r1".into(),
        tenant: "t1".into(),
        action_id: "a1".into(),
        failed_seq: 2,
        reason: None,
    })
}
