//! The inputs' wire form as types: what [`Input::to_json`] writes and what
//! the published JSON Schemas (`schemas/messages/`) describe.
//!
//! In: an [`Input`]. Out: its canonical JSON value; the schema of each
//! input type ([`super::super::schema`] collects them). Guarantees: every
//! field's bound is the decoder's constant (see [`crate::contract::formats`]);
//! `decode_value(input.topic(), &input.to_json()) == Ok(input)`; the JSON
//! is valid against its type's schema. Unknown extra fields are allowed by
//! the schemas, as the decoder tolerates them.

use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use super::{
    AttemptOutcome, Input, MAX_CORRELATION_ID_LEN, MAX_ERROR_MESSAGE_LEN, MAX_IDEMPOTENCY_KEY_LEN,
    MAX_REASON_LEN, MAX_SIGNAL_FIELD_LEN, RunStart, SCHEMA_VERSION, TimerKind,
};
use crate::contract::formats::{AnyValue, Id, Name, Text, Version};

/// `run.start`, on the requests topic: create a run. With `run_id`, that
/// run (a client-chosen id); without, a routed start: the routing plane
/// decides its run once per `idempotency_key` (absent: the message's
/// Kafka position; empty: no deduplication). Not both.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "run.start")]
pub struct RunStartForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    /// The run to create; absent or `null`: a routed start.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Id>")]
    pub run_id: Option<&'a str>,
    /// A routed start's key: the same key and request get the same
    /// decision. Only without `run_id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Text<0, MAX_IDEMPOTENCY_KEY_LEN>>")]
    pub idempotency_key: Option<&'a str>,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    #[schemars(with = "Name")]
    pub workflow: &'a str,
    /// Absent or `null`: the latest version when the start is folded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workflow_version: Option<u32>,
    /// The routing pool; absent or `null`: `default`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Name>")]
    pub pool: Option<&'a str>,
    /// The run's input, given to its first step; absent: `null`.
    #[serde(default)]
    #[schemars(with = "AnyValue")]
    pub input: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Text<0, MAX_CORRELATION_ID_LEN>>")]
    pub correlation_id: Option<&'a str>,
    /// Set by Ductor alone, on the start of a `child` step's run: the
    /// parent's run and the step attempt's stamp, which the child's outcome
    /// answers. Such a start carries serve's own signature where
    /// `signatures.timer_key` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentForm<'a>>,
}

/// A child run's parent: the run and the stamp of the attempt it answers.
#[derive(Serialize, JsonSchema)]
pub struct ParentForm<'a> {
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    pub stamp: Uuid,
}

/// `attempt.result`, on the attempt-results topic: a worker's answer for
/// one attempt, fenced by the attempt's `stamp`.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "attempt.result")]
pub struct AttemptResultForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    /// The dispatch's `stamp`.
    pub stamp: Uuid,
    #[serde(flatten)]
    pub outcome: OutcomeForm<'a>,
}

/// How the attempt ended.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum OutcomeForm<'a> {
    /// The step's output: the next step's input, or the run's output.
    Succeeded {
        #[serde(default)]
        #[schemars(with = "AnyValue")]
        output: &'a Value,
    },
    /// The attempt failed; `retryable` lets the step's retry policy decide.
    Failed { error: ErrorForm<'a> },
}

/// A failed attempt's error.
#[derive(Serialize, JsonSchema)]
pub struct ErrorForm<'a> {
    #[schemars(with = "Text<0, MAX_ERROR_MESSAGE_LEN>")]
    pub message: &'a str,
    pub retryable: bool,
}

/// `wakeup.timer`, on the wakeups topic: a durable timer fired. Ductor
/// publishes these itself, signed with its timer key.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "wakeup.timer")]
pub struct TimerWakeupForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    pub timer: TimerName,
    /// The stamp of the attempt the timer belongs to.
    pub stamp: Uuid,
}

/// Which timer fired.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TimerName {
    /// A failed attempt's retry is due.
    Retry,
    /// An attempt's deadline passed.
    Timeout,
    /// A `sleep` step ended, or an `await_signal` step timed out.
    Wake,
}

/// `wakeup.signal`, on the wakeups topic: an external signal, deduplicated
/// by its producer-chosen `signal_id`.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "wakeup.signal")]
pub struct SignalWakeupForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    #[schemars(with = "Text<1, MAX_SIGNAL_FIELD_LEN>")]
    pub signal_id: &'a str,
    #[schemars(with = "Text<1, MAX_SIGNAL_FIELD_LEN>")]
    pub name: &'a str,
    #[serde(default)]
    #[schemars(with = "AnyValue")]
    pub payload: &'a Value,
}

