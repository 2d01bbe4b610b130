//! The contract as JSON Schemas (draft 2020-12): one for every message
//! Ductor reads or writes, and one for each set of headers it writes or
//! reads. They are generated from the contract's own types and constants
//! and committed under `schemas/` (`ductor schemas --out schemas`), where a
//! test fails when they drift from what this module generates.
//!
//! In: the contract's types ([`super::input::form`], [`super::effects`]) and
//! header names ([`super::headers`], [`super::signature`]). Out: the
//! [`catalogue`]: each schema with its path under `schemas/`. Guarantees:
//! pure and deterministic (the same build gives byte-identical files);
//! every message type of the contract has exactly one schema, named
//! `messages/<type>.json`.

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value, json};

use super::effects::{EffectParked, RunAccepted, RunEvent, RunOutput, StepDispatch};
use super::headers::{self as h, DeadLetterStage};
use super::input::form::{
    AttemptResultForm, CancelWakeupForm, RetryWakeupForm, RunStartForm, SignalWakeupForm,
    TimerWakeupForm,
};
use super::signature::SIGNATURE;

/// One schema and where it lives under `schemas/`.
#[derive(Debug, Clone, PartialEq)]
pub struct SchemaFile {
    /// Relative to `schemas/`, `/`-separated.
    pub path: String,
    pub schema: Value,
}

impl SchemaFile {
    /// The file's text: pretty JSON with a final newline.
    pub fn text(&self) -> String {
        let mut text = serde_json::to_string_pretty(&self.schema).unwrap_or_default();
        text.push('\n');
        text
    }
}

/// Every message type on the wire and who writes it, in the order the
/// catalogue lists them.
pub const MESSAGE_TYPES: [&str; 11] = [
    "run.start",
    "attempt.result",
    "wakeup.timer",
    "wakeup.signal",
    "wakeup.cancel",
    "wakeup.retry",
    "step.dispatch",
    "run.event",
    "run.output",
    "run.accepted",
    "run.effect_parked",
];

/// Every schema of the contract.
pub fn catalogue() -> Vec<SchemaFile> {
    let messages = [
        message::<RunStartForm<'_>>("run.start"),
        message::<AttemptResultForm<'_>>("attempt.result"),
        message::<TimerWakeupForm<'_>>("wakeup.timer"),
        message::<SignalWakeupForm<'_>>("wakeup.signal"),
        message::<CancelWakeupForm<'_>>("wakeup.cancel"),
        message::<RetryWakeupForm<'_>>("wakeup.retry"),
        message::<StepDispatch>("step.dispatch"),
        message::<RunEvent<'_>>("run.event"),
        message::<RunOutput<'_>>("run.output"),
        message::<RunAccepted<'_>>("run.accepted"),
        message::<EffectParked<'_>>("run.effect_parked"),
    ];
    let headers = [
        header_file("effect", effect_headers()),
        header_file("dead-letter", dead_letter_headers()),
        header_file("input", input_headers()),
    ];
    let asyncapi = SchemaFile {
        path: super::asyncapi::PATH.into(),
        schema: super::asyncapi::document(),
    };
    messages
        .into_iter()
        .chain(headers)
        .chain([asyncapi])
        .collect()
}

/// The path of message type `wire_type`'s schema under `schemas/`.
pub fn message_path(wire_type: &str) -> String {
    format!("messages/{wire_type}.json")
}

fn message<T: JsonSchema>(wire_type: &str) -> SchemaFile {
    let generator = SchemaGenerator::new(SchemaSettings::draft2020_12());
    let generated = generator.into_root_schema_for::<T>().to_value();
    let mut schema = with_type(wire_type, generated);
    if wire_type == "run.start" {
        either_run_or_key(&mut schema);
    }
    SchemaFile {
        path: message_path(wire_type),
        schema,
    }
}

/// A start names its run or is routed, never both: with a `run_id` that
/// is not `null`, the decoder refuses an `idempotency_key`, even `null`.
fn either_run_or_key(schema: &mut Value) {
    if let Value::Object(map) = schema {
        map.insert(
            "if".into(),
            json!({ "required": ["run_id"], "properties": { "run_id": { "type": "string" } } }),
        );
        map.insert(
            "then".into(),
            json!({ "not": { "required": ["idempotency_key"] } }),
        );
    }
}

