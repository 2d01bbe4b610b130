//! The Kafka side of a round: publishing claimed intents and judging why
//! one was not.
//!
//! In: [`ClaimedIntent`]s, from a claim round or from the fast lane. Out:
//! the ids the broker acknowledged, and the [`Unpublished`] ones with their
//! [`Cause`]: transient, permanent, or not tried.
//!
//! Guarantees: the intents of one run and topic form a chain published in
//! (seq, effect_index) order, each publish waiting for its acknowledgement
//! before the next starts; after a failure the rest of the chain is not
//! tried. Every delivery of an intent carries the same record, its headers
//! in one order, so a redelivery is byte-identical to the first. An intent
//! that failed before goes out alone, on the solo producer, so that a
//! failure it meets is its own. Nothing here writes to the database.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::Utc;
use futures::future::join_all;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::Value;
use tracing::Instrument;

use super::{ClaimedIntent, Drainer};
use crate::contract::TraceContext;
use crate::contract::headers::{TRACEPARENT, TRACESTATE};
use crate::infra::traces;

/// An intent's headers in the order every delivery of it carries them:
/// by name, byte for byte. The stored `jsonb` object keeps its own key
/// order, and the fast lane holds the headers as they were built, so both
/// publish paths put them in this one order, and a redelivery is
/// byte-identical to the first delivery, headers and all.
pub(crate) fn ordered_headers(headers: &serde_json::Map<String, Value>) -> Vec<(String, String)> {
    let mut list: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    list.sort();
    list
}

/// Why a claimed intent was not published.
impl Drainer {
    /// Serve's signature of an input of its own (a timer, a child run's
    /// start, cancel or result), when it has a timer key: the same for
    /// every delivery of the intent (it covers the payload alone). Signed
    /// here rather than when the intent is written, so that inputs
    /// committed before the key was set are signed too.
    fn own_signature(&self, intent: &ClaimedIntent) -> Option<String> {
        let key = self.timer_key.as_ref()?;
        intent
            .headers
            .iter()
            .any(|(k, v)| {
                k == crate::contract::headers::CE_TYPE
                    && crate::contract::EffectKind::from_ce_type(v)
                        .is_some_and(crate::contract::EffectKind::is_own_input)
            })
            .then(|| crate::contract::signature::sign_timer(key.0.as_bytes(), &intent.payload))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The broker or the producer failed in a way that may pass (a broker
    /// away, a timeout, a leader election).
    Transient,
    /// It can never be published as it is: too large, its topic unknown or
    /// invalid, or not authorised.
    Permanent,
    /// Not tried: an earlier effect of its chain failed, or its claim was
    /// given back unused.
    NotTried,
}

impl Cause {
    /// Every cause: the failure counter starts each at zero.
    pub(crate) const ALL: [Cause; 3] = [Cause::Transient, Cause::Permanent, Cause::NotTried];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Cause::Transient => "transient",
            Cause::Permanent => "permanent",
            Cause::NotTried => "not_tried",
        }
    }
}

/// A claimed intent given back, and why.
#[derive(Debug, Clone)]
pub(super) struct Unpublished {
    pub(super) intent_id: i64,
    pub(super) error: String,
    pub(super) cause: Cause,
}

impl Unpublished {
    pub(super) fn new(intent_id: i64, error: impl Into<String>, cause: Cause) -> Self {
        Unpublished {
            intent_id,
            error: error.into(),
            cause,
        }
    }
}

/// Whether a publish failure can only repeat: the record is too large for
/// the producer or the broker, the topic does not exist or is invalid, or
/// the producer may not write it.
fn is_permanent(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::MessageBatchTooLarge
                | Code::InvalidRecord
                | Code::UnknownTopic
                | Code::UnknownTopicOrPartition
                | Code::InvalidTopic
                | Code::TopicAuthorizationFailed
        )
    )
}

/// The headers of an effect's record, as every delivery of it carries
/// them, and last the `signature` of a timer.
fn effect_headers(intent: &ClaimedIntent, signature: Option<&str>) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(intent.headers.len() + 1);
    for (k, v) in &intent.headers {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    if let Some(signature) = signature {
        headers = headers.insert(Header {
            key: crate::contract::signature::SIGNATURE,
            value: Some(signature.as_bytes()),
        });
    }
    headers
}

/// The record of an effect: its topic, key, payload and headers.
fn effect_record(
    intent: &ClaimedIntent,
    headers: OwnedHeaders,
) -> FutureRecord<'_, Vec<u8>, Vec<u8>> {
    FutureRecord::to(&intent.topic)
        .key(&intent.message_key)
        .payload(&intent.payload)
        .headers(headers)
}

/// Logs a delivered effect and measures how long its publish took and how
/// long after it was due it went out.
fn note_delivered(
    intent: &ClaimedIntent,
    delivery: &rdkafka::producer::future_producer::Delivery,
    started: Instant,
) {
    // Where the broker says the effect landed: with it, an effect that is
    // completed but missing from its topic can be looked for at its
    // partition and offset.
    tracing::debug!(
        intent_id = intent.intent_id,
        topic = %intent.topic,
        partition = delivery.partition,
        offset = delivery.offset,
        "effect delivered"
    );
    metrics::histogram!("ductor_outbox_publish_seconds").record(started.elapsed().as_secs_f64());
    let due = intent.not_before.max(intent.created_at);
    let lag = (Utc::now() - due).num_microseconds().unwrap_or(0).max(0);
    metrics::histogram!("ductor_outbox_dispatch_lag_seconds").record(lag as f64 / 1e6);
}

