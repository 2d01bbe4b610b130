//! The input message contract: decoding and encoding the JSON values that arrive on
//! `requests`, `wakeups` and `attempt-results`.
//!
//! Decoding is pure over a byte buffer. Known fields are strictly typed; unknown
//! extra fields are tolerated so producers can add fields before consumers know them.
//! Optional fields may be absent or `null`. Error messages are bounded and never echo
//! payloads.

use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::names::{MAX_NAME_LEN, is_name};
use super::screen::{ShapeLimits, Violation, screen};

/// The only schema version this coordinator understands.
pub const SCHEMA_VERSION: u64 = 1;
/// Longest `run_id` / `tenant`.
pub const MAX_ID_LEN: usize = 128;
/// Longest `correlation_id`.
pub const MAX_CORRELATION_ID_LEN: usize = 256;
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
}

impl InputErrorClass {
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

const TYPE_RUN_START: &str = "run.start";
const TYPE_ATTEMPT_RESULT: &str = "attempt.result";
const TYPE_WAKEUP_TIMER: &str = "wakeup.timer";
const TYPE_WAKEUP_SIGNAL: &str = "wakeup.signal";
const TYPE_WAKEUP_CANCEL: &str = "wakeup.cancel";

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

/// How much longer a value can get when it is written back than it was
/// sent: only numbers grow (`9e15` is written `9000000000000000.0`), by at
/// most this factor. A value sent shorter than the payload limit divided by
/// it cannot outgrow the limit, and is not measured.
const MAX_REENCODING_GROWTH: usize = 5;

/// Applies the size budget to what an input carries into effects, so
/// that no effect is committed that could never be published. `sent` is
/// the length of the message. A start whose input, or a signal whose
/// payload, would be too large is refused (`payload_too_large`); a step
/// output that would be too large becomes a failure of the attempt, for
/// good, that says so: the step fails instead of its run stalling behind
/// an effect nobody can publish. Pure: the checker applies it as the
/// ingress does.
pub fn bound_payload(input: Input, sent: usize, limits: &InputLimits) -> Result<Input, InputError> {
    let max = limits.max_payload_bytes;
    if sent.saturating_mul(MAX_REENCODING_GROWTH) <= max {
        return Ok(input);
    }
    let too_large = |what: &str, len: usize| {
        format!("{what} is {len} bytes once written back, over the limit of {max}")
    };
    match input {
        Input::Start(ref start) => bound_start(start, sent, limits).map(|()| input),
        Input::Signal(ref signal) if encoded_len(&signal.payload) > max => Err(InputError::new(
            InputErrorClass::PayloadTooLarge,
            too_large("payload", encoded_len(&signal.payload)),
        )),
        Input::Result(mut result) => {
            if let AttemptOutcome::Succeeded { output } = &result.outcome {
                let len = encoded_len(output);
                if len > max {
                    result.outcome = AttemptOutcome::Failed {
                        message: format!(
                            "payload_too_large: the step's output is {len} bytes once written \
                             back, over the limit of {max}"
                        ),
                        retryable: false,
                    };
                }
            }
            Ok(Input::Result(result))
        }
        other => Ok(other),
    }
}

/// [`bound_payload`] for a start: `Err` when its input would not fit the
/// dispatch that carries it.
pub fn bound_start(start: &RunStart, sent: usize, limits: &InputLimits) -> Result<(), InputError> {
    let max = limits.max_payload_bytes;
    if sent.saturating_mul(MAX_REENCODING_GROWTH) <= max {
        return Ok(());
    }
    let len = encoded_len(&start.input);
    if len > max {
        return Err(InputError::new(
            InputErrorClass::PayloadTooLarge,
            format!("input is {len} bytes once written back, over the limit of {max}"),
        ));
    }
    Ok(())
}

/// The length of `value` as `serde_json` writes it, without writing it.
pub(crate) fn encoded_len<T: serde::Serialize + ?Sized>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value, or a run state, to a sink that never fails cannot
    // fail: neither has a map with keys that are not strings.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Parses one message's bytes into JSON: within the size limit, UTF-8, past
/// the shape screen, and well-formed, in that order. Never panics.
pub fn parse_value(bytes: &[u8], limits: &InputLimits) -> Result<Value, InputError> {
    if bytes.len() > limits.max_bytes {
        return Err(InputError::new(
            InputErrorClass::TooLarge,
            format!(
                "input is {} bytes, limit is {}",
                bytes.len(),
                limits.max_bytes
            ),
        ));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|e| InputError::new(InputErrorClass::Malformed, format!("not UTF-8: {e}")))?;
    screen(bytes, &limits.shape)
        .map_err(|e| InputError::new(InputErrorClass::Refused(e.violation), e.message))?;
    serde_json::from_str(text)
        .map_err(|e| InputError::new(InputErrorClass::Malformed, format!("not JSON: {e}")))
}

/// Decodes one input read from `topic`. Never panics, whatever the bytes.
pub fn decode_input(
    topic: InputTopic,
    bytes: &[u8],
    limits: &InputLimits,
) -> Result<Input, InputError> {
    decode_value(topic, &parse_value(bytes, limits)?)
}

/// Decodes an already parsed JSON value read from `topic`.
pub fn decode_value(topic: InputTopic, value: &Value) -> Result<Input, InputError> {
    let Value::Object(obj) = value else {
        return Err(InputError::new(
            InputErrorClass::Malformed,
            "not a JSON object",
        ));
    };
    let kind = check_envelope(topic, obj)?;
    decode_fields(kind, &Fields(obj))
}

/// Checks `type`, `schema_version` and the topic, in that order; returns the type.
fn check_envelope(topic: InputTopic, obj: &Map<String, Value>) -> Result<&str, InputError> {
    let kind = match obj.get("type") {
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(InputError::invalid("type: must be a string")),
        None => return Err(InputError::invalid("type: missing")),
    };
    let expected_topic = match kind {
        TYPE_RUN_START => InputTopic::Requests,
        TYPE_ATTEMPT_RESULT => InputTopic::AttemptResults,
        TYPE_WAKEUP_TIMER | TYPE_WAKEUP_SIGNAL | TYPE_WAKEUP_CANCEL => InputTopic::Wakeups,
        other => {
            return Err(InputError::new(
                InputErrorClass::UnknownType,
                format!("unknown type {:?}", truncate(other.to_owned(), 64)),
            ));
        }
    };
    match obj.get("schema_version") {
        None => return Err(InputError::invalid("schema_version: missing")),
        Some(v) => match v.as_u64() {
            Some(SCHEMA_VERSION) => {}
            Some(other) => {
                return Err(InputError::new(
                    InputErrorClass::UnsupportedVersion,
                    format!(
                        "schema_version {other} is not supported (supported: {SCHEMA_VERSION})"
                    ),
                ));
            }
            None => {
                return Err(InputError::invalid(
                    "schema_version: must be a non-negative integer",
                ));
            }
        },
    }
    if expected_topic != topic {
        return Err(InputError::new(
            InputErrorClass::WrongTopic,
            format!(
                "{kind} belongs on {}, not on {}",
                expected_topic.as_str(),
                topic.as_str()
            ),
        ));
    }
    Ok(kind)
}

/// Decodes the fields of an input whose envelope checked out.
fn decode_fields(kind: &str, f: &Fields<'_>) -> Result<Input, InputError> {
    let run_id = f.id("run_id")?;
    let tenant = f.id("tenant")?;
    Ok(match kind {
        TYPE_RUN_START => Input::Start(RunStart {
            run_id,
            tenant,
            workflow: f.required(
                "workflow",
                |s| is_name(s, MAX_NAME_LEN),
                "1 to 100 characters of [A-Za-z0-9_.-]",
            )?,
            workflow_version: f.opt_u32("workflow_version")?,
            pool: f
                .optional(
                    "pool",
                    |s| is_name(s, MAX_NAME_LEN),
                    "1 to 100 characters of [A-Za-z0-9._-]",
                )?
                .unwrap_or_else(|| DEFAULT_POOL.to_owned()),
            input: f.any("input"),
            correlation_id: f.optional(
                "correlation_id",
                |s| s.chars().count() <= MAX_CORRELATION_ID_LEN,
                "at most 256 characters",
            )?,
        }),
        TYPE_ATTEMPT_RESULT => Input::Result(AttemptResult {
            run_id,
            tenant,
            stamp: f.uuid("stamp")?,
            outcome: f.outcome()?,
        }),
        TYPE_WAKEUP_TIMER => Input::Timer(TimerWakeup {
            run_id,
            tenant,
            timer: match f.str("timer")? {
                "retry" => TimerKind::Retry,
                "timeout" => TimerKind::Timeout,
                "wake" => TimerKind::Wake,
                _ => {
                    return Err(InputError::invalid(
                        "timer: must be \"retry\", \"timeout\" or \"wake\"",
                    ));
                }
            },
            stamp: f.uuid("stamp")?,
        }),
        TYPE_WAKEUP_SIGNAL => Input::Signal(SignalWakeup {
            run_id,
            tenant,
            signal_id: f.required(
                "signal_id",
                bounded(MAX_SIGNAL_FIELD_LEN),
                "1 to 128 characters",
            )?,
            name: f.required("name", bounded(MAX_SIGNAL_FIELD_LEN), "1 to 128 characters")?,
            payload: f.any("payload"),
        }),
        _ => Input::Cancel(CancelWakeup {
            run_id,
            tenant,
            reason: f.optional(
                "reason",
                |s| s.chars().count() <= MAX_REASON_LEN,
                "at most 1024 characters",
            )?,
        }),
    })
}

fn bounded(max: usize) -> impl Fn(&str) -> bool {
    move |s| !s.is_empty() && s.chars().count() <= max
}

/// `[A-Za-z0-9_.:-]{1,128}`: the charset of `run_id` and `tenant`.
pub fn is_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// Typed access to the fields of one input object; every error names its field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    /// Absent and `null` are both "not given".
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn str(&self, name: &str) -> Result<&str, InputError> {
        match self.get(name) {
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(InputError::invalid(format!("{name}: must be a string"))),
            None => Err(InputError::invalid(format!("{name}: missing"))),
        }
    }

