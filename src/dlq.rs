//! The dead-letter topic. A dead letter keeps the original key, value and
//! headers, and adds headers that say where it came from and why it failed.
//! Publishing is retried until it succeeds or the process shuts down: the
//! input's offset is stored only after its dead letter is acknowledged.

use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

/// Where in the pipeline the input failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
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

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Decode => "decode",
            Stage::Validate => "validate",
            Stage::Route => "route",
            Stage::Apply => "apply",
        }
    }
}

pub struct DeadLetter<'a> {
    pub message: &'a OwnedMessage,
    pub stage: Stage,
    pub class: String,
    pub error: String,
}

impl<'a> DeadLetter<'a> {
    /// The dead letter of an input that the apply path isolated.
    pub fn isolated(message: &'a OwnedMessage, failure: &crate::store::ApplyFailure) -> Self {
        DeadLetter {
            message,
            stage: Stage::Apply,
            class: failure.class.to_string(),
            error: failure.message.clone(),
        }
    }
}

pub const HEADER_TOPIC: &str = "ductor-dlq-topic";
pub const HEADER_PARTITION: &str = "ductor-dlq-partition";
pub const HEADER_OFFSET: &str = "ductor-dlq-offset";
pub const HEADER_STAGE: &str = "ductor-dlq-stage";
pub const HEADER_CLASS: &str = "ductor-dlq-error-class";
pub const HEADER_MESSAGE: &str = "ductor-dlq-error";

pub struct DeadLetterPublisher {
    pub producer: FutureProducer,
    pub topic: String,
    /// Bound on the error message header.
    pub max_message_bytes: usize,
    pub timeout: Duration,
}

impl DeadLetterPublisher {
    pub async fn publish(
        &self,
        letter: &DeadLetter<'_>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let msg = letter.message;
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let error = truncate(&letter.error, self.max_message_bytes);
        let mut headers = OwnedHeaders::new();
        if let Some(original) = msg.headers() {
            for h in original.iter() {
                headers = headers.insert(Header {
                    key: h.key,
                    value: h.value,
                });
            }
        }
        let extra = [
            (HEADER_TOPIC, msg.topic()),
            (HEADER_PARTITION, partition.as_str()),
            (HEADER_OFFSET, offset.as_str()),
            (HEADER_STAGE, letter.stage.as_str()),
            (HEADER_CLASS, letter.class.as_str()),
            (HEADER_MESSAGE, error),
        ];
        for (key, value) in extra {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let send = || async {
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&self.topic).headers(headers.clone());
            if let Some(key) = msg.key() {
                record = record.key(key);
            }
            if let Some(payload) = msg.payload() {
                record = record.payload(payload);
            }
            self.producer
                .send(record, self.timeout)
                .await
                .map_err(|(e, _)| e)
        };
        send.retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_secs(5))
                .without_max_times(),
        )
        .when(|_| !shutdown.is_cancelled())
        .notify(|e, after| {
            tracing::warn!(error = %e, retry_in_ms = after.as_millis() as u64, "dead-letter publish failed, retrying")
        })
        .await
        .context("publishing dead letter")?;
        tracing::info!(
            topic = msg.topic(),
            partition = msg.partition(),
            offset = msg.offset(),
            stage = letter.stage.as_str(),
            class = %letter.class,
            "input dead-lettered"
        );
        metrics::counter!("ductor_dead_letters_total", "stage" => letter.stage.as_str(), "class" => letter.class.clone())
            .increment(1);
        Ok(())
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
