//! The input message contract: the typed inputs that arrive on `requests`,
//! `wakeups` and `attempt-results`, and the bounds each of them keeps.
//!
//! In: the bytes of one message and the topic it was read from. Out: a typed
//! [`Input`], or an [`InputError`] whose class goes into the dead letter's
//! headers. Guarantees: decoding is pure over a byte buffer and never panics;
//! known fields are strictly typed, unknown extra fields are tolerated so
//! producers can add fields before consumers know them, and optional fields
//! may be absent or `null`; error messages are bounded and never echo payloads.
//!
//! Here: the inputs, their limits and their errors. Reading and writing the
//! wire form is in `wire`; the size budget of what an input carries into
//! effects ([`bound_payload`]) in `budget`.

use serde_json::Value;
use uuid::Uuid;

use super::screen::{ShapeLimits, Violation};

mod budget;
pub mod form;
mod wire;

pub(crate) use budget::encoded_len;
pub use budget::{bound_payload, bound_start};
pub use wire::{decode_input, decode_value, parse_value};

/// The only schema version this coordinator understands.
pub const SCHEMA_VERSION: u64 = 1;
/// Longest `run_id` / `tenant`.
pub const MAX_ID_LEN: usize = 128;
/// Longest `correlation_id`.
pub const MAX_CORRELATION_ID_LEN: usize = 256;
/// Longest `idempotency_key` of a routed start, in characters.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 256;
/// Longest error message of a failed attempt.
pub const MAX_ERROR_MESSAGE_LEN: usize = 4096;
/// Longest `signal_id` / signal `name`.
pub const MAX_SIGNAL_FIELD_LEN: usize = 128;
/// Longest cancel `reason`.
pub const MAX_REASON_LEN: usize = 1024;
/// Longest [`InputError::message`].
pub const MAX_INPUT_ERROR_LEN: usize = 512;

/// The pool a run belongs to when its start request names none.
pub const DEFAULT_POOL: &str = "default";

/// Which input topic a message was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputTopic {
    Requests,
    Wakeups,
    AttemptResults,
}

impl InputTopic {
    /// Which input topic `topic` is, given the three configured names.
    pub fn classify(topic: &str, requests: &str, wakeups: &str, results: &str) -> Option<Self> {
        if topic == requests {
            Some(InputTopic::Requests)
        } else if topic == wakeups {
            Some(InputTopic::Wakeups)
        } else if topic == results {
            Some(InputTopic::AttemptResults)
        } else {
            None
        }
    }

    /// The default topic suffix: `requests`, `wakeups`, `attempt-results`.
    pub fn as_str(self) -> &'static str {
        match self {
            InputTopic::Requests => "requests",
            InputTopic::Wakeups => "wakeups",
            InputTopic::AttemptResults => "attempt-results",
        }
    }
}

/// A decoded, validated input.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Start(RunStart),
    Result(AttemptResult),
    Timer(TimerWakeup),
    Signal(SignalWakeup),
    Cancel(CancelWakeup),
    Retry(RetryWakeup),
}

/// `run.start`: create a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStart {
    pub run_id: String,
    pub tenant: String,
    pub workflow: String,
    /// `None`: the latest version at the time the start is folded.
    pub workflow_version: Option<u32>,
    /// Routing pool owning the run ([`DEFAULT_POOL`] when absent on the wire).
    pub pool: String,
    pub input: Value,
    pub correlation_id: Option<String>,
    /// The run and attempt of a `child` step that started this run: its
    /// outcome goes back to that attempt as an `attempt.result`.
    /// Boxed: most starts have none.
    pub parent: Option<Box<ParentRef>>,
}

/// The attempt of a `child` step that a child run answers: the parent's
/// run and the attempt's stamp. A routed start with a parent is decided
/// as the run named by the stamp, so that the parent knows its child's id
/// without asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentRef {
    pub run_id: String,
    pub stamp: Uuid,
}

/// `attempt.result`: a worker's answer for one attempt, fenced by its stamp.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptResult {
    pub run_id: String,
    pub tenant: String,
    pub stamp: Uuid,
    pub outcome: AttemptOutcome,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AttemptOutcome {
    Succeeded { output: Value },
    Failed { message: String, retryable: bool },
}

