//! The Rust step-worker library: consume a pool's `step.dispatch` topic, run
//! a user function per dispatch, publish the `attempt.result` with the
//! attempt's stamp.
//!
//! ```no_run
//! use ductor::client::worker::{StepDispatch, StepOutcome, WorkerOptions};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn example() -> anyhow::Result<()> {
//! let config = ductor::config::Config::load(None)?;
//! let options = WorkerOptions::from_config(&config, "default");
//! let shutdown = CancellationToken::new();
//! ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
//! ductor::client::worker::run(
//!     options,
//!     |step: StepDispatch| async move { StepOutcome::Succeeded(step.input) },
//!     shutdown,
//! )
//! .await
//! # }
//! ```
//!
//! Delivery is at least once. A dispatch's offset is stored only after its
//! result has been acknowledged by the broker, and per partition only up to
//! the highest *contiguous* finished offset, so a later dispatch that
//! finishes first never carries the group past an unfinished earlier one. A
//! worker that dies mid-attempt leaves the offset unstored: the dispatch is
//! redelivered to another worker of the group, and if none answers in time
//! the coordinator's step timeout retries it with a fresh stamp. Handlers
//! must therefore tolerate running twice for the same stamp; the coordinator
//! keeps only the first result per stamp.
//!
//! A step that calls another system must make that call idempotent across
//! attempts, not only across deliveries: a timed-out attempt may have
//! charged the card before its worker died. [`StepDispatch::step_key`] is
//! the same for every attempt of a step of a run; pass it as the call's
//! `Idempotency-Key` (the `examples/worker.rs` charge step does) and the
//! retried attempt gets the first attempt's answer instead of a second
//! charge.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::Value;
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::config::{Config, KafkaConfig};
/// What a handler receives: one attempt of one step, as the contract defines it.
pub use crate::contract::StepDispatch;
use crate::contract::input::{MAX_ERROR_MESSAGE_LEN, truncate};
use crate::contract::{AttemptOutcome, AttemptResult, Input};

/// Dispatches handled at once when the caller does not say otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;
/// Backoff bounds of result publishing.
const PUBLISH_RETRY_MIN: Duration = Duration::from_millis(100);
const PUBLISH_RETRY_MAX: Duration = Duration::from_secs(5);
/// Pause after a consumer error, so a broken connection does not spin.
const CONSUMER_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// What a handler made of one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The step's output: the next step's input, or the run's output after
    /// the last step.
    Succeeded(Value),
    /// `retryable: true` lets the step's retry policy schedule another
    /// attempt; `false` fails the run. Messages longer than 4096 characters
    /// are cut.
    Failed { message: String, retryable: bool },
}

impl StepOutcome {
    /// The `attempt.result` input answering `step`, exactly as the
    /// coordinator decodes it from the attempt-results topic.
    pub fn to_result_json(&self, step: &StepDispatch) -> Value {
        self.result_for(&step.run_id, &step.tenant, step.stamp)
    }

    fn result_for(&self, run_id: &str, tenant: &str, stamp: Uuid) -> Value {
        let outcome = match self {
            StepOutcome::Succeeded(output) => AttemptOutcome::Succeeded {
                output: output.clone(),
            },
            StepOutcome::Failed { message, retryable } => AttemptOutcome::Failed {
                message: truncate(message.clone(), MAX_ERROR_MESSAGE_LEN),
                retryable: *retryable,
            },
        };
        Input::Result(AttemptResult {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            stamp,
            outcome,
        })
        .to_json()
    }
}

/// Hooks that let tests stop the worker at a chosen point, as a crash would.
#[derive(Debug, Clone, Default)]
pub struct TestHooks {
    /// Return an error as soon as a handler has returned, before its result
    /// is published and without storing its offset.
    pub stop_before_publish: bool,
}

/// Everything [`run`] needs; [`WorkerOptions::from_config`] derives it from Ductor's
/// configuration.
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
    pub hooks: TestHooks,
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
            hooks: TestHooks::default(),
            signatures: config.signatures.clone(),
        }
    }
}

