//! Inputs on a partition their run does not belong on, moved to the one it
//! does.
//!
//! A run has one writer only while all its inputs share one partition
//! number (see [`crate::contract::partition`]). A producer that hashes keys
//! another way (librdkafka's default CRC32), keys by something else than
//! the run, or wrote before the topic gained partitions puts an input
//! where another process may own its run. Such an input is not applied
//! here: it is produced again, unchanged, to its run's partition of the
//! same topic, with [`FORWARDED_FROM`] and [`FORWARDS`] added, and its
//! offset is stored once the broker has the copy.
//!
//! Forwarded rather than dead-lettered because forwarding is safe: the
//! copy is the same input (the same run, signal id, stamp or request), and
//! the coordinator applies an input once however many copies of it arrive,
//! so a crash between the copy's acknowledgement and the offset's store,
//! which makes a second copy, changes nothing; and it keeps a good input
//! from a user's producer out of the dead-letter topic. Only an input
//! forwarded `coordinator.max_input_forwards` times already (processes
//! that disagree on the partition count) is dead-lettered, as `misrouted`.
//!
//! In: a sorted batch and the input topics' partition counts. Out: the
//! misrouted inputs taken out of the batch, and their copies on the right
//! partitions. Guarantees: [`place`] is pure; a count that cannot be read
//! judges nothing (the input is applied where it is, as before); an input
//! is judged misrouted only by a count read at most a second before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::dead_letter::{DeadLetter, Stage};
use super::sort::Sorted;
use crate::config::KafkaConfig;
use crate::contract::InputErrorClass;
use crate::contract::headers::{FORWARDED_FROM, FORWARDS};
use crate::contract::partition::partition_for;

/// Where an input read from partition `partition` of a topic with
/// `partitions` partitions goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// It is on its run's partition: applied here.
    Here,
    /// Forwarded to partition `to`.
    Forward { to: i32 },
    /// Forwarded too often already: dead-lettered as `misrouted`.
    DeadLetter { to: i32 },
}

/// Where the input of run `run_id`, read at `partition` and forwarded
/// `forwards` times so far, goes: pure.
pub fn place(
    run_id: &str,
    partition: i32,
    partitions: i32,
    forwards: u32,
    max_forwards: u32,
) -> Placement {
    let to = partition_for(run_id.as_bytes(), partitions);
    if to == partition {
        Placement::Here
    } else if forwards >= max_forwards {
        Placement::DeadLetter { to }
    } else {
        Placement::Forward { to }
    }
}

/// How many times `msg` says it was forwarded (0 without the header, or
/// with one that is not a number).
pub fn forwards_of(msg: &OwnedMessage) -> u32 {
    msg.headers()
        .and_then(|h| h.iter().find(|h| h.key == FORWARDS))
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// An input to move, with the partition it belongs on.
pub(super) struct Misrouted<'m> {
    pub message: &'m OwnedMessage,
    pub to: i32,
}

/// The input topics' partition counts, read from the broker's metadata
/// and kept for `coordinator.partition_count_refresh_ms`.
pub struct PartitionCounts {
    client: Arc<BaseConsumer>,
    refresh: Duration,
    timeout: Duration,
    known: Mutex<HashMap<String, (i32, Instant)>>,
}

/// A count read this recently judges a misrouted input.
const FRESH_FOR_JUDGING: Duration = Duration::from_secs(1);

impl PartitionCounts {
    /// Counts read through a metadata reader of their own
    /// ([`crate::infra::kafka::metadata_reader_config`]): not the ingress's
    /// consumer, whose long-polling fetch a read would wait behind, nor a
    /// producer, whose polling thread costs CPU at idle (see
    /// [`crate::infra::kafka::LazyProducer`]). Each read waits at most
    /// `kafka.request_timeout_ms`.
    pub fn new(kafka: &KafkaConfig, refresh: Duration) -> anyhow::Result<Self> {
        let client = crate::infra::kafka::metadata_reader_config(kafka, "partition-counts")
            .create()
            .context("creating the partition-count reader")?;
        Ok(Self {
            client: Arc::new(client),
            refresh,
            timeout: Duration::from_millis(kafka.request_timeout_ms),
            known: Mutex::default(),
        })
    }