/// Logs and counts a failed publish, and says why the intent stays
/// undelivered: it and the rest of its chain go back to pending.
fn note_publish_failure(intent: &ClaimedIntent, e: rdkafka::error::KafkaError) -> Unpublished {
    let cause = if is_permanent(&e) {
        Cause::Permanent
    } else {
        Cause::Transient
    };
    tracing::warn!(
        intent_id = intent.intent_id,
        run_id = %intent.run_id,
        topic = %intent.topic,
        error = %e,
        cause = cause.as_str(),
        "publishing effect failed; it and the rest of its chain go back to pending"
    );
    metrics::counter!("ductor_outbox_publish_failures_total", "cause" => cause.as_str())
        .increment(1);
    Unpublished::new(intent.intent_id, e.to_string(), cause)
}

impl Drainer {
    /// Publishes `intents` as chains, one per (run, topic) in (seq,
    /// effect_index) order, the chains concurrently. Returns the delivered
    /// ids and the ids left undelivered with their reason.
    pub(super) async fn publish_all(
        &self,
        intents: &[ClaimedIntent],
    ) -> (Vec<i64>, Vec<Unpublished>) {
        let mut chains: BTreeMap<(&str, &str), Vec<&ClaimedIntent>> = BTreeMap::new();
        for intent in intents {
            chains
                .entry((intent.run_id.as_str(), intent.topic.as_str()))
                .or_default()
                .push(intent);
        }
        for chain in chains.values_mut() {
            chain.sort_by_key(|i| (i.seq, i.effect_index));
        }
        let turn = self.prompt.as_ref().map(|p| p.enter(intents.len()));
        let prompt = turn.as_ref().is_some_and(|t| t.prompt);
        let results = join_all(
            chains
                .into_values()
                .map(|chain| self.publish_chain(chain, prompt)),
        )
        .await;
        let mut delivered = Vec::new();
        let mut failed = Vec::new();
        for (ok, err) in results {
            delivered.extend(ok);
            failed.extend(err);
        }
        (delivered, failed)
    }

    /// Publishes a chain in order; returns (delivered, not delivered) ids.
    async fn publish_chain(
        &self,
        chain: Vec<&ClaimedIntent>,
        prompt: bool,
    ) -> (Vec<i64>, Vec<Unpublished>) {
        let mut delivered = Vec::with_capacity(chain.len());
        let mut failed = Vec::new();
        let mut iter = chain.into_iter();
        for intent in iter.by_ref() {
            match self.publish_one(intent, prompt).await {
                Ok(()) => delivered.push(intent.intent_id),
                Err(unpublished) => {
                    failed.push(unpublished);
                    break;
                }
            }
        }
        for rest in iter {
            failed.push(Unpublished::new(
                rest.intent_id,
                "an earlier effect of the chain failed",
                Cause::NotTried,
            ));
        }
        (delivered, failed)
    }

    /// Publishes one intent and waits for the broker's acknowledgement; an
    /// intent that failed before goes through the solo producer. A failure
    /// comes back as the reason it stays undelivered.
    async fn publish_one(&self, intent: &ClaimedIntent, prompt: bool) -> Result<(), Unpublished> {
        let span = publish_span(intent);
        self.publish_one_in(intent, prompt).instrument(span).await
    }

    async fn publish_one_in(
        &self,
        intent: &ClaimedIntent,
        prompt: bool,
    ) -> Result<(), Unpublished> {
        let signature = self.own_signature(intent);
        let headers = effect_headers(intent, signature.as_deref());
        let started = Instant::now();
        let sent = if intent.publish_failures > 0 {
            // One at a time, so that the batch it goes in is its own. A
            // solo producer that cannot be made leaves the shared one.
            let solo = self.solo.as_ref().and_then(|lazy| {
                lazy.get()
                    .inspect_err(|e| tracing::warn!(error = %e, "no solo producer"))
                    .ok()
            });
            let _one_at_a_time = self.solo_turn.lock().await;
            solo.as_ref()
                .unwrap_or(&self.producer)
                .send(effect_record(intent, headers), self.publish_timeout)
                .await
                .map_err(|(e, _)| e)
        } else if let Some(producer) = self.prompt.as_ref().filter(|_| prompt) {
            producer
                .send(&intent.topic, &intent.message_key, &intent.payload, headers)
                .await
        } else {
            self.producer
                .send(effect_record(intent, headers), self.publish_timeout)
                .await
                .map_err(|(e, _)| e)
        };
        match sent {
            Ok(delivery) => {
                note_delivered(intent, &delivery, started);
                Ok(())
            }
            Err(e) => Err(note_publish_failure(intent, e)),
        }
    }
}

/// The span of one publish, in the trace its headers carry: a child of
/// the transition that made the effect.
fn publish_span(intent: &ClaimedIntent) -> tracing::Span {
    let span = tracing::info_span!(
        target: traces::TARGET,
        parent: None,
        "publish",
        ductor.run_id = %intent.run_id,
        ductor.seq = intent.seq,
        ductor.effect_index = intent.effect_index,
        messaging.destination.name = %intent.topic,
    );
    if !span.is_disabled() {
        let values = |name: &'static str| {
            intent
                .headers
                .iter()
                .filter(move |(k, _)| k == name)
                .map(|(_, v)| v.as_bytes())
        };
        let carried = TraceContext::from_values(values(TRACEPARENT), values(TRACESTATE));
        traces::continue_from(&span, carried.as_ref());
    }
    span
}