/// Registers descriptions of the worker's metrics with the installed recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "ductor_worker_steps_total",
        "Step dispatches seen by the worker, by pool and outcome (succeeded, failed, timed_out, panicked, expired, undecodable)"
    );
    metrics::describe_histogram!(
        "ductor_worker_step_seconds",
        metrics::Unit::Seconds,
        "Time the handler took for one attempt"
    );
}

/// How late a dispatch was published: its record's timestamp (set when the
/// drainer produced it) past its `ce_time` (when the transition committed),
/// when that is more than [`crate::contract::LATE_DISPATCH_MS`]; zero
/// otherwise, or when either is missing.
fn dispatch_delay(msg: &impl Message) -> chrono::TimeDelta {
    let produced = msg.timestamp().to_millis();
    let committed = msg
        .headers()
        .and_then(|hs| hs.iter().find(|h| h.key == "ce_time").and_then(|h| h.value))
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| DateTime::parse_from_rfc3339(v).ok())
        .map(|t| t.timestamp_millis());
    match (produced, committed) {
        (Some(p), Some(c)) if p - c > crate::contract::LATE_DISPATCH_MS => {
            chrono::TimeDelta::milliseconds(p - c)
        }
        _ => chrono::TimeDelta::zero(),
    }
}

fn count(pool: &str, outcome: &'static str) {
    metrics::counter!("ductor_worker_steps_total", "pool" => pool.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Consumes `options.steps_topic` until `shutdown`, running `handler` for up
/// to `options.max_in_flight` dispatches at once. On shutdown it stops
/// fetching, lets in-flight attempts finish within `options.shutdown_grace`,
/// and commits the offsets of everything finished.
pub async fn run<F, Fut>(
    options: WorkerOptions,
    handler: F,
    shutdown: CancellationToken,
) -> anyhow::Result<()>
where
    F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepOutcome> + Send + 'static,
{
    anyhow::ensure!(
        options.max_in_flight >= 1,
        "worker max_in_flight must be at least 1"
    );
    describe_metrics();
    let consumer: StreamConsumer =
        crate::infra::kafka::consumer_config(&options.kafka, &options.group_id, "worker")
            .create()
            .context("creating worker consumer")?;
    let producer = crate::infra::kafka::producer(&options.kafka, "worker")?;
    consumer
        .subscribe(&[options.steps_topic.as_str()])
        .with_context(|| format!("subscribing to {}", options.steps_topic))?;
    tracing::info!(
        topic = %options.steps_topic,
        group = %options.group_id,
        max_in_flight = options.max_in_flight,
        "worker subscribed"
    );
    let shared = Arc::new(Shared {
        handler,
        producer,
        results_topic: options.results_topic.clone(),
        pool: options.pool.clone(),
        handler_timeout: options.handler_timeout,
        result_limits: crate::contract::InputLimits {
            max_bytes: options.max_result_bytes,
            shape: options.result_shape,
            max_payload_bytes: options.max_result_bytes,
        },
        publish_timeout: Duration::from_millis(options.kafka.delivery_timeout_ms),
        stop_before_publish: options.hooks.stop_before_publish,
        signatures: options.signatures.clone(),
        shutdown: shutdown.clone(),
    });
    let mut worker = Worker {
        consumer,
        topic: options.steps_topic.clone(),
        tracker: OffsetTracker::default(),
        tasks: JoinSet::new(),
    };
    worker
        .consume(&shared, options.max_in_flight, &shutdown)
        .await?;
    worker.drain(options.shutdown_grace).await?;
    // Flush what was stored; the group keeps it for the next owner.
    if let Err(e) = worker.consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::debug!(error = %e, "final offset commit skipped");
    }
    worker.consumer.unsubscribe();
    tracing::info!("worker stopped");
    Ok(())
}

/// What every attempt task shares.
struct Shared<F> {
    handler: F,
    producer: FutureProducer,
    results_topic: String,
    pool: String,
    handler_timeout: Option<Duration>,
    result_limits: crate::contract::InputLimits,
    publish_timeout: Duration,
    stop_before_publish: bool,
    shutdown: CancellationToken,
    signatures: crate::config::SignaturesConfig,
}

/// How an attempt task ended.
enum Finished {
    /// The result is acknowledged by the broker: the offset may be stored.
    Published(Ticket),
    /// Publishing gave up at shutdown: the offset stays unstored.
    NotPublished,
    /// [`TestHooks::stop_before_publish`] fired.
    HookStopped,
}

struct Worker {
    consumer: StreamConsumer,
    topic: String,
    tracker: OffsetTracker,
    tasks: JoinSet<Finished>,
}

impl Worker {
    async fn consume<F, Fut>(
        &mut self,
        shared: &Arc<Shared<F>>,
        max_in_flight: usize,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()>
    where
        F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StepOutcome> + Send + 'static,
    {
        loop {
            let room = self.tasks.len() < max_in_flight;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(joined) = self.tasks.join_next() => self.finished(joined)?,
                msg = self.consumer.recv(), if room => match msg {
                    Ok(msg) => {
                        let ticket = self.tracker.received(msg.partition(), msg.offset());
                        let payload = msg.payload().unwrap_or_default();
                        if let Some(step) = self.admit(&shared.pool, payload, &msg) {
                            let span = tracing::info_span!(
                                "step",
                                run_id = %step.run_id,
                                step = %step.step,
                                attempt = step.attempt,
                                stamp = %step.stamp,
                            );
                            self.tasks
                                .spawn(attempt(shared.clone(), step, ticket).instrument(span));
                        } else {
                            self.done(ticket);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "kafka consumer error");
                        tokio::select! {
                            _ = shutdown.cancelled() => return Ok(()),
                            _ = tokio::time::sleep(CONSUMER_ERROR_PAUSE) => {}
                        }
                    }
                },
            }
        }
    }

    /// The dispatch to run, or `None` for one to skip (its offset is stored).
    /// Its deadline counts from when it was published, when that was late
    /// (see [`crate::contract::LATE_DISPATCH_MS`]).
    fn admit(&self, pool: &str, payload: &[u8], msg: &impl Message) -> Option<StepDispatch> {
        let step = match StepDispatch::decode(payload) {
            Ok(step) => step,
            Err(e) => {
                // The coordinator wrote it, so this is a version mismatch
                // that no retry fixes; the step's timeout takes over.
                tracing::warn!(
                    topic = msg.topic(),
                    partition = msg.partition(),
                    offset = msg.offset(),
                    error = %e,
                    "skipping undecodable step dispatch"
                );
                count(pool, "undecodable");
                return None;
            }
        };
        let mut step = step;
        step.deadline += dispatch_delay(msg);
        if step.is_expired(Utc::now()) {
            tracing::debug!(
                run_id = %step.run_id,
                step = %step.step,
                attempt = step.attempt,
                stamp = %step.stamp,
                deadline = %step.deadline,
                "skipping step dispatch past its deadline"
            );
            count(pool, "expired");
            return None;
        }
        Some(step)
    }

    fn finished(&mut self, joined: Result<Finished, JoinError>) -> anyhow::Result<()> {
        match joined {
            Ok(Finished::Published(ticket)) => self.done(ticket),
            Ok(Finished::NotPublished) => {}
            Ok(Finished::HookStopped) => {
                anyhow::bail!("test hook: stopped after the handler, before publishing")
            }
            Err(e) if e.is_cancelled() => {}
            // Handler panics are caught inside the task; this is a bug here.
            Err(e) => return Err(anyhow::Error::new(e).context("worker task panicked")),
        }
        Ok(())
    }

    /// Records a finished dispatch and stores the partition's new position
    /// if it moved.
    fn done(&mut self, ticket: Ticket) {
        let Some(next) = self.tracker.complete(ticket) else {
            return;
        };
        let mut tpl = TopicPartitionList::with_capacity(1);
        if let Err(e) =
            tpl.add_partition_offset(&self.topic, ticket.partition, Offset::Offset(next))
        {
            tracing::warn!(error = %e, partition = ticket.partition, "could not record offset");
            return;
        }
        if let Err(e) = self.consumer.store_offsets(&tpl) {
            tracing::info!(
                error = %e,
                partition = ticket.partition,
                "offset not stored (partition revoked?); the dispatch may be redelivered"
            );
        }
    }

    /// Waits for in-flight attempts, at most `grace`; abandons the rest.
    async fn drain(&mut self, grace: Duration) -> anyhow::Result<()> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        tracing::info!(
            in_flight = self.tasks.len(),
            grace_ms = grace.as_millis() as u64,
            "worker stopping, waiting for in-flight steps"
        );
        let deadline = Instant::now() + grace;
        loop {
            match tokio::time::timeout_at(deadline, self.tasks.join_next()).await {
                Ok(Some(joined)) => self.finished(joined)?,
                Ok(None) => return Ok(()),
                Err(_) => {
                    tracing::warn!(
                        abandoned = self.tasks.len(),
                        "in-flight steps did not finish within the shutdown grace; they will be redelivered"
                    );
                    self.tasks.shutdown().await;
                    return Ok(());
                }
            }
        }
    }
}

