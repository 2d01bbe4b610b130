//! The dead-letter writer. A dead letter is recorded in Postgres
//! (`dead_letters`, owned by [`super::dead_letters`]) with its input's
//! whole value, and published to the dead-letter topic with the original
//! key, value and headers (all but its signature) and headers that say
//! where it came from and why it failed.
//!
//! In: the letters of a batch: each a message that failed, with the stage
//! that refused it ([`Stage`]), a class and an error. Out: one row per
//! letter, one record per letter on the topic, counted. Guarantees: an
//! input has one row per stage however often it is redelivered and
//! refused again; the batch's offsets are stored only after every letter's
//! row is committed and its record acknowledged; recording and publishing
//! are retried until they succeed or the process shuts down; the error is
//! bounded; a signed input's signature is never kept, so neither the topic
//! nor the table holds a signed input to replay.
//!
//! Postgres first, then the topic, then the offset. The row is the letter
//! an operator acts on (whole, replayable); the topic's copy is for
//! whoever reads Kafka. A crash after the row and before the topic's
//! acknowledgement redelivers the input, which finds its row (`ON CONFLICT
//! DO NOTHING` on the input's topic, partition, offset and stage) and is
//! published then. A crash after the acknowledgement and before the offset
//! is stored publishes it a second time: the table holds a letter once,
//! the topic at least once. The other order would leave a letter on the
//! topic only, for as long as Postgres is away.
//!
//! Size. librdkafka holds a record to its producer's `message.max.bytes`
//! when it is produced, before compressing it (key, value, headers and the
//! record's framing: `rd_kafka_msg_new0`), and fills a batch up to the
//! smaller of that and `batch.size`; the broker holds the compressed batch
//! to the topic's `max.message.bytes`. So an input that its producer
//! compressed can be on the topic although no producer limited to
//! `kafka.message_max_bytes` could send it uncompressed: a 2 MiB value of
//! one repeated byte is a few kilobytes of lz4. The dead-letter producer
//! therefore compresses (`dead_letters.compression`) and takes records up
//! to `dead_letters.max_value_bytes` plus `kafka.message_max_bytes`
//! ([`crate::config::Config::dead_letter_record_bytes`]): a letter is sent
//! whole, and the broker judges its compressed size. Small letters still
//! batch within `batch.size`. Only a letter the broker refuses is cut
//! ([`Fit`]: the value first, then the original headers, then the key),
//! first to `kafka.message_max_bytes`, which the topics take uncompressed
//! (serve checks their `max.message.bytes` at start), then harder by
//! quarters; the letter says what was cut, and its row keeps the value.

use std::time::Duration;

use anyhow::Context;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::dead_letters::{LetterRow, Refused, store};
use crate::config::Config;
use crate::infra::kafka::LazyProducer;

use crate::contract::headers::{
    DLQ_CLASS, DLQ_DROPPED, DLQ_MESSAGE, DLQ_OFFSET, DLQ_PARTITION, DLQ_STAGE, DLQ_TOPIC,
    DLQ_TRUNCATED,
};

/// Where in the pipeline the input failed: the contract names the stages.
pub use crate::contract::headers::DeadLetterStage as Stage;

pub struct DeadLetter<'a> {
    pub message: &'a OwnedMessage,
    pub stage: Stage,
    pub class: String,
    pub error: String,
}

impl<'a> DeadLetter<'a> {
    /// The dead letter of an input that the apply path isolated.
    pub fn isolated(message: &'a OwnedMessage, failure: &crate::apply::ApplyFailure) -> Self {
        DeadLetter {
            message,
            stage: Stage::Apply,
            class: failure.class.to_string(),
            error: failure.message.clone(),
        }
    }
}

/// What a record costs besides its key, value and header bytes (record
/// and batch framing, and a header's length fields), generously counted.
const RECORD_OVERHEAD_BYTES: usize = 512;
const HEADER_OVERHEAD_BYTES: usize = 16;

