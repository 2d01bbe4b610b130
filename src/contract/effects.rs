//! The effects: what the coordinator decides to publish, where, and in
//! which shape. Each payload is a typed struct that encodes to the JSON
//! value on the wire (`type` first, then `schema_version`); a consumer that
//! decodes it uses the same type ([`StepDispatch::decode`] for workers).
//!
//! In: what the fold decided, as typed payloads ([`RunEvent`],
//! [`StepDispatch`], [`RunOutput`], [`RunAccepted`], [`EffectParked`]); on
//! a worker, a dispatch's bytes. Out: [`Effect`]s, each with its
//! [`EffectTarget`] and JSON payload; a decoded [`StepDispatch`] or a
//! [`DecodeError`]. Guarantees: decoding a dispatch is pure and never
//! panics, refuses another `schema_version`, and its error names the field
//! without echoing the payload, in at most [`MAX_DECODE_ERROR_LEN`] bytes.

use chrono::{DateTime, SecondsFormat, Utc};
use schemars::JsonSchema;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::formats::{AnyValue, Id, Name, Text, Timestamp, Version};
use super::input::{SCHEMA_VERSION, is_id, truncate};
use super::names::{MAX_NAME_LEN, TopicNames};

/// Longest [`DecodeError::message`].
pub const MAX_DECODE_ERROR_LEN: usize = 512;

/// Longest `step_key` a worker accepts: a run id, `/step/` and an index
/// are far shorter; the bound keeps the key usable as a header value.
pub const MAX_STEP_KEY_LEN: usize = 256;

/// Every kind of record the outbox publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EffectKind {
    /// A run's lifecycle event, first effect of every transition, on the
    /// events topic.
    RunEvent,
    /// One attempt of a step, on its pool's steps topic.
    StepDispatch,
    /// A durable timer, the canonical `wakeup.timer` input, on the wakeups
    /// topic at its due time.
    WakeupTimer,
    /// A succeeded run's output, on its workflow's `output_topic`.
    RunOutput,
    /// The decision of a routed start, last effect of its run's first
    /// transition, on the events topic.
    RunAccepted,
    /// One of a run's effects was parked, on the events topic.
    EffectParked,
    /// The start of a `child` step's run, the canonical routed `run.start`,
    /// on the requests topic.
    ChildStart,
    /// The cancel of a child run whose step was abandoned, the canonical
    /// `wakeup.cancel`, on the requests topic behind the child's start.
    ChildCancel,
    /// A child run's outcome for its parent's attempt, the canonical
    /// `attempt.result`, on the attempt-results topic.
    ChildResult,
}

impl EffectKind {
    pub const ALL: [EffectKind; 9] = [
        EffectKind::RunEvent,
        EffectKind::StepDispatch,
        EffectKind::WakeupTimer,
        EffectKind::RunOutput,
        EffectKind::RunAccepted,
        EffectKind::EffectParked,
        EffectKind::ChildStart,
        EffectKind::ChildCancel,
        EffectKind::ChildResult,
    ];

    /// An input of Ductor's own: a timer, or what a parent and its child
    /// runs tell each other. `serve` signs each with `signatures.timer_key`.
    pub fn is_own_input(self) -> bool {
        matches!(
            self,
            EffectKind::WakeupTimer
                | EffectKind::ChildStart
                | EffectKind::ChildCancel
                | EffectKind::ChildResult
        )
    }

