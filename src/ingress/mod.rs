//! The coordinator's Kafka ingress.
//!
//! One consumer group reads `requests`, `wakeups` and `attempt-results`.
//! Messages are gathered into bounded batches, decoded, and applied in one
//! Postgres transaction by the [`Applier`]. With `coordinator.apply_lanes`
//! above one, partition `p` is applied by lane `p % apply_lanes`: each lane
//! keeps its partitions in order and stores only their offsets, and the
//! lanes' transactions overlap (one commits while another loads and folds).
//! A run's inputs share its key and so its partition number; a run touched
//! by two lanes anyway is fenced by `record_version` like any other race. Inputs that cannot be decoded or
//! that the coordinator rejects go to the dead-letter topic. Offsets are
//! stored (`enable.auto.offset.store=false`) only after the transaction and
//! the dead-letter publishes have succeeded, so a crash anywhere leads to a
//! redelivery, which the coordinator turns into zero new rows.
//!
//! [`run`] is the loop; [`step`] is one turn of the serial ingress, for
//! tests that drive it a batch at a time and read what each batch did
//! ([`StepReport`]) instead of waiting on the database.

pub mod classify;
pub mod dead_letter;
mod parked;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::apply::{Applier, Holds, InputOutcome, IsolatedBatch, PendingInput, RetryPolicy};
use crate::config::Config;
use crate::contract::{Input, Source};
use crate::contract::{InputLimits, InputTopic};
use crate::coordinator::fold::RejectionClass;
use crate::coordinator::{NoOpReason, Workflows};
use crate::infra::health::LaneWatch;
use crate::ingress::classify::{Classified, Received, check_signature, classify};
use crate::ingress::dead_letter::{DeadLetter, DeadLetterPublisher, Stage};
use crate::ingress::parked::{Parked, ParkedStart};
use crate::routing::{self, MismatchPath, RouteOutcome};

/// The ingress consumer's context: logs rebalances, moves the writer's
/// epoch on at each assignment (and is where a chaos run can crash
/// mid-rebalance).
pub struct IngressConsumerContext {
    writer: std::sync::Arc<crate::apply::Writer>,
}

impl rdkafka::ClientContext for IngressConsumerContext {}

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

/// Whether the ingress moves: every apply lane records when it took up the
/// batch in its hands. A lane that has held one for longer than
/// `coordinator.stall_after_ms` without committing it (the database away,
/// a lock held, a dead letter that cannot be published) is stalled, and
/// so are its partitions: readiness says so, and so do the gauges
/// `ductor_ingress_stalled_lanes` and `ductor_ingress_oldest_batch_age_seconds`.
#[derive(Debug)]
pub struct Progress {
    /// Per lane: when it took up its batch (Unix ms), 0 while idle.
    busy_since_ms: Vec<std::sync::atomic::AtomicI64>,
    stall_after: Duration,
    /// Batches handled whole (applied, dead-lettered, offsets stored) since
    /// the ingress was made, over every lane.
    batches: std::sync::atomic::AtomicU64,
    /// Inputs and routed starts of those batches that made a transition.
    applied: std::sync::atomic::AtomicU64,
}

