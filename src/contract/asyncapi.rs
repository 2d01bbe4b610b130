//! The topics as an AsyncAPI 3.1 document: each topic's address, the
//! messages on it with their key, headers and payload (by reference to the
//! JSON Schemas of [`super::schema`]), which side produces them, and the
//! ordering and partitioning rules. Written to `schemas/asyncapi.json` by
//! `ductor schemas`, beside the schemas it references, and held to them by
//! the same drift test.
//!
//! The document speaks from Ductor's side: an operation that `receive`s
//! is an input Ductor consumes (its users, workers and its own timers
//! produce it), one that `send`s is an effect Ductor publishes.
//!
//! In: the topic names ([`super::names`]), message types and header
//! schemas. Out: one JSON value. Guarantees: pure and deterministic; every
//! message type of [`super::schema::MESSAGE_TYPES`] is on a channel.

use serde_json::{Map, Value, json};

use super::names::TopicNames;
use super::partition::PARTITIONER;
use super::schema::message_path;

/// The path of the document under `schemas/`.
pub const PATH: &str = "asyncapi.json";

/// The Kafka bindings' version the document uses.
const KAFKA_BINDING: &str = "0.5.0";

const PARTITIONING: &str = "Every message that concerns a run is keyed by its `run_id`, and every \
producer puts it on partition `toPositive(murmur2(key)) % partitions` of its topic: the Java \
client's default partitioner (also Kafka Streams' and Kafka Connect's), which librdkafka calls \
`murmur2_random` (not its default, `consistent_random`, a CRC32). The input topics (requests, \
wakeups, attempt-results) must have the same number of partitions: the coordinator's group gives \
partition p of all three to one process, so a run's inputs have one writer and are applied in \
the order of their partition. An input on another partition is forwarded by the ingress to its \
run's partition once (headers `ductor-forwarded-from`, `ductor-forwards`); one forwarded \
`coordinator.max_input_forwards` times is dead-lettered as `misrouted`. Adding partitions to \
the input topics moves runs to other partitions: see the README, \"Beyond one box\".";

const ORDERING: &str = "Ordering: Kafka keeps the order of one partition, so of one run's messages \
on one topic. The coordinator does not depend on it: a duplicate or stale input writes nothing, \
and a result or wakeup is checked against the attempt stamp it names. Effects are published at \
least once, in the order of their run's transitions (`ductor-seq`), and a redelivery is \
byte-identical; consumers apply each `idempotency-key` once.";

struct Topic {
    id: &'static str,
    address: Option<String>,
    description: &'static str,
    messages: &'static [&'static str],
    /// Ductor's action on it: `receive` (an input) or `send` (an effect).
    action: &'static str,
    /// Who produces it.
    producers: &'static str,
    headers: &'static str,
}

/// What the wakeups topic carries.
const WAKEUP_MESSAGES: [&str; 4] = [
    "wakeup.timer",
    "wakeup.signal",
    "wakeup.cancel",
    "wakeup.retry",
];

fn topics() -> Vec<Topic> {
    let names = TopicNames {
        prefix: "{prefix}".into(),
    };
    vec![
        Topic {
            id: "requests",
            address: Some(names.requests()),
            description: "Run starts. A start with `run_id` creates that run; one without is routed: the routing plane decides its run once per `idempotency_key`.",
            messages: &["run.start"],
            action: "receive",
            producers: "Users' services and Ductor's HTTP API (`POST /v1/runs`).",
            headers: "input",
        },
        Topic {
            id: "wakeups",
            address: Some(names.wakeups()),
            description: "Durable timers, signals, cancels and retries of runs.",
            messages: &WAKEUP_MESSAGES,
            action: "receive",
            producers: "Ductor's outbox (timers, at their due time), users' services and the HTTP API (signals, cancels, retries).",
            headers: "input",
        },
        Topic {
            id: "attempt-results",
            address: Some(names.attempt_results()),
            description: "What a worker made of one attempt, naming the attempt's stamp.",
            messages: &["attempt.result"],
            action: "receive",
            producers: "Workers (Ductor's worker library, or any client that follows this contract).",
            headers: "input",
        },
        Topic {
            id: "steps",
            address: Some(names.steps("{pool}")),
            description: "The dispatches of one worker pool; `step_key` is the same for every attempt of a step (an external call's idempotency key).",
            messages: &["step.dispatch"],
            action: "send",
            producers: "Ductor's outbox.",
            headers: "effect",
        },
        Topic {
            id: "events",
            address: Some(names.events()),
            description: "Every run's lifecycle: one `run.event` per transition, `run.accepted` per routed decision, `run.effect_parked` per parked effect.",
            messages: &["run.event", "run.accepted", "run.effect_parked"],
            action: "send",
            producers: "Ductor's outbox.",
            headers: "effect",
        },
        Topic {
            id: "outputs",
            address: None,
            description: "A workflow's output topic (its definition's `output_topic`): one `run.output` when a run succeeds.",
            messages: &["run.output"],
            action: "send",
            producers: "Ductor's outbox.",
            headers: "effect",
        },
        Topic {
            id: "dlq",
            address: Some(names.dead_letters()),
            description: "Inputs that could not be applied: the original key, value and headers (compressed, and cut only when the broker refuses the letter whole; Ductor also records each letter, whole, in Postgres), and headers that say where each came from and why.",
            messages: &["dead-letter"],
            action: "send",
            producers: "Ductor's ingress.",
            headers: "dead-letter",
        },
    ]
}

