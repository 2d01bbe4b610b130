//! Kafka clients with explicit settings, and topic administration.
//!
//! Ductor states every librdkafka setting it depends on instead of trusting
//! defaults; the user's pass-through properties are applied last so that
//! production deployments can add SASL/TLS or tune anything.
//!
//! In: the `kafka` configuration. Out: consumers, producers and an admin
//! client; created topics; the input topics' partition counts and their
//! [`Copartition`] verdict. Guarantees: every producer sets
//! [`PRODUCER_GUARANTEES`], every group consumer [`CONSUMER_GUARANTEES`]
//! after the operator's properties (the configuration refuses properties
//! that would change either); counts that cannot be read are
//! [`Copartition::Unknown`], never a pass.

use std::time::Duration;

use anyhow::{Context, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::FutureProducer;

use crate::config::{CONSUMER_GUARANTEES, Config, KafkaConfig, PRODUCER_GUARANTEES};

fn base_config(kafka: &KafkaConfig, role: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka.bootstrap_servers)
        .set("client.id", format!("{}-{role}", kafka.client_id))
        // Surface broker-down conditions as errors instead of silent retries.
        .set("socket.keepalive.enable", "true")
        .set("reconnect.backoff.ms", "100")
        .set("reconnect.backoff.max.ms", "5000")
        .set("log.connection.close", "false");
    for (key, value) in kafka.properties.iter() {
        cfg.set(key, value);
    }
    cfg
}

/// A consumer that reads `group_id`'s committed offsets and the topics'
/// offsets, and never joins the group or commits: `assign`-free, for
/// looking at the coordinator's progress from outside it.
pub fn offsets_reader_config(kafka: &KafkaConfig, group_id: &str, role: &str) -> ClientConfig {
    let mut cfg = base_config(kafka, role);
    cfg.set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    with_consumer_properties(cfg, kafka)
}

/// A client that only reads the brokers' metadata: no group, no
/// subscription, no polling thread. A request of its own does not queue
/// on the broker behind a consumer's long-polling fetch (a broker answers
/// one connection's requests in order), so a read on the ingress's path
/// is as quick as the broker.
pub fn metadata_reader_config(kafka: &KafkaConfig, role: &str) -> ClientConfig {
    base_config(kafka, role)
}

/// `kafka.consumer_properties` over what Ductor set: the operator's word
/// wins.
fn with_consumer_properties(mut cfg: ClientConfig, kafka: &KafkaConfig) -> ClientConfig {
    for (key, value) in kafka.consumer_properties.iter() {
        cfg.set(key, value);
    }
    cfg
}

/// The coordinator's ingress consumer: manual offset store, stored offsets
/// auto-committed in the background. Offsets are stored only after the
/// Postgres transaction that applied the messages has committed.
pub fn consumer_config(kafka: &KafkaConfig, group_id: &str, role: &str) -> ClientConfig {
    let mut cfg = base_config(kafka, role);
    cfg.set("group.id", group_id)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
        .set(
            "max.poll.interval.ms",
            kafka.max_poll_interval_ms.to_string(),
        )
        .set("fetch.wait.max.ms", kafka.fetch_max_wait_ms.to_string())
        .set("fetch.min.bytes", "1")
        .set("queued.max.messages.kbytes", "65536");
    // Co-partitioning: partition p of every input topic goes to one
    // member, so all of a run's inputs reach one process and one apply
    // lane (p % apply_lanes). The range assignor gives this for topics of
    // equal partition counts, which `serve` and `topics create` check (see
    // `copartition_error`); its rebalances are eager (every member gives
    // back all its partitions), which the ingress survives because offsets
    // are stored only after the commit. These and the other settings of
    // CONSUMER_GUARANTEES come last, and `Config::validate` refuses
    // properties that would change them.
    let mut cfg = with_consumer_properties(cfg, kafka);
    for (key, value) in CONSUMER_GUARANTEES {
        cfg.set(key, value);
    }
    cfg
}

