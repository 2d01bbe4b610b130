//! The worker's options: what [`run`](super::run) is told, and how they follow
//! from Ductor's configuration.
//!
//! In: the [`Config`] and a pool's name, or options set by hand. Out: the
//! [`WorkerOptions`]. Guarantees: a worker derived from the configuration reads
//! the pool's dispatch topic in its pool's own consumer group, answers on the
//! topic the coordinator reads results from, and guards its results with the
//! coordinator's own input limits; every bound it runs with has a value here.

use std::time::Duration;

use crate::config::{Config, KafkaConfig};
use crate::infra::crash::CrashHooks;
#[cfg(feature = "internals")]
use crate::infra::crash::CrashPoint;

/// Dispatches handled at once when the caller does not say otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// Everything [`run`](super::run) needs; [`WorkerOptions::from_config`]
/// derives it from Ductor's configuration.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Client settings; `consumer_config`/`producer_config` apply them.
    pub kafka: KafkaConfig,
    /// Consumer group shared by every worker of the pool.
    pub group_id: String,
    /// Pool name, the `pool` label of the metrics.
    pub pool: String,
    /// The pool's `step.dispatch` topic.
    pub steps_topic: String,
    /// Where `attempt.result`s go (the coordinator's input topic).
    pub results_topic: String,
    /// Handlers running at once; the consumer is not polled while at this
    /// bound, so handlers must end within `kafka.max_poll_interval_ms` (set
    /// `handler_timeout`) or the group evicts the worker.
    pub max_in_flight: usize,
    /// A handler running longer is dropped and reported as a retryable
    /// failure. `None`: handlers are trusted to end (the coordinator's step
    /// timeout still retries an attempt that never answers).
    pub handler_timeout: Option<Duration>,
    /// A result larger than this (the coordinator's `max_input_bytes`) would
    /// be dead-lettered by the coordinator; it is replaced by a non-retryable
    /// failure that says so.
    pub max_result_bytes: usize,
    /// The shape a result must keep for the coordinator to accept it (the
    /// coordinator's `max_json_depth` and the rest): one that breaks it, or
    /// holds what cannot be stored (U+0000, an unpaired surrogate, an
    /// inexact number), is replaced by a non-retryable failure that names
    /// the class, instead of being dead-lettered and timing out.
    pub result_shape: crate::contract::ShapeLimits,
    /// After shutdown, how long in-flight handlers and publishes may take.
    /// What is still running then is abandoned, its offset unstored.
    pub shutdown_grace: Duration,
    /// Where the project's own tests stop the worker as a crash would
    /// (`infra::crash`); no user sets it.
    pub(crate) crash: CrashHooks,
    /// The tenants' signing keys: a result of a run whose tenant has one is
    /// signed (`ductor-signature`), as the coordinator may require.
    pub signatures: crate::config::SignaturesConfig,
}

impl WorkerOptions {
    /// Options for `pool`: group `<kafka.group_id>-worker-<pool>`, topics
    /// `<prefix>steps.<pool>` and `<prefix>attempt-results`.
    pub fn from_config(config: &Config, pool: &str) -> Self {
        let names = config.topic_names();
        Self {
            kafka: config.kafka.clone(),
            group_id: format!("{}-worker-{pool}", config.kafka.group_id),
            pool: pool.to_owned(),
            steps_topic: names.steps(pool),
            results_topic: names.attempt_results(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            handler_timeout: None,
            max_result_bytes: config.coordinator.max_input_bytes,
            result_shape: config.input_limits().shape,
            shutdown_grace: Duration::from_millis(config.server.shutdown_grace_ms),
            crash: CrashHooks::default(),
            signatures: config.signatures.clone(),
        }
    }

    /// Arms `point` (for a worker, [`CrashPoint::WorkerBeforePublish`]): a
    /// worker run with these options stops there as a crash would. For the
    /// project's own tests; built only with the `internals` feature.
    #[cfg(feature = "internals")]
    pub fn crash_at(mut self, point: CrashPoint) -> Self {
        self.crash.arm(point);
        self
    }
}