/// One attempt: run the handler, publish its result, report the ticket.
async fn attempt<F, Fut>(shared: Arc<Shared<F>>, step: StepDispatch, ticket: Ticket) -> Finished
where
    F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepOutcome> + Send + 'static,
{
    let (run_id, tenant, stamp) = (step.run_id.clone(), step.tenant.clone(), step.stamp);
    let started = Instant::now();
    // The call itself happens inside the guarded future, so a handler that
    // panics before returning its future is caught too.
    let handled = AssertUnwindSafe(async { (shared.handler)(step).await }).catch_unwind();
    let (outcome, label) = match shared.handler_timeout {
        Some(limit) => match tokio::time::timeout(limit, handled).await {
            Ok(r) => classify(r),
            Err(_) => (
                StepOutcome::Failed {
                    message: format!("step handler timed out after {} ms", limit.as_millis()),
                    retryable: true,
                },
                "timed_out",
            ),
        },
        None => classify(handled.await),
    };
    metrics::histogram!("ductor_worker_step_seconds", "pool" => shared.pool.clone())
        .record(started.elapsed().as_secs_f64());
    count(&shared.pool, label);
    tracing::debug!(outcome = label, "step handled");

    let mut payload = outcome.result_for(&run_id, &tenant, stamp).to_string();
    if let Err(refused) = crate::contract::parse_value(payload.as_bytes(), &shared.result_limits) {
        // The coordinator would dead-letter it and the step would time out:
        // fail it now, for good, saying why.
        tracing::warn!(
            bytes = payload.len(),
            class = refused.class.as_str(),
            error = %refused.message,
            "step result cannot be accepted, reporting a failure instead"
        );
        let failure = StepOutcome::Failed {
            message: format!(
                "the step's result cannot be accepted ({}): {}",
                refused.class.as_str(),
                refused.message
            ),
            retryable: false,
        };
        payload = failure.result_for(&run_id, &tenant, stamp).to_string();
    }
    if shared.stop_before_publish {
        return Finished::HookStopped;
    }
    match publish(&shared, &run_id, &tenant, payload.as_bytes()).await {
        Ok(()) => Finished::Published(ticket),
        Err(e) => {
            tracing::warn!(error = %e, "step result not published before shutdown; the dispatch will be redelivered");
            Finished::NotPublished
        }
    }
}