    /// The count of `topic`, read again when older than `max_age`; the
    /// last one known (or none) when the broker cannot say.
    async fn count(&self, topic: &str, max_age: Duration) -> Option<(i32, Instant)> {
        let known = self.lock().get(topic).copied();
        if let Some((count, at)) = known
            && at.elapsed() <= max_age
        {
            return Some((count, at));
        }
        let client = self.client.clone();
        let (name, timeout) = (topic.to_owned(), self.timeout);
        let read = tokio::task::spawn_blocking(move || {
            let metadata = client.fetch_metadata(Some(&name), timeout)?;
            Ok::<_, rdkafka::error::KafkaError>(
                metadata
                    .topics()
                    .iter()
                    .find(|t| t.name() == name && t.error().is_none())
                    .map(|t| t.partitions().len() as i32)
                    .filter(|&n| n > 0),
            )
        })
        .await;
        match read {
            Ok(Ok(Some(count))) => {
                let at = Instant::now();
                self.lock().insert(topic.to_owned(), (count, at));
                Some((count, at))
            }
            other => {
                tracing::warn!(topic, result = ?other.map(|r| r.map(|_| ())), "partition count not read; inputs are applied where they are");
                known
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (i32, Instant)>> {
        self.known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Takes the inputs of `sorted` that are not on their run's partition out
/// of it: those to forward are returned, those forwarded too often become
/// its dead letters.
pub(super) async fn take_misrouted<'m>(
    counts: &PartitionCounts,
    max_forwards: u32,
    sorted: &mut Sorted<'m>,
) -> Vec<Misrouted<'m>> {
    let mut misrouted = Vec::new();
    let mut at = 0;
    while at < sorted.pending.len() {
        let msg = sorted.pending_msgs[at];
        let run_id = sorted.pending[at].input.run_id();
        let placement = judge(counts, msg, run_id, max_forwards).await;
        if placement == Placement::Here {
            at += 1;
            continue;
        }
        sorted.pending.remove(at);
        sorted.pending_msgs.remove(at);
        match placement {
            Placement::Forward { to } => misrouted.push(Misrouted { message: msg, to }),
            Placement::DeadLetter { to } => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Validate,
                class: InputErrorClass::Misrouted.as_str().to_string(),
                error: format!(
                    "on partition {} but its run belongs on partition {to}, after {} forwards \
                     (coordinator.max_input_forwards)",
                    msg.partition(),
                    forwards_of(msg)
                ),
            }),
            Placement::Here => unreachable!("kept above"),
        }
    }
    misrouted
}

/// Where `msg` goes, by a count fresh enough to move it.
async fn judge(
    counts: &PartitionCounts,
    msg: &OwnedMessage,
    run_id: &str,
    max_forwards: u32,
) -> Placement {
    let forwards = forwards_of(msg);
    let Some((count, _)) = counts.count(msg.topic(), counts.refresh).await else {
        return Placement::Here;
    };
    let placement = place(run_id, msg.partition(), count, forwards, max_forwards);
    if placement == Placement::Here {
        return placement;
    }
    match counts.count(msg.topic(), FRESH_FOR_JUDGING).await {
        Some((fresh, at)) if at.elapsed() <= FRESH_FOR_JUDGING * 2 => {
            place(run_id, msg.partition(), fresh, forwards, max_forwards)
        }
        // Not confirmed by a fresh count: applied here, as before.
        _ => Placement::Here,
    }
}

/// Produces a copy of `m.message` to partition `m.to` of its topic, until
/// the broker acknowledges it or the process shuts down.
pub(super) async fn forward(
    producer: &FutureProducer,
    timeout: Duration,
    m: &Misrouted<'_>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let msg = m.message;
    let from = format!("{}/{}/{}", msg.topic(), msg.partition(), msg.offset());
    let count = (forwards_of(msg) + 1).to_string();
    let mut pause = Duration::from_millis(100);
    loop {
        let mut headers = OwnedHeaders::new();
        if let Some(own) = msg.headers() {
            for h in own
                .iter()
                .filter(|h| h.key != FORWARDS && h.key != FORWARDED_FROM)
            {
                headers = headers.insert(h);
            }
        }
        headers = headers
            .insert(Header {
                key: FORWARDED_FROM,
                value: Some(from.as_str()),
            })
            .insert(Header {
                key: FORWARDS,
                value: Some(count.as_str()),
            });
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(msg.topic())
            .partition(m.to)
            .headers(headers);
        if let Some(key) = msg.key() {
            record = record.key(key);
        }
        if let Some(payload) = msg.payload() {
            record = record.payload(payload);
        }
        let error = match producer.send(record, timeout).await {
            Ok(_) => {
                metrics::counter!("ductor_inputs_total", "topic" => msg.topic().to_string(), "outcome" => "forwarded")
                    .increment(1);
                return Ok(());
            }
            Err((e, _)) => e,
        };
        if shutdown.is_cancelled() {
            return Err(anyhow::Error::new(error).context("forwarding a misrouted input"));
        }
        tracing::warn!(error = %error, retry_in_ms = pause.as_millis() as u64, "forwarding a misrouted input failed, retrying");
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                return Err(anyhow::Error::new(error).context("forwarding a misrouted input"));
            }
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_on_its_runs_partition_stays() {
        let home = partition_for(b"run-1", 12);
        assert_eq!(place("run-1", home, 12, 0, 2), Placement::Here);
        assert_eq!(place("run-1", home, 12, 9, 2), Placement::Here);
    }

    #[test]
    fn an_input_elsewhere_is_forwarded_until_the_limit() {
        let home = partition_for(b"run-1", 12);
        let elsewhere = (home + 1) % 12;
        assert_eq!(
            place("run-1", elsewhere, 12, 0, 2),
            Placement::Forward { to: home }
        );
        assert_eq!(
            place("run-1", elsewhere, 12, 1, 2),
            Placement::Forward { to: home }
        );
        assert_eq!(
            place("run-1", elsewhere, 12, 2, 2),
            Placement::DeadLetter { to: home }
        );
        assert_eq!(
            place("run-1", elsewhere, 12, 0, 0),
            Placement::DeadLetter { to: home }
        );
    }

    #[test]
    fn one_partition_has_no_wrong_one() {
        for i in 0..100 {
            assert_eq!(place(&format!("run-{i}"), 0, 1, 0, 0), Placement::Here);
        }
    }
}
