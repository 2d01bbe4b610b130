//! Canary `dispatch-before-commit`: a build that publishes a batch's
//! effects before the transaction that decides them commits. Only for
//! proving that the chaos checker notices.
//!
//! In: the intents of an attempt, before its commit. Out: each published
//! to its topic at once, with its key, headers and payload. Guarantees:
//! none, on purpose: a rolled-back or recomputed batch leaks effects that
//! no committed intent backs. Compiled only with the
//! `canary-dispatch-before-commit` feature.

use std::time::Duration;

use super::Applier;
use super::rows::IntentRow;

impl Applier {
    /// Canary: publishes the batch's effects before its transaction commits,
    /// so a rolled-back or recomputed batch leaks effects that no committed
    /// intent backs. Only for proving the chaos checker notices.
    pub(super) async fn canary_publish(&self, intents: &[IntentRow]) {
        use rdkafka::message::{Header, OwnedHeaders};
        let Some(producer) = &self.canary_producer else {
            return;
        };
        for intent in intents {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &intent.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: v.as_str().map(str::as_bytes),
                });
            }
            let record = rdkafka::producer::FutureRecord::to(&intent.topic)
                .key(&intent.message_key)
                .payload(&intent.payload)
                .headers(headers);
            let _ = producer.send(record, Duration::from_secs(5)).await;
        }
    }
}