/// An idempotent producer: `enable.idempotence=true`, `acks=all`, and one
/// request in flight per connection, so retries neither duplicate nor
/// reorder within a partition and a successful delivery report means the
/// message is in the log.
///
/// One in flight, not librdkafka's five: when a request fails in a way that
/// leaves its messages' fate unknown (a dropped connection, a timeout) and a
/// later request of the same partition succeeds, librdkafka concludes that
/// the first request was written too and reports its messages delivered. The
/// broker makes that conclusion wrong for a producer id it has no state for
/// yet, such as one taken just after a broker restart: it accepts the first
/// batch it sees at whatever sequence number it starts. The outbox would then
/// mark an effect completed that is in no log. With one request in flight
/// nothing later is sent before the uncertain request is retried, at its own
/// sequence numbers. On one broker with `linger.ms` batching this cost no
/// measurable latency in `ductor-bench`.
pub fn producer_config(kafka: &KafkaConfig, role: &str) -> ClientConfig {
    let mut cfg = base_config(kafka, role);
    for (key, value) in PRODUCER_GUARANTEES {
        cfg.set(key, value);
    }
    // A run's inputs must share one partition number whoever produces
    // them: the Java client's hash (contract::partition).
    cfg.set("partitioner", crate::contract::partition::PARTITIONER);
    cfg.set("retries", "2147483647")
        .set("linger.ms", kafka.linger_ms.to_string())
        .set("compression.type", "lz4")
        .set("message.max.bytes", kafka.message_max_bytes.to_string())
        .set("request.timeout.ms", kafka.request_timeout_ms.to_string())
        .set("message.timeout.ms", kafka.delivery_timeout_ms.to_string())
        .set("queue.buffering.max.messages", "100000");
    for (key, value) in kafka.producer_properties.iter() {
        cfg.set(key, value);
    }
    cfg
}

pub fn producer(kafka: &KafkaConfig, role: &str) -> anyhow::Result<FutureProducer> {
    producer_config(kafka, role)
        .create()
        .context("creating kafka producer")
}

/// A producer made on its first use, then kept.
///
/// Every librdkafka producer has a thread of its own that polls for its
/// delivery reports in waits of 100 ms, and the client library spins
/// through the last millisecond of each wait for want of a finer timeout:
/// about 1 % of a core per producer, with nothing to send (measured with
/// `ductor-idle`). A serve keeps one producer made at start, the drainer's;
/// the others (dead letters and their replays, an effect sent alone after
/// a failure, the API's inputs) are made when their work first comes.
/// The configuration is checked when this is built, so a bad property
/// still stops `serve` at start.
#[derive(Clone)]
pub struct LazyProducer {
    config: ClientConfig,
    made: std::sync::Arc<std::sync::Mutex<Option<FutureProducer>>>,
}

impl LazyProducer {
    pub fn new(config: ClientConfig) -> anyhow::Result<LazyProducer> {
        config
            .create_native_config()
            .context("checking a kafka producer's configuration")?;
        Ok(LazyProducer {
            config,
            made: std::sync::Arc::default(),
        })
    }

    /// The producer, made now if this is its first use.
    pub fn get(&self) -> anyhow::Result<FutureProducer> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(producer) = made.as_ref() {
            return Ok(producer.clone());
        }
        let producer: FutureProducer = self.config.create().context("creating kafka producer")?;
        *made = Some(producer.clone());
        Ok(producer)
    }

    /// Whether the producer has been made.
    #[cfg(test)]
    fn is_made(&self) -> bool {
        self.made
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

pub fn admin(kafka: &KafkaConfig) -> anyhow::Result<AdminClient<DefaultClientContext>> {
    base_config(kafka, "admin")
        .create()
        .context("creating kafka admin client")
}

/// What `ensure_topics` did with each topic.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TopicOutcome {
    pub topic: String,
    pub created: bool,
}