/// How much of an input its dead letter carries, so that the letter fits
/// the producer's `message.max.bytes` however large the input was (it may
/// have been compressed when it was sent, or have more headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    /// Bytes of the original value kept, from its start.
    pub value_bytes: usize,
    pub keep_headers: bool,
    pub keep_key: bool,
}

impl Fit {
    /// The cut for a letter of at most `max_record_bytes`. The value is cut
    /// first, then the original headers go, then the key.
    pub fn new(
        max_record_bytes: usize,
        own_headers: usize,
        key: usize,
        headers: usize,
        value: usize,
    ) -> Fit {
        let room = max_record_bytes.saturating_sub(RECORD_OVERHEAD_BYTES + own_headers);
        let (keep_headers, keep_key) = if key + headers <= room {
            (true, true)
        } else if key <= room {
            (false, true)
        } else {
            (false, false)
        };
        let used = usize::from(keep_key) * key + usize::from(keep_headers) * headers;
        Fit {
            value_bytes: value.min(room - used),
            keep_headers,
            keep_key,
        }
    }
}

/// The dead-letter producer of `config`, as `role`: Ductor's producer
/// (idempotent, the Java client's partitioner), compressed with
/// `dead_letters.compression`, taking records up to
/// [`Config::dead_letter_record_bytes`] before compression. A replay of a
/// recorded letter goes out through one too, so that an input that
/// reached the broker compressed goes back whole.
pub fn producer(config: &Config, role: &str) -> anyhow::Result<LazyProducer> {
    let mut producer = crate::infra::kafka::producer_config(&config.kafka, role);
    producer
        .set("compression.type", &config.dead_letters.compression)
        .set(
            "message.max.bytes",
            config.dead_letter_record_bytes().to_string(),
        );
    LazyProducer::new(producer).context("the dead-letter producer")
}

pub struct DeadLetterPublisher {
    /// Made at the first letter (see [`LazyProducer`]).
    pub producer: LazyProducer,
    pub topic: String,
    /// Where every letter is recorded first.
    pub pool: PgPool,
    /// Bound on the error message header.
    pub max_message_bytes: usize,
    /// The producer's `message.max.bytes`: a letter is sent whole up to it.
    pub max_record_bytes: usize,
    /// `kafka.message_max_bytes`: what a letter the broker refused is cut
    /// to first.
    pub cut_record_bytes: usize,
    /// `dead_letters.max_value_bytes`: what a row keeps of a value.
    pub max_value_bytes: usize,
    pub timeout: Duration,
}

