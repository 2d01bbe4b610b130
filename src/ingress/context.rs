//! What the ingress works with: its consumer and its fixed inputs.
//!
//! In: the configuration, the pool and the workflows. Out: an
//! [`IngressContext`]: the consumer of the input topics in the ingress's
//! group, the applier that writes as this ingress, the dead-letter
//! writer (its compressing producer, and the pool it records letters in), the batch bounds, and each lane's progress and parked starts.
//! Guarantees: the consumer stores offsets only when told to
//! (`enable.auto.offset.store=false`, see
//! [`crate::infra::kafka::consumer_config`]); every assignment of its
//! partitions moves the writer's epoch on, so the history tells two
//! assignments apart; each lane's parked starts are taken by that lane
//! alone; librdkafka's statistics, every `kafka.statistics_interval_ms`,
//! set each input topic's `ductor_ingress_consumer_lag_messages`.

use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::StreamConsumer;
use sqlx::PgPool;

use super::Progress;
use super::dead_letter::DeadLetterPublisher;
use super::parked::Parked;
use crate::apply::{Applier, RetryPolicy};
use crate::config::Config;
use crate::contract::{InputLimits, InputTopic};
use crate::coordinator::Workflows;
use crate::infra::crash::CrashHooks;

/// The ingress consumer's context: logs rebalances, moves the writer's
/// epoch on at each assignment (and is where a chaos run can crash
/// mid-rebalance), and turns the consumer's statistics into its lag.
pub struct IngressConsumerContext {
    writer: std::sync::Arc<crate::apply::Writer>,
    /// The input topics, whose lag the statistics give.
    inputs: Vec<String>,
}

impl rdkafka::ClientContext for IngressConsumerContext {
    fn stats_raw(&self, statistics: &[u8]) {
        match super::lag::consumer_lag(statistics, &self.inputs) {
            Ok(lags) => {
                for (topic, lag) in lags {
                    metrics::gauge!(CONSUMER_LAG, "topic" => topic).set(lag as f64);
                }
            }
            Err(e) => tracing::warn!(error = %e, "consumer statistics do not parse"),
        }
    }
}

/// The gauge of the messages an input topic holds that the ingress's group
/// has not committed, on the partitions this process consumes.
pub const CONSUMER_LAG: &str = "ductor_ingress_consumer_lag_messages";

impl rdkafka::consumer::ConsumerContext for IngressConsumerContext {
    fn pre_rebalance(
        &self,
        _consumer: &rdkafka::consumer::BaseConsumer<Self>,
        rebalance: &rdkafka::consumer::Rebalance<'_>,
    ) {
        match rebalance {
            rdkafka::consumer::Rebalance::Assign(tpl) => {
                self.writer.reassigned();
                tracing::info!(partitions = tpl.count(), writer = %self.writer.label(), "partitions assigned")
            }
            rdkafka::consumer::Rebalance::Revoke(tpl) => {
                tracing::info!(partitions = tpl.count(), "partitions revoked")
            }
            rdkafka::consumer::Rebalance::Error(e) => {
                tracing::warn!(error = %e, "rebalance error")
            }
        }
        crate::crash_point!("ingress.rebalance");
    }
}

pub struct IngressContext {
    pub applier: Applier,
    pub consumer: StreamConsumer<IngressConsumerContext>,
    pub dead_letters: DeadLetterPublisher,
    pub requests_topic: String,
    pub wakeups_topic: String,
    pub results_topic: String,
    pub batch_max_inputs: usize,
    /// Bytes of values after which a batch is full.
    pub batch_max_bytes: usize,
    pub batch_linger: Duration,
    pub apply_lanes: usize,
    pub concurrent_batch_min_inputs: usize,
    /// The bounds every input keeps (size and shape).
    pub limits: InputLimits,
    /// Which inputs must be signed, and the tenants' keys.
    pub signatures: crate::config::SignaturesConfig,
    /// How a batch that failed transiently is retried.
    pub retry: RetryPolicy,
    /// Where a test stops this ingress as a crash would
    /// ([`CrashPoint::IngressAfterCommit`](crate::infra::crash::CrashPoint::IngressAfterCommit)).
    pub crash: CrashHooks,
    /// Poked after a commit that wrote effect intents, so the in-process
    /// drainer publishes them without waiting for its poll.
    pub wakeup: Option<crate::outbox::Wakeup>,
    /// Each lane's progress, shared with readiness.
    pub progress: std::sync::Arc<Progress>,
    /// Each lane's parked starts; only that lane takes its lock.
    parked: Vec<std::sync::Mutex<Parked>>,
    /// `coordinator.max_parked_starts`, per lane.
    pub max_parked_starts: usize,
    /// The input topics' partition counts, to find misrouted inputs.
    pub partition_counts: super::misrouted::PartitionCounts,
    /// `coordinator.max_input_forwards`.
    pub max_input_forwards: u32,
}