    fn required(
        &self,
        name: &str,
        ok: impl Fn(&str) -> bool,
        rule: &str,
    ) -> Result<String, InputError> {
        let s = self.str(name)?;
        if ok(s) {
            Ok(s.to_owned())
        } else {
            Err(InputError::invalid(format!("{name}: must be {rule}")))
        }
    }

    fn optional(
        &self,
        name: &str,
        ok: impl Fn(&str) -> bool,
        rule: &str,
    ) -> Result<Option<String>, InputError> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.required(name, ok, rule).map(Some),
        }
    }

    fn id(&self, name: &str) -> Result<String, InputError> {
        self.required(name, is_id, "1 to 128 characters of [A-Za-z0-9_.:-]")
    }

    fn uuid(&self, name: &str) -> Result<Uuid, InputError> {
        Uuid::parse_str(self.str(name)?)
            .map_err(|_| InputError::invalid(format!("{name}: must be a UUID")))
    }

    fn opt_u32(&self, name: &str) -> Result<Option<u32>, InputError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    InputError::invalid(format!("{name}: must be an integer in 0..=4294967295"))
                }),
        }
    }

    fn bool(&self, name: &str) -> Result<bool, InputError> {
        match self.get(name) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(InputError::invalid(format!("{name}: must be a boolean"))),
            None => Err(InputError::invalid(format!("{name}: missing"))),
        }
    }

    fn any(&self, name: &str) -> Value {
        self.0.get(name).cloned().unwrap_or(Value::Null)
    }

    fn outcome(&self) -> Result<AttemptOutcome, InputError> {
        match self.str("outcome")? {
            "succeeded" => Ok(AttemptOutcome::Succeeded {
                output: self.any("output"),
            }),
            "failed" => {
                let error = match self.get("error") {
                    Some(Value::Object(e)) => Fields(e),
                    Some(_) => return Err(InputError::invalid("error: must be an object")),
                    None => return Err(InputError::invalid("error: missing")),
                };
                let message = error
                    .required(
                        "message",
                        |s| s.chars().count() <= MAX_ERROR_MESSAGE_LEN,
                        "at most 4096 characters",
                    )
                    .map_err(|e| InputError::invalid(format!("error.{}", e.message)))?;
                let retryable = error
                    .bool("retryable")
                    .map_err(|e| InputError::invalid(format!("error.{}", e.message)))?;
                Ok(AttemptOutcome::Failed { message, retryable })
            }
            _ => Err(InputError::invalid(
                "outcome: must be \"succeeded\" or \"failed\"",
            )),
        }
    }
}

