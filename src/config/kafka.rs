//! The `[kafka]` section: the brokers, Ductor's topics, the consumer
//! group, and the settings of every client Ductor makes.
//!
//! In: the bootstrap servers, the topic prefix, the group, the partitions
//! and pools `ductor topics create` makes, the clients' timeouts and bounds,
//! and librdkafka properties passed through. Out: a [`KafkaConfig`] the
//! clients are built from. Guarantees: names are legal on the broker; the
//! producer settings a delivery report's truth rests on
//! ([`PRODUCER_GUARANTEES`]) and the consumer settings the single writer
//! and exactly-once rest on ([`CONSUMER_GUARANTEES`]) cannot be changed by
//! a pass-through property. The topics' names themselves are spelt by
//! [`crate::contract::names::TopicNames`].

use serde::{Deserialize, Serialize};

use super::{ConfigError, KafkaProperties, invalid};

/// The producer settings a delivery report's truth rests on, with the value
/// Ductor gives each; every producer Ductor makes sets them.
/// [`Config::validate`](super::Config::validate) refuses pass-through
/// properties that change them.
pub const PRODUCER_GUARANTEES: [(&str, &str); 3] = [
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "1"),
];

/// The consumer settings the single writer and exactly-once rest on, with
/// the value Ductor gives each; the ingress's consumer sets them and
/// [`Config::validate`](super::Config::validate) refuses pass-through
/// properties that change them:
/// - the range assignor over the classic group protocol gives partition p
///   of every input topic to one member (one writer per run); another
///   assignor, or the consumer protocol with its broker-side assignors,
///   may split a run's inputs between two processes;
/// - offsets are stored only after the transaction that applied them
///   committed; an automatic store would commit inputs never applied;
/// - inputs of aborted producer transactions are never applied.
pub const CONSUMER_GUARANTEES: [(&str, &str); 4] = [
    ("partition.assignment.strategy", "range"),
    ("group.protocol", "classic"),
    ("enable.auto.offset.store", "false"),
    ("isolation.level", "read_committed"),
];

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers` for every client.
    pub bootstrap_servers: String,
    /// Prefix of every topic Ductor owns: `<prefix>requests`,
    /// `<prefix>wakeups`, `<prefix>attempt-results`, `<prefix>steps.<pool>`,
    /// `<prefix>events`, `<prefix>dlq`.
    pub topic_prefix: String,
    /// `client.id` prefix; each client appends its role.
    pub client_id: String,
    /// Consumer group of the coordinator's ingress. Every `serve` process with
    /// the same group shares the input partitions.
    pub group_id: String,
    /// Static group membership of the ingress (`group.instance.id`): a
    /// name that stays the same across restarts of one `serve` (a pod's
    /// name, `serve-1`), unique in the group. A restarted `serve` then
    /// takes its partitions back at once, without a rebalance and without
    /// waiting out `session_timeout_ms`; one that does not come back has
    /// its partitions moved after `session_timeout_ms` (a clean stop
    /// included: a static member does not leave the group). The drainer
    /// records the name too: a restarted `serve` gives back at once the
    /// outbox claims its killed predecessor held, instead of after
    /// `drainer.member_timeout_ms`. Unset, the default: dynamic membership.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_instance_id: Option<String>,
    /// Refuse input topics of different partition counts (`serve` and
    /// `topics create`): only co-partitioned topics give each run one
    /// writer. `false` only warns, and leaves the optimistic lock alone to
    /// keep concurrent writers of a run apart (the chaos harness tests it
    /// so).
    #[serde(default = "yes")]
    pub require_copartitioned: bool,
    /// Partition count used by `ductor topics create`. It is the most
    /// consumers of a topic that can work at once: the coordinator's apply
    /// lanes over all `serve` processes, and the worker processes of each
    /// step pool. Raise it before creating the topics when more of them
    /// should share the work. Every partition also costs requests: librdkafka
    /// sends one produce request per partition, so traffic spread over more
    /// partitions than its consumers need pays the broker's cost per request
    /// more often. Measured with `ductor-bench --latency-at R --loads 50` on
    /// two cores, in six interleaved pairs at 2330-2800 inputs/s, two
    /// partitions (one per default apply lane) against six: Kafka used about
    /// 0.12 cores less in every pair, p99 was lower in every pair (48-118 ms
    /// against 102-213 ms), and capacity did not change (6337 and 6567
    /// inputs/s against 6692 and 6267).
    pub partitions: i32,
    /// Replication factor used by `ductor topics create`.
    pub replication_factor: i32,
    /// Step pools whose `<prefix>steps.<pool>` topics `topics create` makes.
    pub step_pools: Vec<String>,
    /// Further topics `topics create` makes (workflow output topics).
    pub extra_topics: Vec<String>,
    /// `session.timeout.ms` of the consumers.
    pub session_timeout_ms: u64,
    /// `max.poll.interval.ms` of the consumers.
    pub max_poll_interval_ms: u64,
    /// `fetch.wait.max.ms` of the consumers: how long the broker may hold a
    /// fetch open waiting for data, i.e. the idle latency floor.
    pub fetch_max_wait_ms: u64,
    /// `linger.ms` of the producers.
    pub linger_ms: u64,
    /// A round of at most this many publishes of the drainer (or one
    /// result of a worker) that starts with nothing else of theirs in
    /// flight, more than `prompt_after_ms` after their last round, goes out
    /// at once, on a producer without linger, instead of waiting up to
    /// `linger_ms` for records to batch with: a run that moves alone
    /// crosses no linger, and publishes that overlap or follow closely
    /// under load batch as before. 0 sends every publish through the
    /// lingering producer.
    pub prompt_max_in_flight: usize,
    /// See `prompt_max_in_flight`. A linger pays only if another record
    /// comes within it; at a few times `linger_ms` the publishes of a busy
    /// process, which come every few milliseconds, keep batching.
    pub prompt_after_ms: u64,
    /// `message.max.bytes` of the producers.
    pub message_max_bytes: u64,
    /// `request.timeout.ms` of the producers.
    pub request_timeout_ms: u64,
    /// `delivery.timeout.ms` (`message.timeout.ms`) of the producers: how long
    /// a publish may be retried before it is reported failed.
    pub delivery_timeout_ms: u64,
    /// Timeout of admin and metadata requests.
    pub admin_timeout_ms: u64,
    /// `statistics.interval.ms` of the ingress's consumer: how often
    /// librdkafka reports its statistics, from which
    /// `ductor_ingress_consumer_lag_messages{topic}` is set (the messages of
    /// this process's input partitions that its group has not committed).
    /// The gauge is as old as this at most; each report costs the consumer
    /// a JSON document per interval. 0 turns the reports, and the gauge,
    /// off. It overrides a `statistics.interval.ms` of the pass-through
    /// properties for the ingress's consumer.
    pub statistics_interval_ms: u64,
    /// librdkafka properties applied to every client after Ductor's own
    /// settings: how Ductor authenticates to the brokers and encrypts, e.g.
    /// `"security.protocol" = "SASL_SSL"`, `"sasl.mechanism" =
    /// "SCRAM-SHA-512"`, `"sasl.username"`, `"sasl.password"`,
    /// `"ssl.ca.location" = "/etc/ductor/kafka-ca.pem"`. Set them in the
    /// file: an environment variable cannot name them (its `__` become the
    /// dots between sections, so a dotted key would be read as a nested
    /// section and refused). Values of keys that look secret are redacted
    /// in logs and in `ductor config`.
    pub properties: KafkaProperties,
    /// librdkafka properties for consumers only.
    pub consumer_properties: KafkaProperties,
    /// librdkafka properties for producers only. Neither this map nor
    /// `properties` may change `enable.idempotence`, `acks` or
    /// `max.in.flight.requests.per.connection` from Ductor's values
    /// ([`PRODUCER_GUARANTEES`]): the outbox trusts delivery
    /// reports, and those settings are what make them true. Nor may they
    /// change `partitioner` from `murmur2_random`
    /// ([`crate::contract::partition`]): a run's inputs share a partition
    /// only while every producer hashes its key as the Java client does.
    pub producer_properties: KafkaProperties,
}