fn classify(
    result: Result<StepOutcome, Box<dyn std::any::Any + Send>>,
) -> (StepOutcome, &'static str) {
    match result {
        Ok(outcome @ StepOutcome::Succeeded(_)) => (outcome, "succeeded"),
        Ok(outcome @ StepOutcome::Failed { .. }) => (outcome, "failed"),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            tracing::error!(panic = %truncate(what.clone(), 256), "step handler panicked");
            (
                StepOutcome::Failed {
                    message: format!("step handler panicked: {what}"),
                    retryable: true,
                },
                "panicked",
            )
        }
    }
}

/// Publishes keyed by `run_id` and waits for the broker's acknowledgement;
/// retries with capped backoff until it succeeds or shutdown begins.
async fn publish<F>(
    shared: &Shared<F>,
    run_id: &str,
    tenant: &str,
    payload: &[u8],
) -> anyhow::Result<()> {
    let mut headers = OwnedHeaders::new().insert(Header {
        key: "content-type",
        value: Some("application/json"),
    });
    if let Some(key) = shared.signatures.key(tenant) {
        // Signed once: a retry of the same record carries the same time,
        // well within the window (retries stop at the publish timeout).
        let signed_at_ms = chrono::Utc::now().timestamp_millis();
        let signature = crate::contract::signature::sign(key, payload, signed_at_ms);
        headers = headers.insert(Header {
            key: crate::contract::signature::SIGNATURE,
            value: Some(signature.as_str()),
        });
    }
    let send = || async {
        let record = FutureRecord::to(&shared.results_topic)
            .key(run_id)
            .payload(payload)
            .headers(headers.clone());
        shared
            .producer
            .send(record, Timeout::After(shared.publish_timeout))
            .await
            .map_err(|(e, _)| e)
    };
    send.retry(
        ExponentialBuilder::default()
            .with_min_delay(PUBLISH_RETRY_MIN)
            .with_max_delay(PUBLISH_RETRY_MAX)
            .without_max_times(),
    )
    .when(|_| !shared.shutdown.is_cancelled())
    .notify(|e, after| {
        tracing::warn!(error = %e, retry_in_ms = after.as_millis() as u64, "publishing step result failed, retrying")
    })
    .await
    .context("publishing step result")?;
    Ok(())
}