/// The generated schema with its `type` field (a serde tag, which the
/// generator leaves out of a struct's properties) required first, and its
/// keys in reading order: `$schema`, `title`, `description`, then the rest.
fn with_type(wire_type: &str, generated: Value) -> Value {
    let Value::Object(mut generated) = generated else {
        return generated;
    };
    let mut properties = Map::new();
    properties.insert(
        "type".into(),
        json!({ "const": wire_type, "description": "The message's type." }),
    );
    if let Some(Value::Object(rest)) = generated.remove("properties") {
        properties.extend(rest);
    }
    let mut required = vec![Value::from("type")];
    if let Some(Value::Array(rest)) = generated.remove("required") {
        required.extend(rest);
    }
    let mut schema = Map::new();
    for key in ["$schema", "title", "description"] {
        if let Some(value) = generated.remove(key) {
            schema.insert(key.into(), value);
        }
    }
    schema.insert("title".into(), wire_type.into());
    schema.insert("type".into(), "object".into());
    schema.insert("properties".into(), Value::Object(properties));
    schema.insert("required".into(), Value::Array(required));
    schema.extend(generated);
    Value::Object(schema)
}

fn header_file(name: &str, schema: Value) -> SchemaFile {
    SchemaFile {
        path: format!("headers/{name}.json"),
        schema,
    }
}

/// Kafka header values are bytes; Ductor's are UTF-8 text, described here
/// as an object from header name to string.
fn headers_schema(
    title: &str,
    description: &str,
    properties: &[(&str, Value)],
    required: &[&str],
) -> Value {
    let props: Map<String, Value> = properties
        .iter()
        .map(|(name, schema)| ((*name).to_owned(), schema.clone()))
        .collect();
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "description": description,
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": { "type": "string" },
    })
}

fn text(description: &str) -> Value {
    json!({ "type": "string", "description": description })
}

fn effect_headers() -> Value {
    let props = [
        (
            h::IDEMPOTENCY_KEY,
            text(
                "The effect's deterministic key: the same on every redelivery of the effect. A consumer applies the effect once per key.",
            ),
        ),
        (h::RUN_ID, text("The run the record belongs to.")),
        (
            h::SEQ,
            json!({ "type": "string", "pattern": "^[0-9]+$", "description": "The transition (`last_transition_seq`) that made the effect." }),
        ),
        (h::TENANT, text("The run's tenant.")),
        (
            h::CE_SPECVERSION,
            json!({ "const": "1.0", "description": "CloudEvents, binary content mode." }),
        ),
        (h::CE_ID, text("Equal to the idempotency key.")),
        (
            h::CE_SOURCE,
            json!({ "type": "string", "pattern": "^/ductor/workflows/[A-Za-z0-9_.-]+/v[0-9]+$", "description": "`/ductor/workflows/<workflow>/v<version>`." }),
        ),
        (
            h::CE_TYPE,
            json!({ "enum": super::EffectKind::ALL.map(super::EffectKind::ce_type), "description": "`ductor.` and the payload's `type`." }),
        ),
        (
            h::CE_TIME,
            json!({ "type": "string", "format": "date-time", "description": "When the transition committed (RFC 3339, microseconds)." }),
        ),
        (h::CE_SUBJECT, text("The run id.")),
        (h::CONTENT_TYPE, json!({ "const": "application/json" })),
    ];
    let required: Vec<&str> = props.iter().map(|(name, _)| *name).collect();
    let traced = [
        (
            h::TRACEPARENT,
            json!({
                "type": "string",
                "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-0[0-3]$",
                "description": "Present on the effects of a traced run: W3C Trace Context, the run's trace id and the span of the transition that made the effect (version 00).",
            }),
        ),
        (h::TRACESTATE, tracestate()),
    ];
    let props: Vec<(&str, Value)> = props.into_iter().chain(traced).collect();
    headers_schema(
        "effect headers",
        "The headers of every record the outbox publishes (dispatches, events, timers, outputs).",
        &props,
        &required,
    )
}

/// A W3C `tracestate`, as Ductor carries it on.
fn tracestate() -> Value {
    json!({
        "type": "string",
        "maxLength": super::trace::MAX_TRACESTATE_LEN,
        "description": "W3C Trace Context: the vendors' entries that travel with traceparent, at most 512 bytes (a longer one loses whole entries).",
    })
}