fn yes() -> bool {
    true
}

impl KafkaConfig {
    /// Topics, the consumer group, and the client guarantees no
    /// pass-through property may weaken.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.bootstrap_servers.trim().is_empty() {
            return Err(invalid("kafka.bootstrap_servers", "must not be empty"));
        }
        if !valid_topic_chars(&self.topic_prefix) {
            return Err(invalid(
                "kafka.topic_prefix",
                "may contain only ASCII letters, digits, '.', '_' and '-'",
            ));
        }
        if self.group_id.trim().is_empty() {
            return Err(invalid("kafka.group_id", "must not be empty"));
        }
        if let Some(id) = &self.group_instance_id
            && (id.is_empty() || !valid_topic_chars(id))
        {
            return Err(invalid(
                "kafka.group_instance_id",
                "must be 1 to 200 ASCII letters, digits, '.', '_' and '-'",
            ));
        }
        if self.partitions < 1 {
            return Err(invalid("kafka.partitions", "must be at least 1"));
        }
        if self.replication_factor < 1 {
            return Err(invalid("kafka.replication_factor", "must be at least 1"));
        }
        // librdkafka's own range for statistics.interval.ms.
        if self.statistics_interval_ms > 86_400_000 {
            return Err(invalid(
                "kafka.statistics_interval_ms",
                "must be at most 86400000 (a day); 0 turns the statistics off",
            ));
        }
        if let Some(pool) = self
            .step_pools
            .iter()
            .find(|p| p.is_empty() || !valid_topic_chars(p))
        {
            return Err(invalid(
                "kafka.step_pools",
                format!("pool name {pool:?} is not a valid topic suffix"),
            ));
        }
        if let Some(topic) = self
            .extra_topics
            .iter()
            .find(|t| t.is_empty() || !valid_topic_chars(t))
        {
            return Err(invalid(
                "kafka.extra_topics",
                format!("{topic:?} is not a valid topic name"),
            ));
        }
        for (key, props) in [
            ("kafka.properties", &self.properties),
            ("kafka.producer_properties", &self.producer_properties),
        ] {
            if let Some(message) = props.weakened_producer_guarantee() {
                return Err(invalid(key, message));
            }
        }
        for (key, props) in [
            ("kafka.properties", &self.properties),
            ("kafka.consumer_properties", &self.consumer_properties),
        ] {
            if let Some(message) = props.weakened_consumer_guarantee() {
                return Err(invalid(key, message));
            }
        }
        Ok(())
    }
}