/// Names one received message for [`OffsetTracker::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticket {
    partition: i32,
    offset: i64,
    /// Bumped when the partition rewinds (a rebalance gave it back at an
    /// earlier committed offset): older tickets no longer move its position.
    epoch: u64,
}

/// Per-partition progress: which received offsets are still unfinished, so
/// the stored position never passes one of them. Pure bookkeeping, bounded
/// by the in-flight limit.
#[derive(Debug, Default)]
struct OffsetTracker {
    partitions: BTreeMap<i32, PartitionProgress>,
}

#[derive(Debug, Default)]
struct PartitionProgress {
    epoch: u64,
    last_received: Option<i64>,
    unfinished: BTreeSet<i64>,
    /// Highest finished offset + 1 in this epoch.
    finished_next: Option<i64>,
    /// The last position handed out for storing in this epoch (at first,
    /// the epoch's first offset: the position it started from).
    stored: Option<i64>,
}

impl OffsetTracker {
    /// Records a message as received and unfinished.
    fn received(&mut self, partition: i32, offset: i64) -> Ticket {
        let p = self.partitions.entry(partition).or_default();
        if p.last_received.is_some_and(|last| offset <= last) {
            // Redelivery from an earlier position: start over; the older
            // in-flight messages come again in this epoch.
            *p = PartitionProgress {
                epoch: p.epoch + 1,
                ..PartitionProgress::default()
            };
        }
        // The position before anything of this epoch finished.
        p.stored.get_or_insert(offset);
        p.last_received = Some(offset);
        p.unfinished.insert(offset);
        Ticket {
            partition,
            offset,
            epoch: p.epoch,
        }
    }

