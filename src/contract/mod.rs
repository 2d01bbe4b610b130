//! The wire: every name and shape that crosses Kafka between Ductor's
//! stages, its users' producers and workers, and the checker — one
//! authority for each.
//!
//! - [`input`]: the typed inputs (`run.start`, `attempt.result`,
//!   `wakeup.timer`, `wakeup.signal`, `wakeup.cancel`), decoded within the
//!   size and shape limits of [`screen`];
//! - [`effects`]: what the coordinator publishes (`run.event`,
//!   `step.dispatch`, `wakeup.timer`, `run.output`, `run.accepted`,
//!   `run.effect_parked`), as typed payloads;
//! - [`headers`]: the header names of every published record and the
//!   dead-letter topic;
//! - [`trace`]: the W3C trace context on HTTP and Kafka headers;
//! - [`names`]: topic names and the keys derived for effects;
//! - [`partition`]: which partition a run's input belongs on (murmur2,
//!   as the Java client);
//! - [`schema`]: all of it as JSON Schemas, committed under `schemas/`,
//!   and [`asyncapi`]: the topics as an AsyncAPI document beside them.
//!
//! In: the bytes, headers and topic of a message (or an HTTP body), and the
//! typed values the stages publish. Out: typed inputs, effect payloads and
//! headers, topic names, fingerprints and signatures. Guarantees: pure, no
//! clock and no I/O; decoding never panics, and a refusal names its field
//! or its class without echoing the payload.

pub mod asyncapi;
pub mod effects;
pub mod fingerprint;
pub mod formats;
pub mod headers;
pub mod input;
pub mod names;
pub mod partition;
pub mod schema;
pub mod screen;
pub mod signature;
pub mod trace;

pub use effects::{
    DecodeError, Effect, EffectKind, EffectTarget, LATE_DISPATCH_MS, StepDispatch, TransitionKind,
};
pub use input::{
    AttemptOutcome, AttemptResult, CancelWakeup, Input, InputError, InputErrorClass, InputLimits,
    InputTopic, MISSING_WORKFLOW_REF, ParentRef, RetryWakeup, RunStart, SignalWakeup, Source,
    TimerKind, TimerWakeup, bound_payload, bound_start, decode_input, decode_value, parse_value,
};
pub use names::{TopicNames, idempotency_key, timeout_cancel_key};
pub use screen::{ShapeLimits, Violation};
pub use trace::TraceContext;
