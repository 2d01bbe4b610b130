//! The Rust step-worker library: consume a pool's `step.dispatch` topic, run
//! a user function per dispatch, publish the `attempt.result` with the
//! attempt's stamp.
//!
//! In: the `step.dispatch` records of [`WorkerOptions::steps_topic`], read
//! in the pool's consumer group, and a handler from [`StepDispatch`] to
//! [`StepOutcome`]. Out: an `attempt.result` for each dispatch it runs,
//! keyed by run and carrying the dispatch's stamp, and the
//! `ductor_worker_*` metrics. Guarantees: at most `max_in_flight` handlers
//! at once; an offset is stored only once its result is acknowledged; a
//! result continues its dispatch's W3C trace (`traceparent`, `tracestate`)
//! from the span of its handler (`step.handle`, target `ductor::traces`),
//! in which the handler runs.
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
//!
//! Here: [`run`] and what it sets up. The [`WorkerOptions`] are in `options`,
//! the loop that admits dispatches and stores offsets in `consume`, one
//! attempt (the handler guarded against panics and its time limit) in
//! `attempt`, the [`StepOutcome`] and the result it becomes in `outcome`,
//! publishing in `publish`, and the per-partition offset bookkeeping in
//! `offsets`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::producer::FutureProducer;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a handler receives: one attempt of one step, as the contract defines it.
pub use crate::contract::StepDispatch;

mod attempt;
mod consume;
mod offsets;
mod options;
mod outcome;
mod publish;

use attempt::Finished;
use offsets::OffsetTracker;
pub use options::{DEFAULT_MAX_IN_FLIGHT, WorkerOptions};
pub use outcome::StepOutcome;

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
    let prompt = (options.kafka.prompt_max_in_flight > 0)
        .then(|| {
            crate::infra::prompt_producer::PromptProducer::new(
                crate::infra::kafka::producer_config(&options.kafka, "worker-prompt"),
                options.kafka.prompt_max_in_flight,
                Duration::from_millis(options.kafka.prompt_after_ms),
            )
        })
        .transpose()?;
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
        prompt,
        results_topic: options.results_topic.clone(),
        pool: options.pool.clone(),
        handler_timeout: options.handler_timeout,
        result_limits: crate::contract::InputLimits {
            max_bytes: options.max_result_bytes,
            shape: options.result_shape,
            max_payload_bytes: options.max_result_bytes,
        },
        publish_timeout: Duration::from_millis(options.kafka.delivery_timeout_ms),
        crash: options.crash,
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
    /// Sends a result at once while few are in flight.
    prompt: Option<crate::infra::prompt_producer::PromptProducer>,
    results_topic: String,
    pool: String,
    handler_timeout: Option<Duration>,
    result_limits: crate::contract::InputLimits,
    publish_timeout: Duration,
    /// Where a test stops the worker as a crash would.
    crash: crate::infra::crash::CrashHooks,
    shutdown: CancellationToken,
    signatures: crate::config::SignaturesConfig,
}

struct Worker {
    consumer: StreamConsumer,
    topic: String,
    tracker: OffsetTracker,
    tasks: JoinSet<Finished>,
}