/// At most 200 of the characters Kafka allows in a topic name; empty
/// passes, for a prefix.
fn valid_topic_chars(s: &str) -> bool {
    s.len() <= 200
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

// The type, and how it redacts itself, is in `secrets.rs`; what it may not
// change is checked here, beside the guarantees it would break.
impl KafkaProperties {
    /// Why these properties would change a producer setting that the outbox
    /// relies on ([`PRODUCER_GUARANTEES`]), if they do. A
    /// delivery report is what marks an effect completed, so a producer that
    /// may report a message delivered that is not in the log (without
    /// idempotence, with `acks` below `all`, or with more than one request in
    /// flight) would lose effects. librdkafka's aliases count as the keys
    /// they stand for; stating Ductor's own value is allowed.
    pub fn weakened_producer_guarantee(&self) -> Option<String> {
        self.0.iter().find_map(|(key, value)| {
            let partitioner = crate::contract::partition::PARTITIONER;
            if key.trim() == "partitioner" && value.trim() != partitioner {
                return Some(format!(
                    "sets {key:?} = {value:?}, but Ductor's producers need partitioner = \
                     {partitioner}: a run has one writer only while every producer puts its \
                     inputs on the partition the Java client's hash gives its key"
                ));
            }
            let name = match key.trim() {
                "request.required.acks" => "acks",
                "max.in.flight" => "max.in.flight.requests.per.connection",
                other => other,
            };
            let (name, required) = PRODUCER_GUARANTEES
                .into_iter()
                .find(|(guarded, _)| *guarded == name)?;
            let same = value.trim() == required || (name == "acks" && value.trim() == "-1");
            (!same).then(|| {
                format!(
                    "sets {key:?} = {value:?}, but Ductor's producers need {name} = {required}: \
                     an effect is marked completed on its delivery report, and with this \
                     setting a report may claim a message the log does not hold"
                )
            })
        })
    }

    /// Why these properties would change a consumer setting that the
    /// single writer or exactly-once rests on ([`CONSUMER_GUARANTEES`]), if
    /// they do. Stating Ductor's own value is allowed; `group.remote.assignor`
    /// is refused whatever its value, since it only means something under
    /// the consumer protocol.
    pub fn weakened_consumer_guarantee(&self) -> Option<String> {
        self.0.iter().find_map(|(key, value)| {
            let name = key.trim();
            if name == "group.remote.assignor" {
                return Some(format!(
                    "sets {key:?}: the ingress's group uses the classic protocol with the range \
                     assignor, which gives partition p of every input topic to one process, so \
                     that each run has one writer; a broker-side assignor would not"
                ));
            }
            let (name, required) = CONSUMER_GUARANTEES
                .into_iter()
                .find(|(guarded, _)| *guarded == name)?;
            let same = value.trim().eq_ignore_ascii_case(required);
            (!same).then(|| {
                format!(
                    "sets {key:?} = {value:?}, but the ingress needs {name} = {required}: {}",
                    consumer_guarantee_reason(name)
                )
            })
        })
    }
}

/// What breaks when the consumer setting `name` changes.
fn consumer_guarantee_reason(name: &str) -> &'static str {
    match name {
        "enable.auto.offset.store" => {
            "an offset is stored only after the transaction that applied its input has \
             committed; stored automatically, a crash would skip inputs never applied"
        }
        "isolation.level" => {
            "inputs written in a producer transaction that was aborted must never be applied"
        }
        _ => {
            "partition p of every input topic goes to one process (the range assignor over \
             the classic group protocol), so that each run has one writer; another assignor \
             may give a run's inputs to two processes"
        }
    }
}
