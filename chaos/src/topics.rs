//! Reading whole topics from the beginning, and the coordinator's consumer lag.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use ductor::config::KafkaConfig;

/// Bound on one metadata / watermark / offset request.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// One message as read back.
#[derive(Debug, Clone)]
pub struct Msg {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// In the order they were written.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Producer's create time, milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
}

impl Msg {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    }

    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A consumer that never joins a group: `assign` only, no commits.
fn consumer(kafka: &KafkaConfig, group_id: &str) -> anyhow::Result<BaseConsumer> {
    ductor_testkit::kafka::reader_config(kafka, group_id, "chaos")
        .create()
        .context("creating a kafka reader")
}

/// Partition count of `topic`; `None` when the topic does not exist.
fn partitions(consumer: &BaseConsumer, topic: &str) -> anyhow::Result<Option<i32>> {
    let md = consumer
        .fetch_metadata(Some(topic), KAFKA_TIMEOUT)
        .with_context(|| format!("fetching metadata of {topic}"))?;
    let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    if t.error().is_some() || t.partitions().is_empty() {
        return Ok(None);
    }
    Ok(Some(t.partitions().len() as i32))
}

/// Reads every message of `topics` from the beginning up to the high
/// watermarks taken at the start, with a fresh group that never commits.
/// Topics that do not exist are skipped (and named in the second value).
pub fn read_all(
    kafka: &KafkaConfig,
    topics: &[String],
    timeout: Duration,
) -> anyhow::Result<(Vec<Msg>, Vec<String>)> {
    let mut out = Vec::new();
    let missing = read_each(kafka, topics, timeout, |m| out.push(m))?;
    Ok((out, missing))
}

/// Messages of `topics` now, summed over partitions (high minus low
/// watermark); topics that do not exist count nothing.
pub fn message_count(kafka: &KafkaConfig, topics: &[String]) -> anyhow::Result<i64> {
    let consumer = consumer(kafka, "chaos-count")?;
    let mut count = 0;
    for topic in topics {
        let Some(n) = partitions(&consumer, topic)? else {
            continue;
        };
        for p in 0..n {
            let (low, high) = watermarks(&consumer, topic, p)?;
            count += (high - low).max(0);
        }
    }
    Ok(count)
}

/// Like [`read_all`], handing each message to `each` instead of keeping
/// them, so that a long topic is read in constant memory. Returns the
/// topics that do not exist.
pub fn read_each(
    kafka: &KafkaConfig,
    topics: &[String],
    timeout: Duration,
    mut each: impl FnMut(Msg),
) -> anyhow::Result<Vec<String>> {
    let group = format!("chaos-check-{}", uuid::Uuid::new_v4().simple());
    let consumer = consumer(kafka, &group)?;
    let Assignment { ends, tpl, missing } = assignment(&consumer, topics)?;
    if ends.is_empty() {
        return Ok(missing);
    }
    consumer.assign(&tpl).context("assigning partitions")?;
    let deadline = Instant::now() + timeout;
    let mut remaining = ends.len();
    let mut done: BTreeSet<(String, i32)> = BTreeSet::new();
    while remaining > 0 {
        if Instant::now() > deadline {
            bail!(
                "reading topics did not finish within {} s ({remaining} partitions short)",
                timeout.as_secs()
            );
        }
        let Some(result) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = match result {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "kafka error while reading topics");
                continue;
            }
        };
        let tp = (m.topic().to_string(), m.partition());
        let Some(&end) = ends.get(&tp) else { continue };
        // Written after we started: beyond what we promised to read.
        if m.offset() < end {
            each(msg_of(&m));
        }
        // The last message promised, or one beyond it: the partition is read.
        if m.offset() + 1 >= end && done.insert(tp) {
            remaining -= 1;
        }
    }
    Ok(missing)
}