/// Creates the given topics with the configured partition count and
/// replication factor; topics that already exist are left as they are.
pub async fn ensure_topics(
    kafka: &KafkaConfig,
    topics: &[String],
    partitions: i32,
) -> anyhow::Result<Vec<TopicOutcome>> {
    ensure_topics_with(kafka, topics, partitions, &[]).await
}

/// [`ensure_topics`], the topics it creates given the topic-level
/// `settings` (one that exists is left as it is).
pub async fn ensure_topics_with(
    kafka: &KafkaConfig,
    topics: &[String],
    partitions: i32,
    settings: &[(&str, &str)],
) -> anyhow::Result<Vec<TopicOutcome>> {
    let admin = admin(kafka)?;
    let new_topics: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            settings.iter().fold(
                NewTopic::new(
                    t,
                    partitions,
                    TopicReplication::Fixed(kafka.replication_factor),
                ),
                |topic, (key, value)| topic.set(key, value),
            )
        })
        .collect();
    let opts = AdminOptions::new()
        .operation_timeout(Some(Duration::from_millis(kafka.admin_timeout_ms)))
        .request_timeout(Some(Duration::from_millis(kafka.admin_timeout_ms)));
    let results = admin
        .create_topics(new_topics.iter(), &opts)
        .await
        .context("creating topics")?;
    let mut outcomes = Vec::with_capacity(results.len());
    for result in results {
        match result {
            Ok(topic) => outcomes.push(TopicOutcome {
                topic,
                created: true,
            }),
            Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => outcomes.push(TopicOutcome {
                topic,
                created: false,
            }),
            Err((topic, code)) => bail!("creating topic {topic}: {code}"),
        }
    }
    let (client, names) = (kafka.clone(), topics.to_vec());
    tokio::task::spawn_blocking(move || await_in_metadata(&client, &names))
        .await
        .context("waiting for the topics' metadata")??;
    Ok(outcomes)
}