fn dead_letter_headers() -> Value {
    let stages = DeadLetterStage::ALL.map(DeadLetterStage::as_str);
    let props = [
        (h::DLQ_TOPIC, text("The topic the input was read from.")),
        (
            h::DLQ_PARTITION,
            json!({ "type": "string", "pattern": "^[0-9]+$", "description": "Its partition." }),
        ),
        (
            h::DLQ_OFFSET,
            json!({ "type": "string", "pattern": "^[0-9]+$", "description": "Its offset." }),
        ),
        (
            h::DLQ_STAGE,
            json!({ "enum": stages, "description": "The stage that refused it." }),
        ),
        (
            h::DLQ_CLASS,
            json!({ "type": "string", "pattern": "^[a-z_]+$", "description": "The stable error class (README, \"Dead letters\")." }),
        ),
        (
            h::DLQ_MESSAGE,
            text("The bounded error message; never echoes the payload."),
        ),
        (
            h::DLQ_TRUNCATED,
            json!({ "type": "string", "pattern": "^[0-9]+$", "description": "Present when the value was cut to fit: the original's length in bytes." }),
        ),
        (
            h::DLQ_DROPPED,
            json!({ "enum": ["headers", "key", "headers,key"], "description": "Present when the original headers or key did not fit." }),
        ),
    ];
    headers_schema(
        "dead-letter headers",
        "The headers Ductor adds to a dead letter, after the original's own headers (kept when they fit).",
        &props,
        &[
            h::DLQ_TOPIC,
            h::DLQ_PARTITION,
            h::DLQ_OFFSET,
            h::DLQ_STAGE,
            h::DLQ_CLASS,
            h::DLQ_MESSAGE,
        ],
    )
}

fn input_headers() -> Value {
    let props = [
        (
            h::FORWARDED_FROM,
            json!({ "type": "string", "pattern": "^.+/[0-9]+/[0-9]+$", "description": "On an input the ingress moved to its run's partition: where it was read, `<topic>/<partition>/<offset>`." }),
        ),
        (
            h::FORWARDS,
            json!({ "type": "string", "pattern": "^[0-9]+$", "description": "On a forwarded input: how many times it has been forwarded." }),
        ),
        (
            h::REPLAY_ID,
            json!({ "type": "string", "format": "uuid", "description": "On an input an operator replayed from its recorded dead letter: the replay's id, the same on every copy of one replay. A start without run_id or idempotency_key is keyed by it instead of its offset." }),
        ),
        (
            SIGNATURE,
            json!({
                "type": "string",
                "pattern": "^(t=[0-9]+,v2=[0-9a-f]{64}|v1=[0-9a-f]{64})$",
                "description": "A tenant's signature, `t=<unix ms>,v2=<hex HMAC-SHA256 of \"<t>.\" and the value>`; required where the tenant's signatures are. Ductor's own timers carry `v1=<hex HMAC-SHA256 of the value>` under its timer key.",
            }),
        ),
        (
            h::TRACEPARENT,
            json!({
                "type": "string",
                "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$",
                "description": "Optional W3C Trace Context: the input's trace, which its run keeps (a start) or continues. A malformed one is ignored, never refused: the input is then applied untraced.",
            }),
        ),
        (h::TRACESTATE, tracestate()),
    ];
    headers_schema(
        "input headers",
        "The headers Ductor reads on an input (requests, wakeups, attempt results). Other headers are carried along and ignored.",
        &props,
        &[],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_type_has_one_schema_titled_by_its_type() {
        let files = catalogue();
        for wire_type in MESSAGE_TYPES {
            let matching: Vec<_> = files
                .iter()
                .filter(|f| f.path == message_path(wire_type))
                .collect();
            assert_eq!(matching.len(), 1, "{wire_type}");
            assert_eq!(matching[0].schema["title"], wire_type);
            assert_eq!(
                matching[0].schema["properties"]["type"]["const"], wire_type,
                "the schema's `type` is its message's"
            );
        }
    }

    #[test]
    fn every_effect_kind_has_a_message_schema() {
        for kind in super::super::EffectKind::ALL {
            assert!(MESSAGE_TYPES.contains(&kind.wire_type()), "{kind:?}");
        }
    }
}