    /// The payload's `type` field.
    pub fn wire_type(self) -> &'static str {
        match self {
            EffectKind::RunEvent => "run.event",
            EffectKind::StepDispatch => "step.dispatch",
            EffectKind::WakeupTimer => "wakeup.timer",
            EffectKind::RunOutput => "run.output",
            EffectKind::RunAccepted => "run.accepted",
            EffectKind::EffectParked => "run.effect_parked",
            EffectKind::ChildStart => "run.start",
            EffectKind::ChildCancel => "wakeup.cancel",
            EffectKind::ChildResult => "attempt.result",
        }
    }

    /// The CloudEvents type (header `ce_type`): `ductor.` and the wire type.
    pub fn ce_type(self) -> &'static str {
        match self {
            EffectKind::RunEvent => "ductor.run.event",
            EffectKind::StepDispatch => "ductor.step.dispatch",
            EffectKind::WakeupTimer => "ductor.wakeup.timer",
            EffectKind::RunOutput => "ductor.run.output",
            EffectKind::RunAccepted => "ductor.run.accepted",
            EffectKind::EffectParked => "ductor.run.effect_parked",
            EffectKind::ChildStart => "ductor.run.start",
            EffectKind::ChildCancel => "ductor.wakeup.cancel",
            EffectKind::ChildResult => "ductor.attempt.result",
        }
    }

    /// The kind whose CloudEvents type is `ce_type`.
    pub fn from_ce_type(ce_type: &str) -> Option<EffectKind> {
        EffectKind::ALL.into_iter().find(|k| k.ce_type() == ce_type)
    }
}

/// Where an effect goes; [`EffectTarget::topic`] names the topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EffectTarget {
    /// `ductor.steps.<pool>`.
    StepQueue { pool: String },
    /// `ductor.events`.
    Events,
    /// The wakeups input topic (timers).
    Wakeups,
    /// A workflow's `output_topic`, used verbatim.
    Output { topic: String },
    /// The requests input topic, keyed by `run_id` (a child run), not by
    /// the run whose effect it is.
    Requests { run_id: String },
    /// The attempt-results input topic, keyed by `run_id` (a child's
    /// parent).
    AttemptResults { run_id: String },
}

impl EffectTarget {
    /// The topic this target names among `names`.
    pub fn topic(&self, names: &TopicNames) -> String {
        match self {
            EffectTarget::StepQueue { pool } => names.steps(pool),
            EffectTarget::Events => names.events(),
            EffectTarget::Wakeups => names.wakeups(),
            EffectTarget::Output { topic } => topic.clone(),
            EffectTarget::Requests { .. } => names.requests(),
            EffectTarget::AttemptResults { .. } => names.attempt_results(),
        }
    }

    /// The record's key when it is another run's than the effect's own:
    /// an input for another run lands on that run's partition.
    pub fn other_run(&self) -> Option<&str> {
        match self {
            EffectTarget::Requests { run_id } | EffectTarget::AttemptResults { run_id } => {
                Some(run_id)
            }
            _ => None,
        }
    }
}

/// A step's clock starts when its dispatch is published. A dispatch
/// published more than this after the transition that made it (its
/// process died first, and another drainer redrove it) has its timeout
/// timer pushed back by the delay, and a worker counts its deadline from
/// the record's timestamp instead of `ce_time`: a crash of Ductor costs
/// the step no time. Delays up to this are the ordinary outbox hop.
pub const LATE_DISPATCH_MS: i64 = 1_000;

/// A side effect as data; the apply stage writes it as an outbox intent.
#[derive(Debug, Clone, PartialEq)]
pub struct Effect {
    pub target: EffectTarget,
    pub kind: EffectKind,
    pub payload: Value,
    /// Publish no earlier than this (durable timers); `None` = as soon as committed.
    pub not_before: Option<DateTime<Utc>>,
}

impl Effect {
    /// An effect to publish as soon as its transition is committed.
    pub fn now(target: EffectTarget, kind: EffectKind, payload: &impl Serialize) -> Effect {
        Effect {
            target,
            kind,
            payload: to_value(payload),
            not_before: None,
        }
    }
}

/// The JSON value of a payload. The payload types hold only strings,
/// numbers and JSON values, so their encoding cannot fail.
pub fn to_value(payload: &impl Serialize) -> Value {
    serde_json::to_value(payload).unwrap_or(Value::Null)
}

