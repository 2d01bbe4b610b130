//! Header names of every record Ductor publishes, and the headers of an
//! effect.
//!
//! Every effect carries an idempotency key (a consumer that honours it, as
//! [`crate::client::dedup`] does, applies the effect once however often it is
//! redelivered), the run it belongs to, and the CloudEvents attributes in
//! Kafka's binary content mode (`ce_*`), and, for a traced run, the W3C
//! trace context ([`TRACEPARENT`], [`TRACESTATE`]).
//!
//! In: an effect's [`EffectOrigin`], its idempotency key and CloudEvents
//! type. Out: its headers, in the order they are published. Guarantees:
//! pure and deterministic: the same origin, key and type give the same
//! headers; `ce_id` is the idempotency key, `ce_subject` the run id.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Map, Value};

/// The effect's deterministic idempotency key ([`super::names::idempotency_key`]).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The run the record belongs to.
pub const RUN_ID: &str = "ductor-run-id";
/// The transition (`last_transition_seq`) that made the effect.
pub const SEQ: &str = "ductor-seq";
/// The run's tenant.
pub const TENANT: &str = "ductor-tenant";
pub const CE_SPECVERSION: &str = "ce_specversion";
/// Equal to the idempotency key.
pub const CE_ID: &str = "ce_id";
/// `/ductor/workflows/<workflow>/v<version>`.
pub const CE_SOURCE: &str = "ce_source";
/// One of [`super::effects::EffectKind::ce_type`].
pub const CE_TYPE: &str = "ce_type";
/// When the transition committed (RFC 3339, microseconds); a worker counts a
/// late dispatch's deadline from its record timestamp instead.
pub const CE_TIME: &str = "ce_time";
/// The run id.
pub const CE_SUBJECT: &str = "ce_subject";
pub const CONTENT_TYPE: &str = "content-type";

/// W3C Trace Context: the trace and the span of the hop that sent the
/// record (or the HTTP request), `00-<trace id>-<span id>-<flags>`. Read on
/// every input and on `POST /v1/runs`, signals and cancels; written on every
/// effect of a traced run, with the span of the transition that made it
/// (see [`super::trace`]). The same name on HTTP and on Kafka.
pub const TRACEPARENT: &str = "traceparent";
/// W3C Trace Context: the vendors' entries that travel with
/// [`TRACEPARENT`], at most [`super::trace::MAX_TRACESTATE_LEN`] bytes.
pub const TRACESTATE: &str = "tracestate";

/// On a dead letter: the topic, partition and offset the input came from.
pub const DLQ_TOPIC: &str = "ductor-dlq-topic";
pub const DLQ_PARTITION: &str = "ductor-dlq-partition";
pub const DLQ_OFFSET: &str = "ductor-dlq-offset";
/// On a dead letter: the stage that refused it (`decode`, `apply`, ...).
pub const DLQ_STAGE: &str = "ductor-dlq-stage";
/// On a dead letter: the stable error class, one of the `as_str` values of
/// the input, rejection and apply error classes.
pub const DLQ_CLASS: &str = "ductor-dlq-error-class";
/// On a dead letter: the bounded error message.
pub const DLQ_MESSAGE: &str = "ductor-dlq-error";
/// On a dead letter whose original value was cut to fit: its length in bytes.
pub const DLQ_TRUNCATED: &str = "ductor-dlq-truncated";
/// On a dead letter whose original headers or key did not fit at all:
/// `headers`, `key` or `headers,key`.
pub const DLQ_DROPPED: &str = "ductor-dlq-dropped";

/// On an input the ingress moved to the partition its run belongs on
/// (see [`super::partition`]): where it was read, `<topic>/<partition>/<offset>`.
pub const FORWARDED_FROM: &str = "ductor-forwarded-from";
/// On a forwarded input: how many times it has been forwarded, in decimal.
pub const FORWARDS: &str = "ductor-forwards";

/// On an input an operator replayed from its recorded dead letter (see
/// [`crate::ingress::dead_letters`]): the replay's id, a UUID, the same on
/// every copy one replay produces. A start that names neither its run nor
/// an idempotency key is keyed by it, not by its offset, so that copies of
/// one replay decide one run.
pub const REPLAY_ID: &str = "ductor-replay-id";

/// Where in the pipeline an input failed: the value of [`DLQ_STAGE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterStage {
    /// Not a well-formed input: size, JSON, type, version or fields.
    Decode,
    /// Well-formed, but the coordinator rejected it (unknown run, tenant
    /// mismatch, unknown stamp, unknown workflow, ...).
    Validate,
    /// A start request the routing plane refused (the same idempotency key
    /// with a different request).
    Route,
    /// Decoded and valid, but the database refuses to store it: found by
    /// bisecting the batch it failed, so only it is dead-lettered.
    Apply,
}

impl DeadLetterStage {
    pub const ALL: [DeadLetterStage; 4] = [
        DeadLetterStage::Decode,
        DeadLetterStage::Validate,
        DeadLetterStage::Route,
        DeadLetterStage::Apply,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterStage::Decode => "decode",
            DeadLetterStage::Validate => "validate",
            DeadLetterStage::Route => "route",
            DeadLetterStage::Apply => "apply",
        }
    }
}

/// The run an effect belongs to, as its headers name it.
#[derive(Debug, Clone, Copy)]
pub struct EffectOrigin<'a> {
    pub run_id: &'a str,
    pub tenant: &'a str,
    pub workflow: &'a str,
    pub workflow_version: u32,
    /// The transition that made the effect.
    pub seq: i64,
    /// When that transition committed.
    pub at: DateTime<Utc>,
}

/// Adds the trace context of the hop that made an effect to its headers.
pub fn add_trace(headers: &mut Map<String, Value>, trace: &super::trace::TraceContext) {
    for (name, value) in trace.headers() {
        headers.insert(name.to_owned(), Value::String(value));
    }
}

/// The headers of an effect with idempotency key `key` and CloudEvents type
/// `ce_type`, in the order they are published.
pub fn effect_headers(origin: &EffectOrigin<'_>, key: &str, ce_type: &str) -> Map<String, Value> {
    let source = format!(
        "/ductor/workflows/{}/v{}",
        origin.workflow, origin.workflow_version
    );
    let pairs = [
        (IDEMPOTENCY_KEY, key.to_owned()),
        (RUN_ID, origin.run_id.to_owned()),
        (SEQ, origin.seq.to_string()),
        (TENANT, origin.tenant.to_owned()),
        (CE_SPECVERSION, "1.0".to_owned()),
        (CE_ID, key.to_owned()),
        (CE_SOURCE, source),
        (CE_TYPE, ce_type.to_owned()),
        (
            CE_TIME,
            origin.at.to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
        (CE_SUBJECT, origin.run_id.to_owned()),
        (CONTENT_TYPE, "application/json".to_owned()),
    ];
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_owned(), Value::String(value)))
        .collect()
}