    /// Marks a message finished; returns the partition's new position (the
    /// next offset to consume) if it advanced.
    fn complete(&mut self, ticket: Ticket) -> Option<i64> {
        let p = self.partitions.get_mut(&ticket.partition)?;
        if p.epoch != ticket.epoch || !p.unfinished.remove(&ticket.offset) {
            return None;
        }
        let next = ticket.offset + 1;
        p.finished_next = Some(p.finished_next.map_or(next, |n| n.max(next)));
        // Within an epoch offsets arrive in order, so everything received
        // below the oldest unfinished offset is finished.
        let position = match p.unfinished.first() {
            Some(&oldest) => oldest,
            None => p.finished_next?,
        };
        if p.stored.is_some_and(|s| position <= s) {
            return None;
        }
        p.stored = Some(position);
        Some(position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{EffectTarget, InputLimits, InputTopic, RunStart, decode_input};
    use crate::coordinator::{
        Decision, Entropy, StepDefinition, WorkflowDefinition, Workflows, fold,
    };
    use serde_json::json;

    fn workflows() -> Workflows {
        let step = |name: &str| StepDefinition::task(name, "default", 5_000);
        Workflows::new(vec![WorkflowDefinition {
            name: "wf".into(),
            version: 3,
            steps: vec![step("reserve"), step("charge")],
            output_topic: None,
        }])
        .unwrap()
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_700_000_000_123).unwrap()
    }

    /// The dispatch the real fold emits for a fresh run.
    fn dispatch_from_fold() -> (crate::coordinator::RunState, Value) {
        let start = Input::Start(RunStart {
            run_id: "run-1".into(),
            tenant: "acme".into(),
            workflow: "wf".into(),
            workflow_version: None,
            pool: "default".into(),
            input: json!({"order": 7}),
            correlation_id: None,
        });
        let entropy = Entropy {
            stamp: Uuid::from_u128(42),
            jitter_unit: 0.5,
        };
        let Decision::Transition(t) = fold(None, &start, &workflows(), usize::MAX, now(), &entropy)
        else {
            panic!("start is a transition");
        };
        let effect = t
            .effects
            .iter()
            .find(|e| matches!(e.target, EffectTarget::StepQueue { .. }))
            .expect("a dispatch effect");
        (t.state, effect.payload.clone())
    }

    #[test]
    fn decodes_the_dispatch_the_fold_emits() {
        let (_, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        assert_eq!(
            step,
            StepDispatch {
                schema_version: 1,
                run_id: "run-1".into(),
                tenant: "acme".into(),
                workflow: "wf".into(),
                workflow_version: 3,
                step: "reserve".into(),
                step_index: 0,
                attempt: 1,
                step_key: "run-1/step/0".into(),
                stamp: Uuid::from_u128(42),
                deadline: now() + chrono::TimeDelta::milliseconds(5_000),
                input: json!({"order": 7}),
            }
        );
        assert!(!step.is_expired(now()));
        assert!(step.is_expired(step.deadline));
    }

    #[test]
    fn a_result_built_from_a_dispatch_is_accepted_by_the_coordinator() {
        let (state, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        let result = StepOutcome::Succeeded(json!({"reserved": true})).to_result_json(&step);
        let input = decode_input(
            InputTopic::AttemptResults,
            result.to_string().as_bytes(),
            &InputLimits::sized(1 << 20),
        )
        .unwrap();
        assert_eq!(
            input,
            Input::Result(AttemptResult {
                run_id: "run-1".into(),
                tenant: "acme".into(),
                stamp: Uuid::from_u128(42),
                outcome: AttemptOutcome::Succeeded {
                    output: json!({"reserved": true})
                },
            })
        );
        let entropy = Entropy {
            stamp: Uuid::from_u128(43),
            jitter_unit: 0.5,
        };
        let decision = fold(
            Some(&state),
            &input,
            &workflows(),
            usize::MAX,
            now(),
            &entropy,
        );
        let Decision::Transition(t) = decision else {
            panic!("the result advances the run: {decision:?}");
        };
        assert_eq!(t.state.step_index, 1);
    }

    #[test]
    fn failures_round_trip_with_their_retryable_flag_and_a_bounded_message() {
        let (_, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        for retryable in [true, false] {
            let outcome = StepOutcome::Failed {
                message: "x".repeat(MAX_ERROR_MESSAGE_LEN + 10),
                retryable,
            };
            let json = outcome.to_result_json(&step);
            assert_eq!(json["type"], "attempt.result");
            assert_eq!(json["schema_version"], 1);
            assert_eq!(json["outcome"], "failed");
            let Ok(Input::Result(r)) = decode_input(
                InputTopic::AttemptResults,
                json.to_string().as_bytes(),
                &InputLimits::sized(1 << 20),
            ) else {
                panic!("decodes");
            };
            assert_eq!(
                r.outcome,
                AttemptOutcome::Failed {
                    message: "x".repeat(MAX_ERROR_MESSAGE_LEN),
                    retryable
                }
            );
        }
    }

    #[test]
    fn undecodable_dispatches_name_the_field() {
        let (_, good) = dispatch_from_fold();
        let cases: Vec<(Value, &str)> = vec![
            (json!("nope"), "not a JSON object"),
            (json!({"type": "attempt.result"}), "type"),
            (
                {
                    let mut v = good.clone();
                    v["schema_version"] = json!(2);
                    v
                },
                "schema_version 2",
            ),
            (
                {
                    let mut v = good.clone();
                    v["stamp"] = json!("x");
                    v
                },
                "stamp",
            ),
            (
                {
                    let mut v = good.clone();
                    v["deadline"] = json!("soon");
                    v
                },
                "deadline",
            ),
            (
                {
                    let mut v = good.clone();
                    v["attempt"] = json!(-1);
                    v
                },
                "attempt",
            ),
            (
                {
                    let mut v = good.clone();
                    v["run_id"] = json!("a b");
                    v
                },
                "run_id",
            ),
            (
                {
                    let mut v = good.clone();
                    v.as_object_mut().unwrap().remove("tenant");
                    v
                },
                "tenant: missing",
            ),
        ];
        for (value, needle) in cases {
            let err = StepDispatch::decode(value.to_string().as_bytes()).unwrap_err();
            assert!(err.message.contains(needle), "{needle}: {err}");
        }
        assert!(StepDispatch::decode(b"\xff\x00").is_err());
        assert!(StepDispatch::decode(b"").is_err());
        // Unknown extra fields are tolerated.
        let mut extra = good;
        extra["added_later"] = json!(1);
        assert!(StepDispatch::decode(extra.to_string().as_bytes()).is_ok());
    }

    #[test]
    fn the_position_never_passes_an_unfinished_offset() {
        let mut t = OffsetTracker::default();
        let a = t.received(0, 10);
        let b = t.received(0, 11);
        let c = t.received(0, 13); // 12 is a gap (a control record)
        assert_eq!(t.complete(c), None, "10 and 11 are unfinished");
        assert_eq!(t.complete(a), Some(11));
        assert_eq!(t.complete(a), None, "a second completion changes nothing");
        assert_eq!(t.complete(b), Some(14));
        let d = t.received(0, 14);
        let other = t.received(1, 3);
        assert_eq!(t.complete(other), Some(4), "partitions are independent");
        assert_eq!(t.complete(d), Some(15));
    }

    #[test]
    fn a_rewound_partition_ignores_tickets_of_the_earlier_epoch() {
        let mut t = OffsetTracker::default();
        let old = t.received(0, 10);
        let _old_next = t.received(0, 11);
        // Rebalanced away and back: delivered again from 10.
        let again = t.received(0, 10);
        assert_eq!(t.complete(old), None);
        assert_eq!(t.complete(again), Some(11));
        let next = t.received(0, 11);
        assert_eq!(t.complete(next), Some(12));
    }
}