impl DeadLetterPublisher {
    /// Records every letter of a batch in Postgres, then publishes each,
    /// each step retried until it holds or the process shuts down.
    pub async fn write(
        &self,
        letters: &[DeadLetter<'_>],
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        if letters.is_empty() {
            return Ok(());
        }
        let rows: Vec<LetterRow> = letters.iter().map(|l| self.row(l)).collect();
        self.record_until_stored(&rows, shutdown).await?;
        for letter in letters {
            self.publish(letter, shutdown).await?;
        }
        Ok(())
    }

    /// The row of `letter`.
    fn row(&self, letter: &DeadLetter<'_>) -> LetterRow {
        let msg = letter.message;
        let headers: Vec<(&str, Option<&[u8]>)> = msg
            .headers()
            .map(|hs| hs.iter().map(|h| (h.key, h.value)).collect())
            .unwrap_or_default();
        LetterRow::of(
            Refused {
                topic: msg.topic(),
                partition: msg.partition(),
                offset: msg.offset(),
                key: msg.key(),
                headers: &headers,
                value: msg.payload(),
            },
            letter.stage.as_str(),
            &letter.class,
            truncate(&letter.error, self.max_message_bytes),
            self.max_value_bytes,
        )
    }

    /// Inserts `rows` until Postgres has them (those recorded already, by
    /// an earlier delivery of their inputs, are left as they are).
    async fn record_until_stored(
        &self,
        rows: &[LetterRow],
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let mut pause = Duration::from_millis(100);
        loop {
            let error = match store::insert(&self.pool, rows).await {
                Ok(new) => {
                    if (new as usize) < rows.len() {
                        tracing::info!(
                            letters = rows.len(),
                            recorded_before = rows.len() - new as usize,
                            "dead letters of redelivered inputs were recorded already"
                        );
                    }
                    return Ok(());
                }
                Err(e) => e,
            };
            tracing::warn!(error = %error, retry_in_ms = pause.as_millis() as u64, "recording dead letters failed, retrying");
            if !pause_unless_shutdown(&mut pause, shutdown).await {
                return Err(anyhow::Error::new(error).context("recording dead letters"));
            }
        }
    }

    /// Publishes `letter`, retrying until the broker acknowledges it or the
    /// process shuts down, then counts it.
    async fn publish(
        &self,
        letter: &DeadLetter<'_>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let partition = letter.message.partition().to_string();
        let offset = letter.message.offset().to_string();
        let parts = Parts::new(letter, &partition, &offset, self.max_message_bytes);
        self.send_until_acknowledged(&parts, shutdown).await?;
        record_dead_letter(letter);
        Ok(())
    }

    /// Sends the letter until it is acknowledged: whole first; a letter
    /// refused for its size is cut at once, to `cut_record_bytes`, then by
    /// quarters; any other failure is retried with a growing pause, unless
    /// the process is shutting down.
    async fn send_until_acknowledged(
        &self,
        parts: &Parts<'_>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let mut max_record = self.max_record_bytes;
        let mut pause = Duration::from_millis(100);
        loop {
            let error = match self.send_once(parts, max_record).await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if is_too_large(&error) && max_record > RECORD_OVERHEAD_BYTES + parts.own_bytes {
                // The broker's limit on the compressed batch, or the
                // topic's below it: cut, down to the letter's own headers
                // alone.
                max_record = next_cut(max_record, self.cut_record_bytes);
                tracing::warn!(error = %error, max_record, "dead letter too large for the broker, cutting it");
                continue;
            }
            tracing::warn!(error = %error, retry_in_ms = pause.as_millis() as u64, "dead-letter publish failed, retrying");
            if !pause_unless_shutdown(&mut pause, shutdown).await {
                return Err(anyhow::Error::new(error).context("publishing dead letter"));
            }
        }
    }

    /// Sends the letter once, cut to fit `max_record` bytes.
    async fn send_once(
        &self,
        parts: &Parts<'_>,
        max_record: usize,
    ) -> Result<(), rdkafka::error::KafkaError> {
        let fit = parts.fit(max_record);
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).headers(parts.headers(fit));
        if fit.keep_key && parts.message.key().is_some() {
            record = record.key(parts.key);
        }
        if parts.message.payload().is_some() {
            record = record.payload(&parts.value[..fit.value_bytes]);
        }
        let producer = self
            .producer
            .get()
            .map_err(|e| KafkaError::ClientCreation(format!("{e:#}")))?;
        match producer.send(record, self.timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e),
        }
    }
}

/// The limit a letter refused at `max_record` bytes is tried at next: the
/// uncompressed size the topics take (`cut`), then a quarter each time.
fn next_cut(max_record: usize, cut: usize) -> usize {
    if max_record > cut {
        cut
    } else {
        max_record / 4
    }
}

/// Waits `pause`, doubled for the next time up to 5 s; false when the
/// process began shutting down (now or meanwhile).
async fn pause_unless_shutdown(pause: &mut Duration, shutdown: &CancellationToken) -> bool {
    if shutdown.is_cancelled() {
        return false;
    }
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => return false,
        _ = tokio::time::sleep(*pause) => {}
    }
    *pause = (*pause * 2).min(Duration::from_secs(5));
    true
}