/// Timestamps in payloads: RFC 3339, milliseconds, `Z`.
pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn rfc3339_millis<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

/// What a transition did to its run: the `kind` of its history row and of
/// its `run.event`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransitionKind {
    RunStarted,
    StepSucceeded,
    StepRetryScheduled,
    StepTimedOut,
    StepRetried,
    RunSucceeded,
    RunFailed,
    RunSignalled,
    RunCancelled,
    /// A failed run started again from the step it failed in.
    RunRetried,
    /// A branch of a `parallel` step failed for good while others still
    /// run (`on_failure = "all_settled"`).
    BranchFailed,
    /// A step failed for good and its `catch` took the run on to another
    /// step.
    StepCaught,
    /// A step failed for good and its `catch` compensates: the run undoes
    /// the steps that succeeded, newest first, then fails.
    RunCompensating,
}

impl TransitionKind {
    pub const ALL: [TransitionKind; 13] = [
        TransitionKind::RunStarted,
        TransitionKind::StepSucceeded,
        TransitionKind::StepRetryScheduled,
        TransitionKind::StepTimedOut,
        TransitionKind::StepRetried,
        TransitionKind::RunSucceeded,
        TransitionKind::RunFailed,
        TransitionKind::RunSignalled,
        TransitionKind::RunCancelled,
        TransitionKind::RunRetried,
        TransitionKind::BranchFailed,
        TransitionKind::StepCaught,
        TransitionKind::RunCompensating,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TransitionKind::RunStarted => "run.started",
            TransitionKind::StepSucceeded => "step.succeeded",
            TransitionKind::StepRetryScheduled => "step.retry_scheduled",
            TransitionKind::StepTimedOut => "step.timed_out",
            TransitionKind::StepRetried => "step.retried",
            TransitionKind::RunSucceeded => "run.succeeded",
            TransitionKind::RunFailed => "run.failed",
            TransitionKind::RunSignalled => "run.signalled",
            TransitionKind::RunCancelled => "run.cancelled",
            TransitionKind::RunRetried => "run.retried",
            TransitionKind::BranchFailed => "branch.failed",
            TransitionKind::StepCaught => "step.caught",
            TransitionKind::RunCompensating => "run.compensating",
        }
    }

    /// The kind whose name is `name`, as stored in `run_transitions.kind`.
    pub fn parse(name: &str) -> Option<TransitionKind> {
        TransitionKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl Serialize for TransitionKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl JsonSchema for TransitionKind {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "TransitionKind".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let names: Vec<&str> = TransitionKind::ALL.iter().map(|k| k.as_str()).collect();
        schemars::json_schema!({
            "description": "What the transition did to its run.",
            "type": "string",
            "enum": names,
        })
    }
}

/// `run.event`: one transition of a run, as its followers see it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(tag = "type", rename = "run.event")]
pub struct RunEvent<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    pub seq: i64,
    pub kind: TransitionKind,
    pub status: &'a str,
    pub step_index: u32,
    pub attempt: u32,
    #[serde(serialize_with = "rfc3339_millis")]
    #[schemars(with = "Timestamp")]
    pub at: DateTime<Utc>,
}

/// `run.output`: a succeeded run's output.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(tag = "type", rename = "run.output")]
pub struct RunOutput<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    #[schemars(with = "Name")]
    pub workflow: &'a str,
    #[schemars(with = "AnyValue")]
    pub output: &'a Value,
}

/// `run.accepted`: the decision a routed start got.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(tag = "type", rename = "run.accepted")]
pub struct RunAccepted<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    #[schemars(with = "Name")]
    pub pool: &'a str,
    #[schemars(with = "Name")]
    pub workflow: &'a str,
    pub workflow_version: u32,
    pub idempotency_key: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
}