/// `wakeup.cancel`, on the wakeups topic: stop the run.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "wakeup.cancel")]
pub struct CancelWakeupForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Text<0, MAX_REASON_LEN>>")]
    pub reason: Option<&'a str>,
    /// The caller's name for this cancel, kept in the transition's detail.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Id>")]
    pub action_id: Option<&'a str>,
}

/// `wakeup.retry`, on the wakeups topic: start a failed run again from the
/// step it failed in, once per `action_id`.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename = "wakeup.retry")]
pub struct RetryWakeupForm<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    /// The retry's idempotency key: a run applies each one once.
    #[schemars(with = "Id")]
    pub action_id: &'a str,
    /// The failure it retries: the seq of the run's `run.failed`
    /// transition (the `seq` of its `run.event`).
    #[schemars(range(min = 1))]
    pub failed_seq: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Text<0, MAX_REASON_LEN>>")]
    pub reason: Option<&'a str>,
}

impl From<TimerKind> for TimerName {
    fn from(kind: TimerKind) -> Self {
        match kind {
            TimerKind::Retry => TimerName::Retry,
            TimerKind::Timeout => TimerName::Timeout,
            TimerKind::Wake => TimerName::Wake,
        }
    }
}

impl<'a> RunStartForm<'a> {
    /// The form of `start`, naming its run.
    fn of(start: &'a RunStart) -> Self {
        RunStartForm {
            schema_version: SCHEMA_VERSION,
            run_id: Some(&start.run_id),
            idempotency_key: None,
            tenant: &start.tenant,
            workflow: &start.workflow,
            workflow_version: start.workflow_version,
            pool: Some(&start.pool),
            input: &start.input,
            correlation_id: start.correlation_id.as_deref(),
            parent: start.parent.as_ref().map(|p| ParentForm {
                run_id: &p.run_id,
                stamp: p.stamp,
            }),
        }
    }
}

impl RunStart {
    /// The routed form of this start: no run id (the routing plane
    /// decides it), the idempotency key `key`.
    pub fn to_routed_json(&self, key: &str) -> Value {
        let form = RunStartForm {
            run_id: None,
            idempotency_key: Some(key),
            ..RunStartForm::of(self)
        };
        serde_json::to_value(form).unwrap_or(Value::Null)
    }
}

impl Input {
    /// The canonical wire form; `decode_value(self.topic(), &self.to_json()) == Ok(self)`.
    pub fn to_json(&self) -> Value {
        let (run_id, tenant) = (self.run_id(), self.tenant());
        let schema_version = SCHEMA_VERSION;
        let value = match self {
            Input::Start(s) => serde_json::to_value(RunStartForm::of(s)),
            Input::Result(r) => serde_json::to_value(AttemptResultForm {
                schema_version,
                run_id,
                tenant,
                stamp: r.stamp,
                outcome: match &r.outcome {
                    AttemptOutcome::Succeeded { output } => OutcomeForm::Succeeded { output },
                    AttemptOutcome::Failed { message, retryable } => OutcomeForm::Failed {
                        error: ErrorForm {
                            message,
                            retryable: *retryable,
                        },
                    },
                },
            }),
            Input::Timer(t) => serde_json::to_value(TimerWakeupForm {
                schema_version,
                run_id,
                tenant,
                timer: t.timer.into(),
                stamp: t.stamp,
            }),
            Input::Signal(s) => serde_json::to_value(SignalWakeupForm {
                schema_version,
                run_id,
                tenant,
                signal_id: &s.signal_id,
                name: &s.name,
                payload: &s.payload,
            }),
            Input::Cancel(c) => serde_json::to_value(CancelWakeupForm {
                schema_version,
                run_id,
                tenant,
                reason: c.reason.as_deref(),
                action_id: c.action_id.as_deref(),
            }),
            Input::Retry(r) => serde_json::to_value(RetryWakeupForm {
                schema_version,
                run_id,
                tenant,
                action_id: &r.action_id,
                failed_seq: r.failed_seq,
                reason: r.reason.as_deref(),
            }),
        };
        // The forms hold only strings, numbers, booleans and JSON values:
        // encoding them cannot fail.
        value.unwrap_or(Value::Null)
    }
}