impl Input {
    pub fn run_id(&self) -> &str {
        match self {
            Input::Start(x) => &x.run_id,
            Input::Result(x) => &x.run_id,
            Input::Timer(x) => &x.run_id,
            Input::Signal(x) => &x.run_id,
            Input::Cancel(x) => &x.run_id,
        }
    }

    pub fn tenant(&self) -> &str {
        match self {
            Input::Start(x) => &x.tenant,
            Input::Result(x) => &x.tenant,
            Input::Timer(x) => &x.tenant,
            Input::Signal(x) => &x.tenant,
            Input::Cancel(x) => &x.tenant,
        }
    }

    /// The wire `type`.
    pub fn type_str(&self) -> &'static str {
        match self {
            Input::Start(_) => TYPE_RUN_START,
            Input::Result(_) => TYPE_ATTEMPT_RESULT,
            Input::Timer(_) => TYPE_WAKEUP_TIMER,
            Input::Signal(_) => TYPE_WAKEUP_SIGNAL,
            Input::Cancel(_) => TYPE_WAKEUP_CANCEL,
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
    /// `start`, `result:<stamp>`, `timer:<retry|timeout>:<stamp>`, `signal:<signal_id>`, `cancel`
    /// (and, from no input, [`MISSING_WORKFLOW_REF`]).
    pub fn dedup_ref(&self) -> String {
        match self {
            Input::Start(_) => "start".to_owned(),
            Input::Result(r) => format!("result:{}", r.stamp),
            Input::Timer(t) => format!("timer:{}:{}", t.timer.as_str(), t.stamp),
            Input::Signal(s) => format!("signal:{}", s.signal_id),
            Input::Cancel(_) => "cancel".to_owned(),
        }
    }

    /// The canonical wire form; `decode_value(self.topic(), &self.to_json()) == Ok(self)`.
    pub fn to_json(&self) -> Value {
        let mut obj = Map::new();
        obj.insert("type".into(), self.type_str().into());
        obj.insert("schema_version".into(), SCHEMA_VERSION.into());
        obj.insert("run_id".into(), self.run_id().into());
        obj.insert("tenant".into(), self.tenant().into());
        let mut put = |k: &str, v: Value| {
            obj.insert(k.to_owned(), v);
        };
        match self {
            Input::Start(s) => {
                put("workflow", s.workflow.clone().into());
                if let Some(v) = s.workflow_version {
                    put("workflow_version", v.into());
                }
                put("pool", s.pool.clone().into());
                put("input", s.input.clone());
                if let Some(c) = &s.correlation_id {
                    put("correlation_id", c.clone().into());
                }
            }
            Input::Result(r) => {
                put("stamp", r.stamp.to_string().into());
                match &r.outcome {
                    AttemptOutcome::Succeeded { output } => {
                        put("outcome", "succeeded".into());
                        put("output", output.clone());
                    }
                    AttemptOutcome::Failed { message, retryable } => {
                        put("outcome", "failed".into());
                        put(
                            "error",
                            json!({ "message": message, "retryable": retryable }),
                        );
                    }
                }
            }
            Input::Timer(t) => {
                put("timer", t.timer.as_str().into());
                put("stamp", t.stamp.to_string().into());
            }
            Input::Signal(s) => {
                put("signal_id", s.signal_id.clone().into());
                put("name", s.name.clone().into());
                put("payload", s.payload.clone());
            }
            Input::Cancel(c) => {
                if let Some(r) = &c.reason {
                    put("reason", r.clone().into());
                }
            }
        }
        Value::Object(obj)
    }
}