/// `run.effect_parked`: one of a run's effects was parked after failing
/// for good; `seq` and `effect_index` name it, `topic` is where it was for.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(tag = "type", rename = "run.effect_parked")]
pub struct EffectParked<'a> {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: &'a str,
    #[schemars(with = "Id")]
    pub tenant: &'a str,
    pub seq: i64,
    pub effect_index: i32,
    pub topic: &'a str,
    pub error: &'a str,
    /// RFC 3339, microseconds: the parking's time, as in its `ce_time`.
    #[schemars(with = "Timestamp")]
    pub at: &'a str,
}

/// A decoded `step.dispatch`: one attempt of one step of one run.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(tag = "type", rename = "step.dispatch")]
pub struct StepDispatch {
    #[schemars(with = "Version")]
    pub schema_version: u64,
    #[schemars(with = "Id")]
    pub run_id: String,
    #[schemars(with = "Id")]
    pub tenant: String,
    #[schemars(with = "Name")]
    pub workflow: String,
    pub workflow_version: u32,
    /// The step's name in the workflow definition.
    #[schemars(with = "Name")]
    pub step: String,
    pub step_index: u32,
    /// 1 for the first attempt of the step.
    pub attempt: u32,
    /// The same for every attempt of this step of this run
    /// ([`super::names::step_key`]): pass it as the idempotency key of the
    /// external call the step makes. The message's `idempotency-key`
    /// header differs from one attempt to the next.
    #[schemars(with = "Text<1, MAX_STEP_KEY_LEN>")]
    pub step_key: String,
    /// The attempt's fencing token; the result must carry it.
    pub stamp: Uuid,
    /// After this instant the coordinator times the attempt out and ignores
    /// its result.
    #[serde(serialize_with = "rfc3339_millis")]
    #[schemars(with = "Timestamp")]
    pub deadline: DateTime<Utc>,
    /// The run's input for the first step, the previous step's output after.
    #[schemars(with = "AnyValue")]
    pub input: Value,
    /// The branch of a `parallel` step the attempt runs in, by name
    /// (absent outside branches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Name>")]
    pub branch: Option<String>,
    /// The item of a `map` step the attempt runs for, by position in the
    /// map's input (absent outside maps; the innermost, for nested maps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<u32>,
}

/// A dispatch that does not follow the contract: a version mismatch between
/// the coordinator and this worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable step dispatch: {message}")]
pub struct DecodeError {
    /// Names the field; bounded to [`MAX_DECODE_ERROR_LEN`]; never echoes payloads.
    pub message: String,
}

impl DecodeError {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: truncate(message.into(), MAX_DECODE_ERROR_LEN),
        }
    }
}

impl StepDispatch {
    /// Decodes a `step.dispatch` value. Pure; never panics, whatever the bytes.
    /// Unknown extra fields are tolerated, as on every Ductor topic.
    pub fn decode(bytes: &[u8]) -> Result<StepDispatch, DecodeError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| DecodeError::new(format!("not JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(DecodeError::new("not a JSON object"));
        };
        let f = Fields(&obj);
        let wire_type = EffectKind::StepDispatch.wire_type();
        if f.str("type")? != wire_type {
            return Err(DecodeError::new(format!("type: must be {wire_type:?}")));
        }
        match f.u64("schema_version")? {
            SCHEMA_VERSION => {}
            other => {
                return Err(DecodeError::new(format!(
                    "schema_version {other} is not supported (supported: {SCHEMA_VERSION})"
                )));
            }
        }
        let deadline = DateTime::parse_from_rfc3339(f.str("deadline")?)
            .map_err(|_| DecodeError::new("deadline: must be an RFC 3339 timestamp"))?
            .with_timezone(&Utc);
        let run_id = f.id("run_id")?;
        let step_index = f.u32("step_index")?;
        // Dispatches committed before steps had keys carry none: the key
        // is derived, so theirs is the one they would have carried.
        let step_key = match obj.get("step_key") {
            None => super::names::step_key(&run_id, step_index),
            Some(_) => f.step_key("step_key")?,
        };
        Ok(StepDispatch {
            schema_version: SCHEMA_VERSION,
            tenant: f.id("tenant")?,
            workflow: f.name("workflow")?,
            workflow_version: f.u32("workflow_version")?,
            step: f.name("step")?,
            step_index,
            attempt: f.u32("attempt")?,
            step_key,
            run_id,
            stamp: Uuid::parse_str(f.str("stamp")?)
                .map_err(|_| DecodeError::new("stamp: must be a UUID"))?,
            deadline,
            input: obj.get("input").cloned().unwrap_or(Value::Null),
            branch: match obj.get("branch") {
                None | Some(Value::Null) => None,
                Some(_) => Some(f.name("branch")?),
            },
            item: match obj.get("item") {
                None | Some(Value::Null) => None,
                Some(_) => Some(f.u32("item")?),
            },
        })
    }