/// What [`read_each`] reads: where each non-empty partition ends now (its
/// high watermark), the assignment that reads them from the beginning,
/// and the topics that do not exist.
struct Assignment {
    ends: BTreeMap<(String, i32), i64>,
    tpl: TopicPartitionList,
    missing: Vec<String>,
}

fn assignment(consumer: &BaseConsumer, topics: &[String]) -> anyhow::Result<Assignment> {
    let mut ends: BTreeMap<(String, i32), i64> = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    let mut missing = Vec::new();
    for topic in topics {
        let Some(n) = partitions(consumer, topic)? else {
            missing.push(topic.clone());
            continue;
        };
        for p in 0..n {
            let (low, high) = watermarks(consumer, topic, p)?;
            if high > low {
                ends.insert((topic.clone(), p), high);
                tpl.add_partition_offset(topic, p, Offset::Beginning)
                    .context("building the assignment")?;
            }
        }
    }
    Ok(Assignment { ends, tpl, missing })
}

/// One message as read back, headers in the order they were written.
fn msg_of(m: &BorrowedMessage<'_>) -> Msg {
    let headers = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    Msg {
        topic: m.topic().to_string(),
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().unwrap_or_default().to_vec(),
        headers,
        timestamp_ms: m.timestamp().to_millis(),
    }
}

/// Low and high watermark of one partition.
fn watermarks(consumer: &BaseConsumer, topic: &str, p: i32) -> anyhow::Result<(i64, i64)> {
    consumer
        .fetch_watermarks(topic, p, KAFKA_TIMEOUT)
        .with_context(|| format!("fetching watermarks of {topic}/{p}"))
}

/// Messages `group_id` has not committed past, summed over `topics`. A
/// partition without a committed offset counts all its messages.
pub fn group_lag(kafka: &KafkaConfig, group_id: &str, topics: &[String]) -> anyhow::Result<i64> {
    let consumer = consumer(kafka, group_id)?;
    let mut tpl = TopicPartitionList::new();
    let mut marks = BTreeMap::new();
    for topic in topics {
        let Some(n) = partitions(&consumer, topic)? else {
            continue;
        };
        for p in 0..n {
            marks.insert((topic.clone(), p), watermarks(&consumer, topic, p)?);
            tpl.add_partition(topic, p);
        }
    }
    if marks.is_empty() {
        return Ok(0);
    }
    let committed = consumer
        .committed_offsets(tpl, KAFKA_TIMEOUT)
        .context("fetching committed offsets")?;
    let mut lag = 0;
    for e in committed.elements() {
        let Some(&(low, high)) = marks.get(&(e.topic().to_string(), e.partition())) else {
            continue;
        };
        let pos = match e.offset() {
            Offset::Offset(o) => o.max(low),
            _ => low,
        };
        lag += (high - pos).max(0);
    }
    Ok(lag)
}

/// Deletes every topic whose name starts with the configured topic prefix,
/// and returns their names. Refuses the default prefix, which is the one a
/// real deployment uses.
pub async fn delete_prefixed(config: &ductor::config::Config) -> anyhow::Result<Vec<String>> {
    let prefix = config.kafka.topic_prefix.clone();
    anyhow::ensure!(
        prefix != "ductor." && !prefix.is_empty(),
        "refusing to delete the topics of the default prefix {prefix:?}"
    );
    let kafka = config.kafka.clone();
    let names: Vec<String> = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
        let consumer = consumer(&kafka, "chaos-delete-topics")?;
        let md = consumer
            .fetch_metadata(None, KAFKA_TIMEOUT)
            .context("fetching metadata")?;
        Ok(md
            .topics()
            .iter()
            .map(|t| t.name().to_string())
            .filter(|n| n.starts_with(&prefix))
            .collect())
    })
    .await
    .context("listing topics")??;
    if names.is_empty() {
        return Ok(names);
    }
    if let Err(e) = ductor::infra::kafka::delete_topics(&config.kafka, &names).await {
        tracing::warn!(error = %format!("{e:#}"), "deleting the run's topics failed");
    }
    Ok(names)
}