impl IngressContext {
    pub fn new(config: &Config, pool: PgPool, workflows: Workflows) -> anyhow::Result<Self> {
        let mut consumer_config =
            crate::infra::kafka::consumer_config(&config.kafka, &config.kafka.group_id, "ingress");
        if let Some(instance) = &config.kafka.group_instance_id {
            consumer_config.set("group.instance.id", instance);
        }
        // Ductor's own setting, over a pass-through property: the lag
        // gauge depends on it.
        consumer_config.set(
            "statistics.interval.ms",
            config.kafka.statistics_interval_ms.to_string(),
        );
        let writer = std::sync::Arc::new(crate::apply::Writer::new("ingress"));
        let names = config.topic_names();
        let context = IngressConsumerContext {
            writer: writer.clone(),
            inputs: names.inputs(),
        };
        let consumer: StreamConsumer<IngressConsumerContext> = consumer_config
            .create_with_context(context)
            .context("creating ingress consumer")?;
        let producer = super::dead_letter::producer(config, "dlq")?;
        let mut applier = Applier::new(config, pool.clone(), workflows);
        applier.writer = writer;
        Ok(Self {
            applier,
            consumer,
            partition_counts: super::misrouted::PartitionCounts::new(
                &config.kafka,
                Duration::from_millis(config.coordinator.partition_count_refresh_ms),
            )?,
            max_input_forwards: config.coordinator.max_input_forwards,
            dead_letters: DeadLetterPublisher {
                producer,
                topic: names.dead_letters(),
                pool,
                max_message_bytes: config.coordinator.max_error_message_bytes,
                max_record_bytes: usize::try_from(config.dead_letter_record_bytes())
                    .unwrap_or(usize::MAX),
                cut_record_bytes: usize::try_from(config.kafka.message_max_bytes)
                    .unwrap_or(usize::MAX),
                max_value_bytes: usize::try_from(config.dead_letters.max_value_bytes)
                    .unwrap_or(usize::MAX),
                timeout: Duration::from_millis(config.kafka.delivery_timeout_ms),
            },
            requests_topic: names.requests(),
            wakeups_topic: names.wakeups(),
            results_topic: names.attempt_results(),
            batch_max_inputs: config.coordinator.batch_max_inputs,
            batch_max_bytes: config.coordinator.batch_max_bytes,
            batch_linger: Duration::from_millis(config.coordinator.batch_linger_ms),
            apply_lanes: config.coordinator.apply_lanes,
            concurrent_batch_min_inputs: config.coordinator.concurrent_batch_min_inputs,
            limits: config.input_limits(),
            signatures: config.signatures.clone(),
            retry: RetryPolicy {
                min: Duration::from_millis(config.coordinator.apply_retry_min_ms),
                max: Duration::from_millis(config.coordinator.apply_retry_max_ms),
                bisect_after: config.coordinator.apply_bisect_after_failures,
            },
            crash: CrashHooks::default(),
            wakeup: None,
            progress: std::sync::Arc::new(Progress::new(
                config.coordinator.apply_lanes,
                Duration::from_millis(config.coordinator.stall_after_ms),
            )),
            parked: (0..config.coordinator.apply_lanes.max(1))
                .map(|_| std::sync::Mutex::default())
                .collect(),
            max_parked_starts: config.coordinator.max_parked_starts,
        })
    }

    /// Lane `lane`'s parked starts.
    pub(super) fn parked(&self, lane: usize) -> std::sync::MutexGuard<'_, Parked> {
        // A panic elsewhere cannot leave the list half-changed: every
        // change is one call on it.
        self.parked[lane]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn topic_kind(&self, topic: &str) -> Option<InputTopic> {
        InputTopic::classify(
            topic,
            &self.requests_topic,
            &self.wakeups_topic,
            &self.results_topic,
        )
    }
}