/// `wakeup.timer`: a durable timer fired.
#[derive(Debug, Clone, PartialEq)]
pub struct TimerWakeup {
    pub run_id: String,
    pub tenant: String,
    pub timer: TimerKind,
    /// Timeout: the attempt's stamp. Retry: the stamp of the failed attempt.
    pub stamp: Uuid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimerKind {
    Retry,
    Timeout,
    /// The end of a `sleep` step, or the timeout of an `await_signal` one.
    Wake,
}

impl TimerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TimerKind::Retry => "retry",
            TimerKind::Timeout => "timeout",
            TimerKind::Wake => "wake",
        }
    }
}

/// `wakeup.signal`: an external signal with a producer-chosen id.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalWakeup {
    pub run_id: String,
    pub tenant: String,
    pub signal_id: String,
    pub name: String,
    pub payload: Value,
}

/// `wakeup.cancel`: stop the run.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelWakeup {
    pub run_id: String,
    pub tenant: String,
    pub reason: Option<String>,
    /// The caller's name for this cancel ([`is_id`]), kept in the detail of
    /// the transition it makes. A run is cancelled once, so any second
    /// cancel, under this id or another, changes nothing.
    pub action_id: Option<String>,
}

/// `wakeup.retry`: start a failed run again from the step it failed in,
/// with a fresh attempt. A run applies each `action_id` once: the same
/// retry delivered again, even after the run failed anew, changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryWakeup {
    pub run_id: String,
    pub tenant: String,
    /// The caller's name for this retry ([`is_id`]): the idempotency key.
    pub action_id: String,
    /// The failure it retries: the seq of the `run.failed` transition (its
    /// `run.event`'s `seq`). A retry naming another changes nothing, so
    /// that one delivered again after the run failed anew cannot retry
    /// that new failure.
    pub failed_seq: i64,
    pub reason: Option<String>,
}

/// Why an input could not be decoded; the class goes into DLQ headers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", class.as_str())]
pub struct InputError {
    pub class: InputErrorClass,
    /// Bounded to [`MAX_INPUT_ERROR_LEN`] characters; names the field, never echoes payloads.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputErrorClass {
    TooLarge,
    Malformed,
    /// Valid JSON that cannot be kept as sent (see [`super::screen`]).
    Refused(Violation),
    /// A value that, written back, would not fit the effect that carries
    /// it (the size budget).
    PayloadTooLarge,
    UnknownType,
    UnsupportedVersion,
    Invalid,
    WrongTopic,
    /// Unsigned or mis-signed where signatures are required.
    Unauthenticated,
    /// On a partition its run does not belong on, and forwarded as often
    /// as `coordinator.max_input_forwards` allows.
    Misrouted,
}

impl InputErrorClass {
    /// Every class, the screen's violations included: the dead-letter
    /// counter starts each of them at zero.
    pub fn all() -> impl Iterator<Item = InputErrorClass> {
        // Exhaustive on purpose: a new class does not compile until it is
        // listed below too.
        let _listed = |class: InputErrorClass| match class {
            InputErrorClass::TooLarge
            | InputErrorClass::Malformed
            | InputErrorClass::Refused(_)
            | InputErrorClass::PayloadTooLarge
            | InputErrorClass::UnknownType
            | InputErrorClass::UnsupportedVersion
            | InputErrorClass::Invalid
            | InputErrorClass::WrongTopic
            | InputErrorClass::Unauthenticated
            | InputErrorClass::Misrouted => (),
        };
        [
            InputErrorClass::TooLarge,
            InputErrorClass::Malformed,
            InputErrorClass::PayloadTooLarge,
            InputErrorClass::UnknownType,
            InputErrorClass::UnsupportedVersion,
            InputErrorClass::Invalid,
            InputErrorClass::WrongTopic,
            InputErrorClass::Unauthenticated,
            InputErrorClass::Misrouted,
        ]
        .into_iter()
        .chain(Violation::ALL.map(InputErrorClass::Refused))
    }