    /// The coordinator has timed (or will time) this attempt out.
    pub fn is_expired(&self, now: DateTime<Utc>) -> bool {
        self.deadline <= now
    }
}

/// Typed access to the fields of a dispatch; every error names its field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn str(&self, name: &str) -> Result<&str, DecodeError> {
        match self.0.get(name) {
            Some(Value::String(s)) => Ok(s),
            Some(Value::Null) | None => Err(DecodeError::new(format!("{name}: missing"))),
            Some(_) => Err(DecodeError::new(format!("{name}: must be a string"))),
        }
    }

    fn u64(&self, name: &str) -> Result<u64, DecodeError> {
        match self.0.get(name) {
            Some(Value::Null) | None => Err(DecodeError::new(format!("{name}: missing"))),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| DecodeError::new(format!("{name}: must be a non-negative integer"))),
        }
    }

    fn u32(&self, name: &str) -> Result<u32, DecodeError> {
        u32::try_from(self.u64(name)?)
            .map_err(|_| DecodeError::new(format!("{name}: must be at most 4294967295")))
    }

    fn id(&self, name: &str) -> Result<String, DecodeError> {
        let s = self.str(name)?;
        if is_id(s) {
            Ok(s.to_owned())
        } else {
            Err(DecodeError::new(format!(
                "{name}: must be 1 to 128 characters of [A-Za-z0-9_.:-]"
            )))
        }
    }

    /// Visible ASCII, so that it can be sent as an HTTP header value as is.
    fn step_key(&self, name: &str) -> Result<String, DecodeError> {
        let s = self.str(name)?;
        if !s.is_empty() && s.len() <= MAX_STEP_KEY_LEN && s.bytes().all(|b| b.is_ascii_graphic()) {
            Ok(s.to_owned())
        } else {
            Err(DecodeError::new(format!(
                "{name}: must be 1 to {MAX_STEP_KEY_LEN} visible ASCII characters"
            )))
        }
    }

    fn name(&self, name: &str) -> Result<String, DecodeError> {
        let s = self.str(name)?;
        if !s.is_empty() && s.len() <= MAX_NAME_LEN {
            Ok(s.to_owned())
        } else {
            Err(DecodeError::new(format!("{name}: must be 1 to 100 bytes")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatch() -> StepDispatch {
        StepDispatch {
            schema_version: SCHEMA_VERSION,
            run_id: "run-1".into(),
            tenant: "acme".into(),
            workflow: "wf".into(),
            workflow_version: 3,
            step: "charge".into(),
            step_index: 1,
            attempt: 2,
            step_key: "run-1/step/1".into(),
            stamp: Uuid::from_u128(7),
            deadline: DateTime::parse_from_rfc3339("2026-01-01T00:00:05.250Z")
                .unwrap()
                .with_timezone(&Utc),
            input: serde_json::json!({"amount": 5}),
            branch: None,
            item: None,
        }
    }

    #[test]
    fn a_dispatch_decodes_to_what_was_encoded() {
        let encoded = to_value(&dispatch()).to_string();
        assert_eq!(StepDispatch::decode(encoded.as_bytes()), Ok(dispatch()));
    }

    #[test]
    fn a_dispatch_without_a_step_key_gets_the_one_its_step_has() {
        let mut value = to_value(&dispatch());
        value.as_object_mut().unwrap().remove("step_key");
        let decoded = StepDispatch::decode(value.to_string().as_bytes()).unwrap();
        assert_eq!(decoded.step_key, super::super::names::step_key("run-1", 1));
        assert_eq!(decoded, dispatch());
    }

    #[test]
    fn a_branch_and_an_item_decode_and_a_wrong_one_is_refused() {
        let named = StepDispatch {
            branch: Some("east".into()),
            item: Some(3),
            ..dispatch()
        };
        let encoded = to_value(&named).to_string();
        assert_eq!(StepDispatch::decode(encoded.as_bytes()), Ok(named));
        for (field, bad) in [
            ("branch", serde_json::json!(7)),
            ("branch", serde_json::json!("")),
            ("branch", serde_json::json!("b".repeat(MAX_NAME_LEN + 1))),
            ("item", serde_json::json!(-1)),
            ("item", serde_json::json!("3")),
            ("item", serde_json::json!(1u64 << 40)),
        ] {
            let mut value = to_value(&dispatch());
            value[field] = bad.clone();
            let err = StepDispatch::decode(value.to_string().as_bytes()).unwrap_err();
            assert!(
                err.message.starts_with(&format!("{field}:")),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_step_key_that_is_no_header_value_is_refused() {
        for bad in [
            serde_json::json!(""),
            serde_json::json!("a key"),
            serde_json::json!("k\u{7f}"),
            serde_json::json!("x".repeat(MAX_STEP_KEY_LEN + 1)),
            serde_json::json!(7),
        ] {
            let mut value = to_value(&dispatch());
            value["step_key"] = bad.clone();
            let err = StepDispatch::decode(value.to_string().as_bytes()).unwrap_err();
            assert!(err.message.starts_with("step_key:"), "{bad}: {err}");
        }
    }

    #[test]
    fn payloads_put_their_type_and_version_first() {
        let value = to_value(&dispatch());
        let keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "type",
                "schema_version",
                "run_id",
                "tenant",
                "workflow",
                "workflow_version",
                "step",
                "step_index",
                "attempt",
                "step_key",
                "stamp",
                "deadline",
                "input"
            ]
        );
        assert_eq!(value["type"], EffectKind::StepDispatch.wire_type());
        assert_eq!(value["deadline"], "2026-01-01T00:00:05.250Z");
        assert_eq!(value["stamp"], Uuid::from_u128(7).to_string());
        let accepted = to_value(&RunAccepted {
            schema_version: SCHEMA_VERSION,
            run_id: "r",
            tenant: "t",
            pool: "p",
            workflow: "w",
            workflow_version: 1,
            idempotency_key: None,
            correlation_id: Some("c"),
        });
        assert_eq!(accepted["type"], EffectKind::RunAccepted.wire_type());
        assert_eq!(accepted["idempotency_key"], Value::Null);
    }

    #[test]
    fn every_transition_kind_parses_from_its_name() {
        for kind in TransitionKind::ALL {
            assert_eq!(TransitionKind::parse(kind.as_str()), Some(kind));
            assert_eq!(to_value(&kind), kind.as_str());
        }
        assert_eq!(TransitionKind::parse("run.paused"), None);
    }

    #[test]
    fn every_kind_is_named_by_its_ce_type() {
        for kind in EffectKind::ALL {
            assert_eq!(EffectKind::from_ce_type(kind.ce_type()), Some(kind));
            assert_eq!(kind.ce_type(), format!("ductor.{}", kind.wire_type()));
        }
        assert_eq!(EffectKind::from_ce_type("ductor.nope"), None);
    }
}