/// A dead letter's parts, measured once for every cut that may be tried.
struct Parts<'a> {
    message: &'a OwnedMessage,
    /// The input's own headers.
    original: Vec<(&'a str, Option<&'a [u8]>)>,
    /// The headers that say where the input came from and why it failed.
    own: [(&'a str, &'a str); 6],
    /// What the own headers take, with the two that a cut adds.
    own_bytes: usize,
    /// What the input's own headers take.
    original_bytes: usize,
    key: &'a [u8],
    value: &'a [u8],
}

impl<'a> Parts<'a> {
    /// The parts of `letter`, whose input sat at `partition` and `offset`;
    /// its error message is cut to `max_message_bytes`.
    fn new(
        letter: &'a DeadLetter<'_>,
        partition: &'a str,
        offset: &'a str,
        max_message_bytes: usize,
    ) -> Self {
        let msg = letter.message;
        // Without its signature: a dead letter is read by whoever operates
        // the topic, and a signed copy there would be a message to replay.
        let original: Vec<(&str, Option<&[u8]>)> = msg
            .headers()
            .map(|hs| {
                hs.iter()
                    .filter(|h| h.key != crate::contract::signature::SIGNATURE)
                    .map(|h| (h.key, h.value))
                    .collect()
            })
            .unwrap_or_default();
        let own = [
            (DLQ_TOPIC, msg.topic()),
            (DLQ_PARTITION, partition),
            (DLQ_OFFSET, offset),
            (DLQ_STAGE, letter.stage.as_str()),
            (DLQ_CLASS, letter.class.as_str()),
            (DLQ_MESSAGE, truncate(&letter.error, max_message_bytes)),
        ];
        let own_bytes: usize = own
            .iter()
            .map(|(k, v)| header_bytes(k, v.len()))
            .sum::<usize>()
            + header_bytes(DLQ_TRUNCATED, 20)
            + header_bytes(DLQ_DROPPED, 11);
        let original_bytes: usize = original
            .iter()
            .map(|(k, v)| header_bytes(k, v.map_or(0, <[u8]>::len)))
            .sum();
        Parts {
            message: msg,
            original,
            own,
            own_bytes,
            original_bytes,
            key: msg.key().unwrap_or_default(),
            value: msg.payload().unwrap_or_default(),
        }
    }

    /// How much of the input a letter of at most `max_record` bytes keeps.
    fn fit(&self, max_record: usize) -> Fit {
        Fit::new(
            max_record,
            self.own_bytes,
            self.key.len(),
            self.original_bytes,
            self.value.len(),
        )
    }

    /// The letter's headers under `fit`: the input's own when kept, then
    /// where it came from and why it failed, then what the cut took away.
    fn headers(&self, fit: Fit) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new();
        if fit.keep_headers {
            for (key, value) in &self.original {
                headers = headers.insert(Header { key, value: *value });
            }
        }
        for (key, value) in self.own {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        if fit.value_bytes < self.value.len() {
            let truncated = self.value.len().to_string();
            headers = headers.insert(Header {
                key: DLQ_TRUNCATED,
                value: Some(truncated.as_bytes()),
            });
        }
        let (had_headers, had_key) = (!self.original.is_empty(), !self.key.is_empty());
        if let Some(dropped) = dropped(fit, had_headers, had_key) {
            headers = headers.insert(Header {
                key: DLQ_DROPPED,
                value: Some(dropped.as_bytes()),
            });
        }
        headers
    }
}

/// What a header of key `k` and a value of `v` bytes costs in a record.
fn header_bytes(k: &str, v: usize) -> usize {
    k.len() + v + HEADER_OVERHEAD_BYTES
}