/// The document.
pub fn document() -> Value {
    let mut channels = Map::new();
    let mut operations = Map::new();
    let mut messages = Map::new();
    for topic in &topics() {
        for &message in topic.messages {
            messages.insert(message.into(), message_entry(message, topic));
        }
        channels.insert(topic.id.into(), channel(topic));
        operations.insert(format!("{}-{}", topic.action, topic.id), operation(topic));
    }
    // Ductor also produces to one of its inputs: its timers, when due.
    operations.insert(
        "send-wakeups".into(),
        json!({
            "action": "send",
            "channel": { "$ref": "#/channels/wakeups" },
            "summary": "Ductor's outbox: each durable timer, at its due time.",
            "messages": [{ "$ref": "#/channels/wakeups/messages/wakeup.timer" }],
        }),
    );
    json!({
        "asyncapi": "3.1.0",
        "info": {
            "title": "Ductor",
            "version": env!("CARGO_PKG_VERSION"),
            "description": format!(
                "The Kafka topics of Ductor, a durable step orchestrator: what its users produce \
                 (requests, wakeups, attempt results) and what it publishes (dispatches, events, \
                 outputs, dead letters). Payloads are JSON (UTF-8) with a `type` and a \
                 `schema_version` (1).\n\n{PARTITIONING}\n\n{ORDERING}\n\nDuctor's own producers \
                 set `partitioner={PARTITIONER}`."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": { "messages": messages },
    })
}

fn channel(topic: &Topic) -> Value {
    let refs: Map<String, Value> = topic
        .messages
        .iter()
        .map(|&m| {
            let r = json!({ "$ref": format!("#/components/messages/{m}") });
            (m.to_owned(), r)
        })
        .collect();
    let mut parameters = Map::new();
    if let Some(address) = &topic.address {
        parameters.insert(
            "prefix".into(),
            json!({ "default": "ductor.", "description": "`kafka.topic_prefix`." }),
        );
        if address.contains("{pool}") {
            parameters.insert(
                "pool".into(),
                json!({ "description": "A worker pool named by a workflow's steps." }),
            );
        }
    }
    json!({
        "address": topic.address,
        "description": format!("{} Produced by: {}", topic.description, topic.producers),
        "messages": refs,
        "parameters": parameters,
    })
}

fn operation(topic: &Topic) -> Value {
    let messages: Vec<Value> = topic
        .messages
        .iter()
        .map(|m| json!({ "$ref": format!("#/channels/{}/messages/{m}", topic.id) }))
        .collect();
    json!({
        "action": topic.action,
        "channel": { "$ref": format!("#/channels/{}", topic.id) },
        "summary": topic.producers,
        "messages": messages,
    })
}

fn message_entry(message: &str, topic: &Topic) -> Value {
    let headers = json!({ "$ref": format!("./headers/{}.json", topic.headers) });
    if message == "dead-letter" {
        return json!({
            "name": "dead-letter",
            "title": "A dead letter",
            "summary": "The refused input, unchanged where it fits, with the dead-letter headers.",
            "headers": headers,
            "payload": {},
            "bindings": { "kafka": {
                "key": { "type": "string", "description": "The original input's key, when it fits." },
                "bindingVersion": KAFKA_BINDING,
            } },
        });
    }
    json!({
        "name": message,
        "title": message,
        "contentType": "application/json",
        "headers": headers,
        "payload": { "$ref": format!("./{}", message_path(message)) },
        "bindings": { "kafka": {
            "key": {
                "type": "string",
                "description": format!(
                    "The run's `run_id` (a routed `run.start`, which has none, may use any key). \
                     Partition: murmur2 of the key, as the Java client (`{PARTITIONER}`)."
                ),
            },
            "bindingVersion": KAFKA_BINDING,
        } },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::schema::MESSAGE_TYPES;

    #[test]
    fn every_message_type_is_on_a_channel() {
        let doc = document();
        for wire_type in MESSAGE_TYPES {
            let on: Vec<&String> = doc["channels"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(_, c)| c["messages"].get(wire_type).is_some())
                .map(|(id, _)| id)
                .collect();
            assert_eq!(on.len(), 1, "{wire_type} on {on:?}");
            assert_eq!(
                doc["components"]["messages"][wire_type]["payload"]["$ref"],
                format!("./messages/{wire_type}.json")
            );
        }
    }

    #[test]
    fn every_channel_has_the_operations_of_its_sides() {
        let doc = document();
        let operations = doc["operations"].as_object().unwrap();
        for id in doc["channels"].as_object().unwrap().keys() {
            let mut actions: Vec<&str> = operations
                .values()
                .filter(|o| o["channel"]["$ref"] == format!("#/channels/{id}"))
                .map(|o| o["action"].as_str().unwrap())
                .collect();
            actions.sort_unstable();
            let expected: &[&str] = match id.as_str() {
                "requests" | "attempt-results" => &["receive"],
                // Users' signals and cancels in, Ductor's timers out.
                "wakeups" => &["receive", "send"],
                _ => &["send"],
            };
            assert_eq!(actions, expected, "{id}");
        }
    }
}