    /// Stable snake_case name for DLQ headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            InputErrorClass::TooLarge => "too_large",
            InputErrorClass::Malformed => "malformed",
            InputErrorClass::Refused(violation) => violation.as_str(),
            InputErrorClass::PayloadTooLarge => "payload_too_large",
            InputErrorClass::UnknownType => "unknown_type",
            InputErrorClass::UnsupportedVersion => "unsupported_version",
            InputErrorClass::Invalid => "invalid",
            InputErrorClass::WrongTopic => "wrong_topic",
            InputErrorClass::Unauthenticated => "unauthenticated",
            InputErrorClass::Misrouted => "misrouted",
        }
    }
}

impl InputError {
    pub fn new(class: InputErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: truncate(message.into(), MAX_INPUT_ERROR_LEN),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new(InputErrorClass::Invalid, message)
    }
}

/// Cuts `s` to at most `max` characters.
pub(crate) fn truncate(mut s: String, max: usize) -> String {
    if let Some((idx, _)) = s.char_indices().nth(max) {
        s.truncate(idx);
    }
    s
}

/// Where an input came from: its Kafka position, kept on its transition row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// The `input_ref` of the transition that fails a run whose workflow
/// version is no longer defined (`coordinator.fail_runs_of_missing_workflows`).
/// `serve` makes it at start, from no message: of a run's transitions after
/// its start, it is the only one that records no source.
pub const MISSING_WORKFLOW_REF: &str = "maintenance:missing_workflow";

/// The bounds every input keeps: its size (`coordinator.max_input_bytes`)
/// and its shape (`coordinator.max_json_depth` and the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLimits {
    pub max_bytes: usize,
    pub shape: ShapeLimits,
    /// Largest value an effect can carry once Ductor writes it back (a
    /// run's input in its first dispatch, a step's output in the next one
    /// and in the run's output): `kafka.message_max_bytes` less the room
    /// for the envelope. See [`bound_payload`].
    pub max_payload_bytes: usize,
}

impl InputLimits {
    /// At most `max_bytes`, with the default shape limits.
    pub fn sized(max_bytes: usize) -> InputLimits {
        InputLimits {
            max_bytes,
            shape: ShapeLimits::default(),
            max_payload_bytes: max_bytes,
        }
    }
}

/// `[A-Za-z0-9_.:-]{1,128}`: the charset of `run_id` and `tenant`.
pub fn is_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

impl Input {
    pub fn run_id(&self) -> &str {
        match self {
            Input::Start(x) => &x.run_id,
            Input::Result(x) => &x.run_id,
            Input::Timer(x) => &x.run_id,
            Input::Signal(x) => &x.run_id,
            Input::Cancel(x) => &x.run_id,
            Input::Retry(x) => &x.run_id,
        }
    }

    pub fn tenant(&self) -> &str {
        match self {
            Input::Start(x) => &x.tenant,
            Input::Result(x) => &x.tenant,
            Input::Timer(x) => &x.tenant,
            Input::Signal(x) => &x.tenant,
            Input::Cancel(x) => &x.tenant,
            Input::Retry(x) => &x.tenant,
        }
    }

    /// The topic this input belongs on.
    pub fn topic(&self) -> InputTopic {
        match self {
            Input::Start(_) => InputTopic::Requests,
            Input::Result(_) => InputTopic::AttemptResults,
            _ => InputTopic::Wakeups,
        }
    }

    /// Names the input within its run, for the transition record:
    /// `start`, `result:<stamp>`, `timer:<retry|timeout>:<stamp>`, `signal:<signal_id>`, `cancel`,
    /// `retry:<action_id>`
    /// (and, from no input, [`MISSING_WORKFLOW_REF`]).
    pub fn dedup_ref(&self) -> String {
        match self {
            Input::Start(_) => "start".to_owned(),
            Input::Result(r) => format!("result:{}", r.stamp),
            Input::Timer(t) => format!("timer:{}:{}", t.timer.as_str(), t.stamp),
            Input::Signal(s) => format!("signal:{}", s.signal_id),
            Input::Cancel(_) => "cancel".to_owned(),
            Input::Retry(r) => format!("retry:{}", r.action_id),
        }
    }
}