/// Waits (up to `kafka.admin_timeout_ms`) until the broker's metadata shows
/// each of `topics` with its partitions: a broker answers CreateTopics once
/// the controller has the topic, and its own metadata, which producers,
/// consumers and the partition-count checks read, follows a moment later.
fn await_in_metadata(kafka: &KafkaConfig, topics: &[String]) -> anyhow::Result<()> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = base_config(kafka, "metadata")
        .create()
        .context("creating kafka metadata client")?;
    let timeout = Duration::from_millis(kafka.admin_timeout_ms);
    let deadline = std::time::Instant::now() + timeout;
    for topic in topics {
        loop {
            let md = consumer
                .fetch_metadata(Some(topic), timeout)
                .with_context(|| format!("fetching the metadata of {topic}"))?;
            let visible = md.topics().iter().any(|t| {
                t.name() == topic
                    && t.error().is_none()
                    && !t.partitions().is_empty()
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            });
            if visible {
                break;
            }
            if std::time::Instant::now() >= deadline {
                bail!(
                    "topic {topic} exists but the broker's metadata does not show it after {} ms \
                     (kafka.admin_timeout_ms)",
                    kafka.admin_timeout_ms
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Deletes the given topics. One that does not exist is not an error (it was
/// never created, or is already gone); any other failure names its topics.
#[cfg(any(test, feature = "internals"))]
pub async fn delete_topics(kafka: &KafkaConfig, topics: &[String]) -> anyhow::Result<()> {
    let admin = admin(kafka)?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let timeout = Duration::from_millis(kafka.admin_timeout_ms);
    let opts = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let failed: Vec<String> = admin
        .delete_topics(&names, &opts)
        .await
        .context("deleting topics")?
        .into_iter()
        .filter_map(|result| match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => None,
            Err((topic, code)) => Some(format!("{topic}: {code}")),
        })
        .collect();
    if !failed.is_empty() {
        bail!("deleting topics: {}", failed.join(", "));
    }
    Ok(())
}

/// The topics (of `topics`) that take smaller records than Ductor's
/// producers may send (`kafka.message_max_bytes`), with their
/// `max.message.bytes`: an effect or a dead letter within the producer's
/// limit would be refused there. A topic that does not exist yet is
/// skipped; `Err` when the broker could not be asked.
pub async fn topics_below_limit(
    kafka: &KafkaConfig,
    topics: &[String],
) -> anyhow::Result<Vec<(String, u64)>> {
    let admin = admin(kafka)?;
    let timeout = Duration::from_millis(kafka.admin_timeout_ms);
    let opts = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let specs: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let results = admin
        .describe_configs(specs.iter(), &opts)
        .await
        .context("describing topic configurations")?;
    let mut small = Vec::new();
    for (topic, result) in topics.iter().zip(results) {
        let limit = match result {
            Ok(resource) => resource
                .get("max.message.bytes")
                .and_then(|e| e.value.as_deref())
                .and_then(|v| v.parse::<u64>().ok()),
            Err(RDKafkaErrorCode::UnknownTopicOrPartition) => None,
            Err(code) => bail!("describing topic {topic}: {code}"),
        };
        if let Some(limit) = limit.filter(|l| *l < kafka.message_max_bytes) {
            small.push((topic.clone(), limit));
        }
    }
    Ok(small)
}

/// The partition count of each of `topics` that exists.
pub fn partition_counts(
    kafka: &KafkaConfig,
    topics: &[String],
) -> anyhow::Result<Vec<(String, i32)>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = base_config(kafka, "metadata")
        .create()
        .context("creating kafka metadata client")?;
    let timeout = Duration::from_millis(kafka.admin_timeout_ms);
    let mut counts = Vec::with_capacity(topics.len());
    for topic in topics {
        let md = consumer
            .fetch_metadata(Some(topic), timeout)
            .with_context(|| format!("fetching the metadata of {topic}"))?;
        if let Some(t) = md
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none())
        {
            counts.push((topic.clone(), t.partitions().len() as i32));
        }
    }
    Ok(counts)
}

/// Why the input topics cannot be co-partitioned, if they cannot: their
/// partition counts differ, so partition p of one topic and of another
/// would not carry the same runs and could go to different processes,
/// two writers of one run.
pub fn copartition_error(counts: &[(String, i32)]) -> Option<String> {
    let first = counts.first()?;
    if counts.iter().all(|(_, n)| *n == first.1) {
        return None;
    }
    let list: Vec<String> = counts
        .iter()
        .map(|(topic, n)| format!("{topic} has {n}"))
        .collect();
    Some(format!(
        "the input topics must have one partition count, so that partition p of each carries \
         the same runs and goes to one process (a single writer per run), but {}: add \
         partitions to the smaller ones (kafka-topics.sh --alter --partitions N) before \
         starting serve",
        list.join(", ")
    ))
}

/// What the partition counts of the input topics say of a single writer
/// per run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Copartition {
    /// One partition count: the ingress may consume.
    Passed,
    /// The counts differ and `kafka.require_copartitioned` refuses it.
    Refused(String),
    /// The counts differ, and `kafka.require_copartitioned = false` lets
    /// the ingress consume anyway (with a warning).
    Waived(String),
    /// The counts could not be read: the ingress must not consume yet.
    Unknown(String),
}

/// The verdict on the input topics' partition `counts` as read (or not).
pub fn copartition_verdict(
    counts: anyhow::Result<Vec<(String, i32)>>,
    require_copartitioned: bool,
) -> Copartition {
    match counts {
        Err(e) => Copartition::Unknown(format!("{e:#}")),
        Ok(counts) => match copartition_error(&counts) {
            None => Copartition::Passed,
            Some(why) if require_copartitioned => Copartition::Refused(why),
            Some(why) => Copartition::Waived(why),
        },
    }
}

/// The reason to refuse a configuration whose topics are `small`.
pub fn limits_error(kafka: &KafkaConfig, small: &[(String, u64)]) -> anyhow::Error {
    let list: Vec<String> = small
        .iter()
        .map(|(topic, limit)| format!("{topic} takes {limit}"))
        .collect();
    anyhow::anyhow!(
        "kafka.message_max_bytes is {} but {}: raise the topics' max.message.bytes or lower \
         kafka.message_max_bytes (and coordinator.max_input_bytes with it)",
        kafka.message_max_bytes,
        list.join(", ")
    )
}

/// Topic settings of the input topics `topics create` makes: each record
/// keeps the time the broker appended it, which a signature's window is
/// measured from (a copy produced later gets a later time, whatever its
/// producer claims).
pub const INPUT_TOPIC_SETTINGS: [(&str, &str); 1] = [("message.timestamp.type", "LogAppendTime")];

/// Creates every topic the configuration names, the input topics with
/// [`INPUT_TOPIC_SETTINGS`].
pub async fn create_configured_topics(config: &Config) -> anyhow::Result<Vec<TopicOutcome>> {
    let inputs = config.topic_names().inputs();
    let others: Vec<String> = config
        .all_topics()
        .into_iter()
        .filter(|t| !inputs.contains(t))
        .collect();
    let partitions = config.kafka.partitions;
    let mut outcomes =
        ensure_topics_with(&config.kafka, &inputs, partitions, &INPUT_TOPIC_SETTINGS).await?;
    outcomes.extend(ensure_topics(&config.kafka, &others, partitions).await?);
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::{Copartition, LazyProducer, copartition_error, copartition_verdict};
    use rdkafka::ClientConfig;
    use rdkafka::producer::Producer;

    #[test]
    fn a_lazy_producer_is_made_at_its_first_use_and_then_kept() {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "127.0.0.1:1");
        let lazy = LazyProducer::new(config).expect("a valid configuration");
        let copy = lazy.clone();
        assert!(!lazy.is_made(), "made before any use");
        let first = lazy.get().expect("made");
        assert!(
            lazy.is_made() && copy.is_made(),
            "clones share the producer"
        );
        let again = copy.get().expect("kept");
        assert!(
            std::ptr::eq(first.client().native_ptr(), again.client().native_ptr()),
            "a second use made another producer"
        );
    }

    #[test]
    fn a_lazy_producer_refuses_a_bad_property_when_built() {
        let mut config = ClientConfig::new();
        config.set("linger.ms", "not a number");
        let refused = LazyProducer::new(config).err().expect("refused");
        assert!(format!("{refused:#}").contains("linger.ms"), "{refused:#}");
    }

    #[test]
    fn counts_that_cannot_be_read_keep_the_ingress_from_consuming() {
        let unread = copartition_verdict(Err(anyhow::anyhow!("broker down")), true);
        assert!(
            matches!(&unread, Copartition::Unknown(why) if why.contains("broker down")),
            "{unread:?}"
        );
        assert!(matches!(
            copartition_verdict(Err(anyhow::anyhow!("timed out")), false),
            Copartition::Unknown(_)
        ));
        let equal = vec![("a".to_owned(), 3), ("b".to_owned(), 3)];
        assert_eq!(copartition_verdict(Ok(equal), true), Copartition::Passed);
        let unequal = vec![("a".to_owned(), 3), ("b".to_owned(), 2)];
        assert!(matches!(
            copartition_verdict(Ok(unequal.clone()), true),
            Copartition::Refused(_)
        ));
        assert!(matches!(
            copartition_verdict(Ok(unequal), false),
            Copartition::Waived(_)
        ));
    }

    #[test]
    fn input_topics_of_one_partition_count_are_co_partitioned() {
        let counts = |ns: &[i32]| -> Vec<(String, i32)> {
            ns.iter()
                .enumerate()
                .map(|(i, n)| (format!("t{i}"), *n))
                .collect()
        };
        assert_eq!(copartition_error(&counts(&[6, 6, 6])), None);
        assert_eq!(copartition_error(&[]), None);
        let why = copartition_error(&counts(&[6, 3, 6])).expect("refused");
        assert!(
            why.contains("t1 has 3") && why.contains("t0 has 6"),
            "{why}"
        );
    }
}
