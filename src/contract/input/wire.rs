//! The wire form of an input: JSON bytes to an [`Input`], and an [`Input`] to
//! its canonical JSON.
//!
//! In: one message's bytes, or a parsed JSON value, and the topic it was read
//! from; or an [`Input`]. Out: the decoded [`Input`] or an [`InputError`]
//! naming the offending field; or the JSON value. Guarantees: bytes are
//! checked for size, UTF-8 and shape before they are parsed; the envelope
//! (`type`, `schema_version`, then the topic) before any field; decoding never
//! panics, whatever the bytes; `decode_value(input.topic(), &input.to_json())`
//! gives the input back. Pure: no broker, no clock; what it decides is tested
//! without either.

use serde_json::{Map, Value};
use uuid::Uuid;

use super::{
    AttemptOutcome, AttemptResult, CancelWakeup, DEFAULT_POOL, Input, InputError, InputErrorClass,
    InputLimits, InputTopic, MAX_CORRELATION_ID_LEN, MAX_ERROR_MESSAGE_LEN, MAX_REASON_LEN,
    MAX_SIGNAL_FIELD_LEN, ParentRef, RetryWakeup, RunStart, SCHEMA_VERSION, SignalWakeup,
    TimerKind, TimerWakeup, is_id, truncate,
};
use crate::contract::names::{MAX_NAME_LEN, is_name};
use crate::contract::screen::screen;

const TYPE_RUN_START: &str = "run.start";
const TYPE_ATTEMPT_RESULT: &str = "attempt.result";
const TYPE_WAKEUP_TIMER: &str = "wakeup.timer";
const TYPE_WAKEUP_SIGNAL: &str = "wakeup.signal";
const TYPE_WAKEUP_CANCEL: &str = "wakeup.cancel";
const TYPE_WAKEUP_RETRY: &str = "wakeup.retry";

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
        // A cancel may come on the requests topic too: a parent cancels
        // its child there, behind the child's start, so that it cannot
        // overtake it.
        TYPE_WAKEUP_CANCEL if topic == InputTopic::Requests => InputTopic::Requests,
        TYPE_WAKEUP_TIMER | TYPE_WAKEUP_SIGNAL | TYPE_WAKEUP_CANCEL | TYPE_WAKEUP_RETRY => {
            InputTopic::Wakeups
        }
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
            parent: f.parent()?,
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
            timer: f.timer()?,
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
        TYPE_WAKEUP_RETRY => Input::Retry(RetryWakeup {
            run_id,
            tenant,
            action_id: f.id("action_id")?,
            failed_seq: f.seq("failed_seq")?,
            reason: f.reason()?,
        }),
        _ => Input::Cancel(CancelWakeup {
            run_id,
            tenant,
            reason: f.reason()?,
            action_id: f.optional("action_id", is_id, "1 to 128 characters of [A-Za-z0-9_.:-]")?,
        }),
    })
}

fn bounded(max: usize) -> impl Fn(&str) -> bool {
    move |s| !s.is_empty() && s.chars().count() <= max
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

    fn reason(&self) -> Result<Option<String>, InputError> {
        self.optional(
            "reason",
            |s| s.chars().count() <= MAX_REASON_LEN,
            "at most 1024 characters",
        )
    }

    fn id(&self, name: &str) -> Result<String, InputError> {
        self.required(name, is_id, "1 to 128 characters of [A-Za-z0-9_.:-]")
    }

    /// `parent`: absent, `null`, or `{"run_id": <id>, "stamp": <uuid>}`.
    fn parent(&self) -> Result<Option<Box<ParentRef>>, InputError> {
        match self.get("parent") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(obj)) => {
                let f = Fields(obj);
                let (run_id, stamp) = (f.id("run_id"), f.uuid("stamp"));
                let wrap = |e: InputError| InputError::invalid(format!("parent.{}", e.message));
                Ok(Some(Box::new(ParentRef {
                    run_id: run_id.map_err(wrap)?,
                    stamp: stamp.map_err(wrap)?,
                })))
            }
            Some(_) => Err(InputError::invalid(
                "parent: must be an object with run_id and stamp",
            )),
        }
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

    fn timer(&self) -> Result<TimerKind, InputError> {
        match self.str("timer")? {
            "retry" => Ok(TimerKind::Retry),
            "timeout" => Ok(TimerKind::Timeout),
            "wake" => Ok(TimerKind::Wake),
            _ => Err(InputError::invalid(
                "timer: must be \"retry\", \"timeout\" or \"wake\"",
            )),
        }
    }

    /// A transition's seq: an integer from 1.
    fn seq(&self, name: &str) -> Result<i64, InputError> {
        match self.get(name) {
            None => Err(InputError::invalid(format!("{name}: missing"))),
            Some(v) => v
                .as_i64()
                .filter(|n| *n >= 1)
                .ok_or_else(|| InputError::invalid(format!("{name}: must be an integer from 1"))),
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
    /// The wire `type`.
    pub fn type_str(&self) -> &'static str {
        match self {
            Input::Start(_) => TYPE_RUN_START,
            Input::Result(_) => TYPE_ATTEMPT_RESULT,
            Input::Timer(_) => TYPE_WAKEUP_TIMER,
            Input::Signal(_) => TYPE_WAKEUP_SIGNAL,
            Input::Cancel(_) => TYPE_WAKEUP_CANCEL,
            Input::Retry(_) => TYPE_WAKEUP_RETRY,
        }
    }
}