/// What the `DLQ_DROPPED` header says `fit` left out of an input that had
/// headers (`had_headers`) and a key (`had_key`): nothing, when it kept
/// all that there was.
fn dropped(fit: Fit, had_headers: bool, had_key: bool) -> Option<&'static str> {
    match (fit.keep_headers || !had_headers, fit.keep_key || !had_key) {
        (true, true) => None,
        (false, true) => Some("headers"),
        (true, false) => Some("key"),
        (false, false) => Some("headers,key"),
    }
}

/// Logs and counts a dead letter the broker acknowledged.
fn record_dead_letter(letter: &DeadLetter<'_>) {
    let msg = letter.message;
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
}

/// Whether the producer or the broker refused a record for its size.
fn is_too_large(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(Code::MessageSizeTooLarge | Code::MessageBatchTooLarge | Code::InvalidRecord)
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 10_000;
    const OWN: usize = 300;

    fn size(fit: Fit, key: usize, headers: usize) -> usize {
        RECORD_OVERHEAD_BYTES
            + OWN
            + fit.value_bytes
            + usize::from(fit.keep_key) * key
            + usize::from(fit.keep_headers) * headers
    }

    #[test]
    fn a_refused_letter_is_cut_to_what_the_topics_take_then_by_quarters() {
        let whole = 17 << 20;
        let cut = 1 << 20;
        assert_eq!(next_cut(whole, cut), cut);
        assert_eq!(next_cut(cut, cut), cut / 4);
        assert_eq!(next_cut(cut / 4, cut), cut / 16);
    }

    #[test]
    fn the_dropped_header_names_only_what_there_was() {
        let cut = |keep_headers, keep_key| Fit {
            value_bytes: 0,
            keep_headers,
            keep_key,
        };
        assert_eq!(dropped(cut(true, true), true, true), None);
        assert_eq!(dropped(cut(false, true), true, true), Some("headers"));
        assert_eq!(dropped(cut(true, false), true, true), Some("key"));
        assert_eq!(dropped(cut(false, false), true, true), Some("headers,key"));
        assert_eq!(dropped(cut(false, false), false, false), None);
        assert_eq!(dropped(cut(false, false), true, false), Some("headers"));
    }

    #[test]
    fn a_letter_that_fits_keeps_everything() {
        let fit = Fit::new(MAX, OWN, 40, 200, 5_000);
        assert_eq!(
            fit,
            Fit {
                value_bytes: 5_000,
                keep_headers: true,
                keep_key: true
            }
        );
    }

    #[test]
    fn the_value_is_cut_first_then_the_headers_then_the_key() {
        let fit = Fit::new(MAX, OWN, 40, 200, 2 << 20);
        assert!(fit.keep_headers && fit.keep_key);
        assert_eq!(size(fit, 40, 200), MAX, "the value fills what is left");
        let fit = Fit::new(MAX, OWN, 40, 50_000, 2 << 20);
        assert!(!fit.keep_headers && fit.keep_key);
        assert_eq!(size(fit, 40, 50_000), MAX);
        let fit = Fit::new(MAX, OWN, 50_000, 50_000, 2 << 20);
        assert!(!fit.keep_headers && !fit.keep_key);
        assert_eq!(size(fit, 50_000, 50_000), MAX);
    }

    #[test]
    fn every_cut_fits_whatever_the_sizes() {
        for max in [0, 100, 900, 1_000, 10_000] {
            for key in [0, 10, 5_000, 20_000] {
                for headers in [0, 10, 5_000, 20_000] {
                    for value in [0, 1, 5_000, 2 << 20] {
                        let fit = Fit::new(max, OWN, key, headers, value);
                        assert!(fit.value_bytes <= value);
                        let room = max.saturating_sub(RECORD_OVERHEAD_BYTES + OWN);
                        assert!(
                            size(fit, key, headers) - RECORD_OVERHEAD_BYTES - OWN <= room,
                            "{max} {key} {headers} {value}: {fit:?}"
                        );
                    }
                }
            }
        }
    }
}