impl Progress {
    pub fn new(lanes: usize, stall_after: Duration) -> Progress {
        Progress {
            busy_since_ms: (0..lanes.max(1))
                .map(|_| std::sync::atomic::AtomicI64::new(0))
                .collect(),
            stall_after,
            batches: std::sync::atomic::AtomicU64::new(0),
            applied: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn slot(&self, lane: usize) -> &std::sync::atomic::AtomicI64 {
        &self.busy_since_ms[lane % self.busy_since_ms.len()]
    }

    fn began(&self, lane: usize) {
        let now = chrono::Utc::now().timestamp_millis();
        self.slot(lane)
            .store(now.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    fn finished(&self, lane: usize) {
        self.slot(lane)
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    fn handled(&self, report: &StepReport) {
        use std::sync::atomic::Ordering::Relaxed;
        self.batches.fetch_add(1, Relaxed);
        self.applied.fetch_add(report.applied as u64, Relaxed);
    }

    /// Batches this ingress has handled whole, offsets stored.
    #[cfg(any(test, feature = "internals"))]
    pub fn batches_handled(&self) -> u64 {
        self.batches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Inputs and routed starts this ingress has applied as transitions.
    #[cfg(any(test, feature = "internals"))]
    pub fn inputs_applied(&self) -> u64 {
        self.applied.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long the longest-held batch has been held, if any.
    pub fn oldest_batch_age(&self) -> Option<Duration> {
        let now = chrono::Utc::now().timestamp_millis();
        self.busy_since_ms
            .iter()
            .map(|s| s.load(std::sync::atomic::Ordering::Relaxed))
            .filter(|since| *since > 0)
            .map(|since| Duration::from_millis((now - since).max(0) as u64))
            .max()
    }

    /// Sets the gauges; `serve` calls it every second.
    pub fn observe(&self) {
        metrics::gauge!("ductor_ingress_stalled_lanes").set(self.stalled().len() as f64);
        metrics::gauge!("ductor_ingress_oldest_batch_age_seconds")
            .set(self.oldest_batch_age().map_or(0.0, |age| age.as_secs_f64()));
    }
}

impl LaneWatch for Progress {
    /// The lanes stalled now, with how long each has held its batch.
    fn stalled(&self) -> Vec<(usize, Duration)> {
        let now = chrono::Utc::now().timestamp_millis();
        self.busy_since_ms
            .iter()
            .enumerate()
            .filter_map(|(lane, s)| {
                let since = s.load(std::sync::atomic::Ordering::Relaxed);
                let age = Duration::from_millis((now - since).max(0) as u64);
                (since > 0 && age >= self.stall_after).then_some((lane, age))
            })
            .collect()
    }
}

/// Hooks that let tests stop the ingress at a chosen point, as a crash would.
#[derive(Debug, Clone, Default)]
pub struct TestHooks {
    /// Return an error right after the first batch commits, before its
    /// offsets are stored.
    pub fail_after_commit: bool,
}

/// What the ingress did with one batch, once it was applied, its dead
/// letters published and its offsets stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Messages in the batch.
    pub messages: usize,
    /// The offset of the batch's last message on each `(topic, partition)`.
    pub last_offsets: BTreeMap<(String, i32), i64>,
    /// Inputs and routed starts that made a transition.
    pub applied: usize,
    /// Inputs and routed starts that changed nothing (duplicates, stale
    /// results).
    pub no_ops: usize,
    /// Inputs and routed starts the coordinator or the routing plane
    /// refused; dead-lettered.
    pub rejected: usize,
    /// Inputs that failed on their own in the database; dead-lettered.
    pub failed: usize,
    /// Messages that did not decode; dead-lettered.
    pub undecodable: usize,
    /// Recomputations after lost races.
    pub conflicts: u32,
    /// Effect intents committed.
    pub intents_written: usize,
    /// Routed starts parked beside the lane because another caller holds
    /// their key; they are applied again in a later turn.
    pub parked: usize,
}

impl StepReport {
    /// Whether the batch held message `offset` of `topic`/`partition`, or
    /// one after it.
    #[cfg(any(test, feature = "internals"))]
    pub fn covers(&self, topic: &str, partition: i32, offset: i64) -> bool {
        self.last_offsets
            .get(&(topic.to_string(), partition))
            .is_some_and(|last| *last >= offset)
    }

    /// Messages of the batch sent to the dead-letter topic.
    #[cfg(any(test, feature = "internals"))]
    pub fn dead_lettered(&self) -> usize {
        self.rejected + self.failed + self.undecodable
    }

    /// Counts one input by its `ductor_inputs_total` outcome label.
    fn count(&mut self, outcome: &str) {
        match outcome {
            "applied" => self.applied += 1,
            "stale" | "deduplicated" => self.no_ops += 1,
            _ => self.rejected += 1,
        }
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
    pub hooks: TestHooks,
    /// Poked after a commit that wrote effect intents, so the in-process
    /// drainer publishes them without waiting for its poll.
    pub wakeup: Option<crate::outbox::Wakeup>,
    /// Each lane's progress, shared with readiness.
    pub progress: std::sync::Arc<Progress>,
    /// Each lane's parked starts; only that lane takes its lock.
    parked: Vec<std::sync::Mutex<Parked>>,
    /// `coordinator.max_parked_starts`, per lane.
    pub max_parked_starts: usize,
}

impl IngressContext {
    pub fn new(config: &Config, pool: PgPool, workflows: Workflows) -> anyhow::Result<Self> {
        let mut consumer_config =
            crate::infra::kafka::consumer_config(&config.kafka, &config.kafka.group_id, "ingress");
        if let Some(instance) = &config.kafka.group_instance_id {
            consumer_config.set("group.instance.id", instance);
        }
        let writer = std::sync::Arc::new(crate::apply::Writer::new("ingress"));
        let context = IngressConsumerContext {
            writer: writer.clone(),
        };
        let consumer: StreamConsumer<IngressConsumerContext> = consumer_config
            .create_with_context(context)
            .context("creating ingress consumer")?;
        let producer: FutureProducer = crate::infra::kafka::producer(&config.kafka, "dlq")?;
        let mut applier = Applier::new(config, pool, workflows);
        applier.writer = writer;
        let names = config.topic_names();
        Ok(Self {
            applier,
            consumer,
            dead_letters: DeadLetterPublisher {
                producer,
                topic: names.dead_letters(),
                max_message_bytes: config.coordinator.max_error_message_bytes,
                max_record_bytes: usize::try_from(config.kafka.message_max_bytes)
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
            hooks: TestHooks::default(),
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
    fn parked(&self, lane: usize) -> std::sync::MutexGuard<'_, Parked> {
        // A panic elsewhere cannot leave the list half-changed: every
        // change is one call on it.
        self.parked[lane]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn topic_kind(&self, topic: &str) -> Option<InputTopic> {
        InputTopic::classify(
            topic,
            &self.requests_topic,
            &self.wakeups_topic,
            &self.results_topic,
        )
    }
}

/// Consumes until `shutdown`, finishing the batch in hand.
pub async fn run(ctx: IngressContext, shutdown: CancellationToken) -> anyhow::Result<()> {
    subscribe(&ctx)?;
    let result = consume(&ctx, &shutdown).await;
    close(&ctx);
    result
}

/// Subscribes the ingress consumer to the input topics.
pub fn subscribe(ctx: &IngressContext) -> anyhow::Result<()> {
    let topics = [
        ctx.requests_topic.as_str(),
        ctx.wakeups_topic.as_str(),
        ctx.results_topic.as_str(),
    ];
    ctx.consumer
        .subscribe(&topics)
        .context("subscribing to input topics")?;
    tracing::info!(topics = ?topics, "ingress subscribed");
    Ok(())
}

/// Commits the offsets stored so far, which the broker keeps for the
/// group, and leaves the input topics.
pub fn close(ctx: &IngressContext) {
    if let Err(e) = ctx.consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::debug!(error = %e, "final offset commit skipped");
    }
    ctx.consumer.unsubscribe();
}

/// One turn of the serial ingress, for a caller that drives it one batch at
/// a time (tests, after [`subscribe`]): waits up to `wait` for a first
/// message, gathers a batch as the loop does, applies it and stores its
/// offsets. `Ok(None)` when no message came within `wait`, or when
/// shutdown interrupted the batch (nothing of it stored, so it is
/// redelivered). Lanes play no part: the batch is lane 0's.
#[cfg(any(test, feature = "internals"))]
pub async fn step(
    ctx: &IngressContext,
    wait: Duration,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    turn(ctx, Some(Instant::now() + wait), shutdown).await
}

/// Reads one batch, waiting for its first message until `first_by` (for
/// ever without it), and handles it as lane 0. `Ok(None)` when there was
/// nothing to handle or shutdown interrupted it.
async fn turn(
    ctx: &IngressContext,
    first_by: Option<Instant>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    let due = ctx.parked(0).due();
    let until = match (first_by, due) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let batch = match next_batch(ctx, shutdown, until).await? {
        Some(batch) => batch,
        // Nothing came, but the parked starts are due: their turn alone.
        None if !shutdown.is_cancelled() && due.is_some_and(|d| d <= Instant::now()) => Vec::new(),
        None => return Ok(None),
    };
    handle_batch(ctx, 0, &batch, shutdown).await
}

async fn consume(ctx: &IngressContext, shutdown: &CancellationToken) -> anyhow::Result<()> {
    if ctx.apply_lanes <= 1 {
        // The serial ingress: one turn after the other, until shutdown.
        while turn(ctx, None, shutdown).await?.is_some() {}
        return Ok(());
    }
    // Lanes: the reader hands each message to its partition's lane; a lane
    // batches, applies and stores offsets on its own. A failing lane stops
    // the ingress (the error is returned); stopping leaves what the lanes
    // have not applied unstored, so it is redelivered.
    let stop = shutdown.child_token();
    let turn = tokio::sync::Semaphore::new(1);
    let mut senders = Vec::with_capacity(ctx.apply_lanes);
    let mut lanes = Vec::with_capacity(ctx.apply_lanes);
    for index in 0..ctx.apply_lanes {
        let (tx, rx) = tokio::sync::mpsc::channel(ctx.batch_max_inputs * 2);
        senders.push(tx);
        lanes.push(lane(ctx, index, rx, &turn, &stop));
    }
    let reader = async {
        loop {
            let msg = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok::<(), anyhow::Error>(()),
                msg = ctx.consumer.recv() => msg,
            };
            match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    let index = m.partition().unsigned_abs() as usize % senders.len();
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => return Ok(()),
                        sent = senders[index].send(m.detach()) => {
                            if sent.is_err() {
                                return Ok(());
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    };
    let lanes = async {
        let result = futures::future::try_join_all(lanes).await.map(|_| ());
        // One lane failed or every lane stopped: stop the reader too.
        stop.cancel();
        result
    };
    let (read, applied) = tokio::join!(reader, lanes);
    applied.and(read)
}

/// One apply lane: batches from its channel until shutdown or a failure.
/// A small batch applies only with `turn`, which the lanes share.
async fn lane(
    ctx: &IngressContext,
    index: usize,
    mut messages: tokio::sync::mpsc::Receiver<OwnedMessage>,
    turn: &tokio::sync::Semaphore,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let mut batch = Gathered::new(ctx);
        let due = ctx.parked(index).due();
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            m = messages.recv() => match m {
                Some(m) => batch.push(m),
                None => return Ok(()),
            },
            // The parked starts' turn, with whatever is queued.
            () = sleep_until(due) => {}
        }
        // What queued up while the previous batch was applied is a batch
        // already: take it without waiting. Only a lone message, one that
        // found the lane idle, lingers for company.
        take_queued(&mut messages, &mut batch);
        if batch.messages.len() == 1 {
            let deadline = Instant::now() + ctx.batch_linger;
            while !batch.full() {
                tokio::select! {
                    biased;
                    m = messages.recv() => match m {
                        Some(m) => batch.push(m),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
        }
        // A batch below the threshold (none by default) takes turns with the
        // other lanes' small batches, and what arrives while it waits joins
        // it. A batch at or above it applies at once.
        let _turn = if batch.messages.len() < ctx.concurrent_batch_min_inputs {
            let permit = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                permit = turn.acquire() => permit.context("the lanes' turn was closed")?,
            };
            take_queued(&mut messages, &mut batch);
            Some(permit)
        } else {
            None
        };
        let handled = handle_batch(ctx, index, &batch.messages, stop).await;
        match handled {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) => {
                stop.cancel();
                return Err(e);
            }
        }
    }
}

/// A batch being gathered: full at `coordinator.batch_max_inputs` inputs
/// or `coordinator.batch_max_bytes` bytes of values, whichever comes first.
struct Gathered {
    messages: Vec<OwnedMessage>,
    bytes: usize,
    max_inputs: usize,
    max_bytes: usize,
}

impl Gathered {
    fn new(ctx: &IngressContext) -> Gathered {
        Gathered {
            messages: Vec::new(),
            bytes: 0,
            max_inputs: ctx.batch_max_inputs,
            max_bytes: ctx.batch_max_bytes,
        }
    }

    fn push(&mut self, message: OwnedMessage) {
        self.bytes += message.payload().map_or(0, <[u8]>::len);
        self.messages.push(message);
    }

    fn full(&self) -> bool {
        self.messages.len() >= self.max_inputs || self.bytes >= self.max_bytes
    }
}

/// Sleeps until `deadline`; for ever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Moves what is already queued in `messages` into `batch`, until it is full.
fn take_queued(messages: &mut tokio::sync::mpsc::Receiver<OwnedMessage>, batch: &mut Gathered) {
    while !batch.full() {
        match messages.try_recv() {
            Ok(m) => batch.push(m),
            Err(_) => break,
        }
    }
}

/// Applies one batch and stores its offsets. `Ok(None)` when shutdown
/// interrupted it (nothing of it stored, so it is redelivered).
async fn handle_batch(
    ctx: &IngressContext,
    lane: usize,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    ctx.progress.began(lane);
    let handled = handle_batch_in(ctx, lane, batch, shutdown).await;
    ctx.progress.finished(lane);
    if let Ok(Some(report)) = &handled {
        ctx.progress.handled(report);
    }
    handled
}

/// Applies `batch` after the lane's parked starts that are due, parks what
/// waits on a held key, and stores the offsets that passes.
async fn handle_batch_in(
    ctx: &IngressContext,
    lane: usize,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    // Canary: storing offsets first loses the batch on a crash.
    #[cfg(feature = "canary-offsets-before-commit")]
    store_offsets(
        ctx,
        &last_offsets(batch.iter())
            .into_iter()
            .map(|(at, offset)| (at, offset + 1))
            .collect(),
    );
    // Out of the lock while the batch applies; only this lane takes it.
    let mut parked = std::mem::take(&mut *ctx.parked(lane));
    let retried = parked.take_due(Instant::now());
    let mut holds = parked.holds(ctx.max_parked_starts);
    let processed = process_batch(ctx, batch, &retried, &mut holds, shutdown).await;
    let (report, held) = match processed {
        Ok(processed) => processed,
        Err(e) if shutdown.is_cancelled() => {
            // Interrupted while retrying: nothing of the batch is stored,
            // so it is redelivered after the restart.
            tracing::info!(
                error = format!("{e:#}"),
                "batch left for redelivery at shutdown"
            );
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    if ctx.hooks.fail_after_commit {
        anyhow::bail!("test hook: stopped after commit, before storing offsets");
    }
    let retried_held = held
        .iter()
        .filter(|s| retried_included(&retried, s))
        .count();
    parked.park(
        held,
        retried_held < retried.len(),
        ctx.retry,
        Instant::now(),
    );
    let next = parked.offsets(&report.last_offsets);
    metrics::gauge!("ductor_ingress_parked_starts", "lane" => lane.to_string())
        .set(parked.len() as f64);
    *ctx.parked(lane) = parked;
    crate::crash_point!("ingress.before_offset_store");
    #[cfg(not(feature = "canary-offsets-before-commit"))]
    store_offsets(ctx, &next);
    #[cfg(feature = "canary-offsets-before-commit")]
    let _ = next;
    Ok(Some(report))
}

/// Whether `start` is one of the parked starts the turn applied again.
fn retried_included(retried: &[ParkedStart], start: &ParkedStart) -> bool {
    retried.iter().any(|r| {
        r.message.topic() == start.message.topic()
            && r.message.partition() == start.message.partition()
            && r.message.offset() == start.message.offset()
    })
}

/// Waits for one message, until `first_by` if given, then gathers more
/// until the batch is full or the linger time has passed. `None` on
/// shutdown or at `first_by`, with nothing in hand.
async fn next_batch(
    ctx: &IngressContext,
    shutdown: &CancellationToken,
    first_by: Option<Instant>,
) -> anyhow::Result<Option<Vec<OwnedMessage>>> {
    let mut batch = Gathered::new(ctx);
    let given_up = async {
        match first_by {
            Some(deadline) => tokio::time::sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(given_up);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(None),
            _ = &mut given_up => return Ok(None),
            msg = ctx.consumer.recv() => match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    batch.push(m.detach());
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    let deadline = Instant::now() + ctx.batch_linger;
    while !batch.full() {
        tokio::select! {
            biased;
            msg = ctx.consumer.recv() => match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    batch.push(m.detach());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    break;
                }
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    Ok(Some(batch.messages))
}

/// Decodes, applies and dead-letters one batch, after the `retried`
/// parked starts. Returns only when every message of the batch is durably
/// handled or parked (the starts `holds` left out, returned with their
/// messages), with what became of them, or on shutdown/fatal error.
/// Offsets are the caller's to store.
async fn process_batch(
    ctx: &IngressContext,
    batch: &[OwnedMessage],
    retried: &[ParkedStart],
    holds: &mut Holds,
    shutdown: &CancellationToken,
) -> anyhow::Result<(StepReport, Vec<ParkedStart>)> {
    for msg in batch {
        record_age("ductor_ingress_apply_age_seconds", msg);
    }
    let mut sorted = sort(ctx, batch);
    sorted.retry_first(retried);
    let read = retried.iter().map(|s| &s.message).chain(batch);
    let mut step = StepReport {
        messages: batch.len() + retried.len(),
        last_offsets: last_offsets(read),
        undecodable: sorted.dead.len(),
        ..StepReport::default()
    };
    let mut held = Vec::new();
    if !sorted.pending.is_empty() || !sorted.routed.is_empty() {
        let report = ctx
            .applier
            .apply_isolating(&sorted.pending, &sorted.routed, ctx.retry, holds, shutdown)
            .await
            .context("applying batch")?;
        held = sorted.held(&report);
        step.parked = held.len();
        if !held.is_empty() {
            tracing::info!(
                starts = held.len(),
                "starts wait on idempotency keys other callers hold; parked beside the lane"
            );
        }
        settle_inputs(&report, &mut sorted, &mut step);
        settle_routed(&report, &mut sorted, &mut step);
        step.conflicts = report.conflicts;
        step.intents_written = report.intents_written;
        // With a fast lane the applier hands over and wakes by itself.
        if report.intents_written > 0
            && ctx.applier.handoff.is_none()
            && let Some(wakeup) = &ctx.wakeup
        {
            wakeup.wake();
        }
        if report.conflicts > 0 {
            tracing::debug!(
                conflicts = report.conflicts,
                "batch recomputed after conflicts"
            );
        }
    }
    for letter in &sorted.dead {
        ctx.dead_letters.publish(letter, shutdown).await?;
        metrics::counter!("ductor_inputs_total", "topic" => letter.message.topic().to_string(), "outcome" => "dead_lettered")
            .increment(1);
    }
    Ok((step, held))
}

/// A batch sorted by what each message is: inputs to apply, starts for the
/// routing plane, and dead letters, each input beside its message.
struct Sorted<'m> {
    pending: Vec<PendingInput>,
    pending_msgs: Vec<&'m OwnedMessage>,
    routed: Vec<routing::RouteRequest>,
    routed_msgs: Vec<&'m OwnedMessage>,
    dead: Vec<DeadLetter<'m>>,
}

impl<'m> Sorted<'m> {
    /// Puts parked starts applied again ahead of the batch's own: they were
    /// read first.
    fn retry_first(&mut self, retried: &'m [ParkedStart]) {
        self.routed
            .splice(0..0, retried.iter().map(|s| s.request.clone()));
        self.routed_msgs
            .splice(0..0, retried.iter().map(|s| &s.message));
    }

    /// The routed starts `report` left out, to park, with their messages.
    fn held(&self, report: &IsolatedBatch) -> Vec<ParkedStart> {
        report
            .held
            .iter()
            .map(|&at| ParkedStart {
                message: self.routed_msgs[at].clone(),
                request: self.routed[at].clone(),
            })
            .collect()
    }
}

/// Classifies every message of the batch read from one of the input topics.
fn sort<'m>(ctx: &IngressContext, batch: &'m [OwnedMessage]) -> Sorted<'m> {
    let mut sorted = Sorted {
        pending: Vec::with_capacity(batch.len()),
        pending_msgs: Vec::with_capacity(batch.len()),
        routed: Vec::new(),
        routed_msgs: Vec::new(),
        dead: Vec::new(),
    };
    for msg in batch {
        let Some(kind) = ctx.topic_kind(msg.topic()) else {
            continue;
        };
        let source = Source {
            topic: msg.topic().to_string(),
            partition: msg.partition(),
            offset: msg.offset(),
        };
        let payload = msg.payload().unwrap_or_default();
        let received = Received {
            reference_ms: reached_kafka_ms(msg),
            source: &source,
        };
        let classified = classify(kind, payload, &source, &ctx.limits).and_then(|c| {
            check_signature(
                &ctx.signatures,
                &c,
                payload,
                signature_header(msg),
                received,
            )?;
            Ok(c)
        });
        match classified {
            Ok(Classified::Routed(mut request)) => {
                request.source = Some(source);
                sorted.routed.push(*request);
                sorted.routed_msgs.push(msg);
            }
            Ok(Classified::Input(input)) => {
                sorted.pending.push(PendingInput {
                    input,
                    source: Some(source),
                });
                sorted.pending_msgs.push(msg);
            }
            Err(error) => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Decode,
                class: error.class.as_str().to_string(),
                error: error.message,
            }),
        }
    }
    sorted
}

/// The `ductor-signature` header of a message, if it has one.
/// When `msg` reached Kafka, for its signature's window: the broker's
/// append time where the topic keeps it (a copy produced later gets a
/// later one, a backlog keeps its own), else now.
fn reached_kafka_ms(msg: &OwnedMessage) -> i64 {
    match msg.timestamp() {
        rdkafka::Timestamp::LogAppendTime(ms) => ms,
        _ => chrono::Utc::now().timestamp_millis(),
    }
}

fn signature_header(msg: &OwnedMessage) -> Option<&[u8]> {
    use rdkafka::message::Headers;
    let headers = msg.headers()?;
    headers
        .iter()
        .find(|h| h.key == crate::contract::signature::SIGNATURE)
        .and_then(|h| h.value)
}

/// Counts what each input did, and dead-letters the rejected ones.
fn settle_inputs<'m>(report: &IsolatedBatch, sorted: &mut Sorted<'m>, step: &mut StepReport) {
    let inputs = report.outcomes.iter().zip(&sorted.pending);
    for ((outcome, input), &msg) in inputs.zip(&sorted.pending_msgs) {
        let Some(outcome) = settled(outcome, msg, &mut sorted.dead) else {
            step.failed += 1;
            continue;
        };
        let label = input_label(outcome);
        step.count(label);
        metrics::counter!("ductor_inputs_total", "topic" => msg.topic().to_string(), "outcome" => label)
            .increment(1);
        match outcome {
            InputOutcome::Rejected(rejection) => {
                if rejection.class == RejectionClass::IdempotencyMismatch {
                    routing::count_mismatch(match input.input {
                        Input::Start(_) => MismatchPath::ClientStart,
                        _ => MismatchPath::Signal,
                    });
                }
                sorted.dead.push(DeadLetter {
                    message: msg,
                    stage: Stage::Validate,
                    class: rejection.class.as_str().to_string(),
                    error: rejection.message.clone(),
                });
            }
            InputOutcome::NoOp(reason) => {
                tracing::debug!(
                    run_id = input.input.run_id(),
                    reason = reason.as_str(),
                    "input changed nothing"
                );
            }
            InputOutcome::Applied { .. } => {}
        }
    }
}

/// The `outcome` label of an input's `ductor_inputs_total`.
fn input_label(outcome: &InputOutcome) -> &'static str {
    match outcome {
        InputOutcome::Applied { .. } => "applied",
        InputOutcome::NoOp(NoOpReason::StaleResult) => "stale",
        InputOutcome::NoOp(_) => "deduplicated",
        InputOutcome::Rejected(_) => "rejected",
    }
}

/// Counts what each routed start got, and dead-letters a key reused for
/// another request and a start the routing plane refused.
fn settle_routed<'m>(report: &IsolatedBatch, sorted: &mut Sorted<'m>, step: &mut StepReport) {
    for (at, (outcome, &msg)) in report.routed.iter().zip(&sorted.routed_msgs).enumerate() {
        if report.held.binary_search(&at).is_ok() {
            continue;
        }
        let Some(outcome) = settled(outcome, msg, &mut sorted.dead) else {
            step.failed += 1;
            continue;
        };
        let (input_label, routing_label) = routed_labels(outcome);
        step.count(input_label);
        metrics::counter!("ductor_inputs_total", "topic" => msg.topic().to_string(), "outcome" => input_label)
            .increment(1);
        routing::count(routing_label);
        match outcome {
            RouteOutcome::Mismatch => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Route,
                class: "idempotency_mismatch".to_string(),
                error: "the idempotency key was already used for a different request".to_string(),
            }),
            RouteOutcome::Rejected(message) => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Validate,
                class: "unknown_workflow".to_string(),
                error: message.clone(),
            }),
            _ => {}
        }
    }
}

/// The `outcome` label of a routed start's `ductor_inputs_total` and its
/// routing outcome.
fn routed_labels(outcome: &RouteOutcome) -> (&'static str, &'static str) {
    match outcome {
        RouteOutcome::Decided { kind, .. } => ("applied", kind.as_str()),
        RouteOutcome::Duplicate { .. } => ("deduplicated", "duplicate"),
        RouteOutcome::Mismatch => ("rejected", "mismatch"),
        RouteOutcome::Rejected(_) => ("rejected", "rejected_request"),
        // Not produced inside a transaction that reserves for itself.
        RouteOutcome::ClaimLost => ("rejected", "in_progress"),
    }
}

/// The outcome of one input of an isolated batch, or `None` when it failed
/// on its own and its dead letter was queued in `dead`.
fn settled<'r, 'm, T>(
    outcome: &'r Option<Result<T, crate::apply::ApplyFailure>>,
    msg: &'m OwnedMessage,
    dead: &mut Vec<DeadLetter<'m>>,
) -> Option<&'r T> {
    match outcome {
        Some(Ok(outcome)) => Some(outcome),
        Some(Err(failure)) => {
            dead.push(DeadLetter::isolated(msg, failure));
            None
        }
        None => unreachable!("every input of an isolated batch has an outcome"),
    }
}

/// Records how long ago `msg` was produced (its Kafka timestamp), when the
/// ingress fetched it or began to apply it: the input's age, in seconds.
fn record_age<M: Message>(name: &'static str, msg: &M) {
    if let Some(ms) = msg.timestamp().to_millis() {
        let now_ms = chrono::Utc::now().timestamp_millis();
        metrics::histogram!(name).record((now_ms - ms).max(0) as f64 / 1000.0);
    }
}

/// Stores `next`, the next offset to read of each partition. A partition
/// that was revoked meanwhile refuses the store; its new owner re-reads the
/// messages and they apply as no-ops.
fn store_offsets(ctx: &IngressContext, next: &BTreeMap<(String, i32), i64>) {
    if let Err(e) = ctx.consumer.store_offsets(&offset_list(next)) {
        tracing::info!(error = %e, "offsets not stored (partition revoked?); they will be redelivered as no-ops");
    }
}

/// The offsets to store once `batch` is applied: for each of its
/// partitions, one past its last message.
#[cfg(any(test, feature = "internals"))]
pub fn next_offsets(batch: &[OwnedMessage]) -> TopicPartitionList {
    let next = last_offsets(batch.iter())
        .into_iter()
        .map(|(at, offset)| (at, offset + 1))
        .collect();
    offset_list(&next)
}

/// `next` as the consumer stores it.
fn offset_list(next: &BTreeMap<(String, i32), i64>) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(next.len());
    for ((topic, partition), offset) in next {
        if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(error = %e, topic, partition, "could not record offset");
        }
    }
    tpl
}

/// The offset of the last message of `batch` on each of its partitions.
fn last_offsets<'m>(batch: impl Iterator<Item = &'m OwnedMessage>) -> BTreeMap<(String, i32), i64> {
    let mut last: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for msg in batch {
        let entry = last
            .entry((msg.topic().to_string(), msg.partition()))
            .or_insert(msg.offset());
        *entry = (*entry).max(msg.offset());
    }
    last
}
