//! The real pipeline in-process (`serve::run` plus an echo worker), measured
//! closed-loop for capacity and open-loop for latency.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::future::join_all;
use hdrhistogram::Histogram;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use serde_json::json;
use sqlx::Row;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::env::{BenchEnv, INPUTS_PER_RUN, POOL, WORKFLOW};
use super::stats::{
    CpuCores, CpuTicks, Histograms, PgCounters, PgPerInput, Progress, Watchdog, messages_between,
    topic_offsets,
};
use ductor::client::worker::{StepDispatch, StepOutcome, WorkerOptions};
use ductor::config::Config;

/// How often a wait looks at the database.
const POLL: Duration = Duration::from_millis(250);
/// A wait fails when nothing moved for this long.
const STALL: Duration = Duration::from_secs(30);
/// Bound of the channel from the events reader to the latency recorder.
const EVENT_CHANNEL: usize = 65_536;
/// Longest latency the histogram records, in microseconds (10 minutes).
const MAX_LATENCY_US: u64 = 600_000_000;

/// The start request of run `i`, the same shape and size in every phase
/// (and in the Kafka-only baseline).
pub fn start_request(run_id: &str, i: usize) -> String {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "bench", "workflow": WORKFLOW,
        "input": {"order": i, "sku": "bench-item-0001", "qty": 1, "note": "echoed by every step"},
    })
    .to_string()
}

/// Produces the start requests of `prefix-0 .. prefix-(n-1)` to the
/// requests topic of `config`, and waits for every acknowledgement.
pub async fn produce_start_requests(
    producer: &FutureProducer,
    config: &Config,
    prefix: &str,
    n: usize,
) -> anyhow::Result<()> {
    produce_all(
        producer,
        &config.topic_names().requests(),
        &start_requests(prefix, n),
        Duration::from_millis(config.kafka.delivery_timeout_ms),
    )
    .await
}

/// The start requests of runs `prefix-0 .. prefix-(n-1)`, keyed by run id.
fn start_requests(prefix: &str, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            let value = start_request(&id, i);
            (id, value)
        })
        .collect()
}

/// Worker options for the bench: enough handlers in flight that the echo
/// worker is never what limits the pipeline.
pub fn worker_options(config: &Config, max_in_flight: usize) -> WorkerOptions {
    let mut options = WorkerOptions::from_config(config, POOL);
    options.max_in_flight = max_in_flight;
    options
}

/// The echo worker's handler: a step's output is its input.
pub async fn echo(step: StepDispatch) -> StepOutcome {
    StepOutcome::Succeeded(step.input)
}

/// The real worker library with the echo handler, on the steps of
/// `config`'s pool, until `shutdown`.
pub fn spawn_echo_worker(
    config: &Config,
    max_in_flight: usize,
    shutdown: &CancellationToken,
) -> JoinHandle<anyhow::Result<()>> {
    tokio::spawn(ductor::client::worker::run(
        worker_options(config, max_in_flight),
        echo,
        shutdown.clone(),
    ))
}

/// Enqueues `(key, value)` pairs on `topic` as fast as the producer takes
/// them, then waits for every acknowledgement.
pub async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    messages: &[(String, String)],
    timeout: Duration,
) -> anyhow::Result<()> {
    let mut pending = Vec::with_capacity(messages.len());
    for (key, value) in messages {
        pending.push(enqueue(producer, topic, key, value).await?);
    }
    let acks = tokio::time::timeout(timeout, join_all(pending))
        .await
        .context("producing start requests: acknowledgements timed out")?;
    for ack in acks {
        match ack {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => anyhow::bail!("producing a start request: {e}"),
            Err(_) => anyhow::bail!("producing a start request: the producer went away"),
        }
    }
    Ok(())
}

/// Enqueues one message without waiting for its acknowledgement; waits
/// only while librdkafka's queue is full.
async fn enqueue(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    value: &str,
) -> anyhow::Result<DeliveryFuture> {
    loop {
        match producer.send_result(FutureRecord::to(topic).key(key).payload(value)) {
            Ok(delivery) => return Ok(delivery),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err((e, _)) => return Err(e).context("enqueueing a start request"),
        }
    }
}

/// `serve::run` and the echo worker, stopped on drop.
/// What the open-loop latency phases and the idle phase drive: Ductor's
/// pipeline, or the hop floor B3.
pub trait Target {
    /// The configuration of its topics.
    fn config(&self) -> &Config;
    /// The bench's producer of its start requests.
    fn producer(&self) -> &FutureProducer;
    /// Fails if a part of it has stopped.
    fn check_alive(&mut self) -> anyhow::Result<()>;
    /// Waits until the `n` runs whose ids start with `prefix-` are finished,
    /// showing progress; fails if one did not succeed, on a stall, or after
    /// `limit`.
    fn wait_finished(
        &mut self,
        env: &BenchEnv,
        prefix: &str,
        n: usize,
        limit: Duration,
        progress: &mut Progress,
        label: &str,
    ) -> impl Future<Output = anyhow::Result<()>>;
}

impl Target for Pipeline {
    fn config(&self) -> &Config {
        &self.config
    }

    fn producer(&self) -> &FutureProducer {
        &self.producer
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, slot) in [
            ("ductor serve", &mut self.serve),
            ("echo worker", &mut self.worker),
        ] {
            if slot.as_ref().is_some_and(|h| h.is_finished()) {
                anyhow::bail!("{name} stopped while the bench was running; see its log above");
            }
        }
        Ok(())
    }

    async fn wait_finished(
        &mut self,
        env: &BenchEnv,
        prefix: &str,
        n: usize,
        limit: Duration,
        progress: &mut Progress,
        label: &str,
    ) -> anyhow::Result<()> {
        let pattern = format!("{prefix}-%");
        let mut watchdog = Watchdog::new(label, limit, STALL);
        let started = Instant::now();
        loop {
            self.check_alive()?;
            let row = sqlx::query(
                "SELECT count(*) FILTER (WHERE status <> 'running') AS done, \
                     count(*) FILTER (WHERE status IN ('failed', 'cancelled')) AS bad \
                 FROM runs WHERE run_id LIKE $1",
            )
            .bind(&pattern)
            .fetch_one(&env.pool)
            .await
            .context("counting finished runs")?;
            let done: i64 = row.try_get("done")?;
            let bad: i64 = row.try_get("bad")?;
            anyhow::ensure!(
                bad == 0,
                "{label}: {bad} runs failed; the echo worker never fails, so this is a bug"
            );
            let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
            progress.update(&format!(
                "{label}: {done}/{n} runs finished ({rate:.0} runs/s)"
            ));
            if done as usize >= n {
                return Ok(());
            }
            watchdog.check(done as u64, n as u64)?;
            tokio::time::sleep(POLL).await;
        }
    }
}

pub struct Pipeline {
    pub config: Config,
    pub producer: FutureProducer,
    shutdown: CancellationToken,
    serve: Option<JoinHandle<anyhow::Result<()>>>,
    worker: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Pipeline {
    /// Creates the topics of `name` and starts the pipeline under `parent`.
    pub async fn start(
        env: &BenchEnv,
        name: &str,
        worker_in_flight: usize,
        parent: &CancellationToken,
    ) -> anyhow::Result<Pipeline> {
        let config = env.pipeline_config(name);
        env.create_topics(&config).await?;
        let shutdown = parent.child_token();
        let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
        let worker = spawn_echo_worker(&config, worker_in_flight, &shutdown);
        let producer = ductor::infra::kafka::producer(&config.kafka, "bench-client")?;
        Ok(Pipeline {
            config,
            producer,
            shutdown,
            serve: Some(serve),
            worker: Some(worker),
        })
    }

    /// Stops both tasks and reports how they ended.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let grace =
            Duration::from_millis(self.config.server.shutdown_grace_ms) + Duration::from_secs(5);
        for (name, handle) in [
            ("ductor serve", self.serve.take()),
            ("echo worker", self.worker.take()),
        ] {
            let Some(handle) = handle else { continue };
            match tokio::time::timeout(grace, handle).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(e.context(format!("{name} failed"))),
                Ok(Err(e)) => anyhow::bail!("{name} panicked: {e}"),
                Err(_) => anyhow::bail!("{name} did not stop within {} s", grace.as_secs()),
            }
        }
        Ok(())
    }

    /// Produces the start requests of `prefix-0 .. prefix-(n-1)`.
    pub async fn start_runs(&self, prefix: &str, n: usize) -> anyhow::Result<()> {
        produce_start_requests(&self.producer, &self.config, prefix, n).await
    }

    /// Waits until no due intent is left undelivered.
    pub async fn wait_drained(&mut self, env: &BenchEnv, label: &str) -> anyhow::Result<()> {
        let mut watchdog = Watchdog::new(
            format!("{label}: draining the outbox"),
            Duration::from_secs(120),
            STALL,
        );
        let mut first: Option<i64> = None;
        loop {
            self.check_alive()?;
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM eec_effect_intent WHERE status <> 'completed' AND not_before <= now()",
            )
            .fetch_one(&env.pool)
            .await
            .context("counting undelivered intents")?;
            if left == 0 {
                return Ok(());
            }
            let total = *first.get_or_insert(left);
            watchdog.check((total - left).max(0) as u64, total as u64)?;
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Closed-loop capacity of the whole pipeline over a backlog of runs.
#[derive(Debug, Clone, Serialize)]
pub struct Capacity {
    /// As a session opened after the setting sees it (the pipeline's own
    /// connections are all opened after it).
    pub synchronous_commit: String,
    pub runs: usize,
    /// From the first applied input of the backlog to its last finished run.
    pub seconds: f64,
    /// Applied inputs per second: every applied input writes one transition
    /// row, duplicates and stale inputs write none.
    pub inputs_per_s: f64,
    pub transitions_per_s: f64,
    pub runs_per_s: f64,
    pub transitions: u64,
    /// Messages produced to all topics (requests, results, dispatches,
    /// events) per applied input.
    pub msgs_per_input: f64,
    /// Seconds to produce the backlog's start requests.
    pub backlog_produce_s: f64,
    pub profile: CapacityProfile,
}

/// Where the time went during a capacity window.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityProfile {
    /// Apply transactions, their mean size and duration.
    pub batches: f64,
    pub inputs_per_batch: f64,
    pub apply_ms_avg: f64,
    /// Share of the window the single ingress loop spent inside apply.
    pub apply_busy_pct: f64,
    /// Mean broker acknowledgement time of a drainer publish.
    pub publish_ms_avg: f64,
    pub avg_event_bytes: f64,
    pub avg_dispatch_bytes: f64,
    pub avg_headers_bytes: f64,
    pub postgres_per_input: PgPerInput,
    pub cpu_cores: CpuCores,
}

/// Warm-up, then a backlog of `runs` produced at once and applied by the
/// running pipeline.
pub async fn capacity(
    env: &BenchEnv,
    pipeline: &mut Pipeline,
    label: &str,
    synchronous_commit: String,
    runs: usize,
    warmup_runs: usize,
    progress: &mut Progress,
) -> anyhow::Result<Capacity> {
    warm_up(env, pipeline, label, warmup_runs, progress).await?;
    let before = Sample::before_backlog(env, pipeline).await?;

    let prefix = format!("cap-{label}");
    let produce_started = Instant::now();
    pipeline.start_runs(&prefix, runs).await?;
    let backlog_produce_s = produce_started.elapsed().as_secs_f64();
    let limit = Duration::from_secs(120) + Duration::from_millis(100 * runs as u64);
    pipeline
        .wait_finished(
            env,
            &prefix,
            runs,
            limit,
            progress,
            &format!("capacity ({label})"),
        )
        .await?;
    let after = Sample::after_backlog(env, pipeline, label).await?;

    let pattern = format!("{prefix}-%");
    let window = Window::measure(env, &pattern, label, runs).await?;
    let sizes = EffectSizes::measure(env, &pipeline.config, &pattern).await?;
    let transitions = window.transitions;
    let seconds = window.seconds;
    let messages = messages_between(&before.offsets, &after.offsets);
    Ok(Capacity {
        synchronous_commit,
        runs,
        seconds,
        inputs_per_s: transitions as f64 / seconds,
        transitions_per_s: transitions as f64 / seconds,
        runs_per_s: runs as f64 / seconds,
        transitions,
        msgs_per_input: messages as f64 / transitions as f64,
        backlog_produce_s,
        profile: CapacityProfile::between(&before, &after, &window, sizes),
    })
}

/// Warm-up: consumer groups joined, connections open, statements prepared,
/// the outbox drained and the planner statistics current.
async fn warm_up(
    env: &BenchEnv,
    pipeline: &mut Pipeline,
    label: &str,
    warmup_runs: usize,
    progress: &mut Progress,
) -> anyhow::Result<()> {
    let warm = format!("warm-{label}");
    pipeline.start_runs(&warm, warmup_runs).await?;
    pipeline
        .wait_finished(
            env,
            &warm,
            warmup_runs,
            Duration::from_secs(120),
            progress,
            &format!("warm-up ({label})"),
        )
        .await?;
    pipeline.wait_drained(env, label).await?;
    env.analyze().await
}

/// The counters a capacity window is measured between.
struct Sample {
    offsets: BTreeMap<String, i64>,
    pg: PgCounters,
    hist: Histograms,
    cpu: CpuTicks,
}

impl Sample {
    /// Sampled once the warm-up has settled, just before the backlog is
    /// produced.
    async fn before_backlog(env: &BenchEnv, pipeline: &Pipeline) -> anyhow::Result<Sample> {
        let offsets = topic_offsets(&pipeline.config.kafka, &pipeline.config.all_topics()).await?;
        let pg = PgCounters::sample(&env.pool, &env.db_name).await?;
        let hist = Histograms::sample();
        let cpu = CpuTicks::sample(&env.cpu);
        Ok(Sample {
            offsets,
            pg,
            hist,
            cpu,
        })
    }

    /// The CPU time and Ductor's metrics as soon as the backlog's runs are
    /// finished; the messages and Postgres' work once the outbox has also
    /// published the backlog's last effects.
    async fn after_backlog(
        env: &BenchEnv,
        pipeline: &mut Pipeline,
        label: &str,
    ) -> anyhow::Result<Sample> {
        let cpu = CpuTicks::sample(&env.cpu);
        let hist = Histograms::sample();
        pipeline.wait_drained(env, label).await?;
        let offsets = topic_offsets(&pipeline.config.kafka, &pipeline.config.all_topics()).await?;
        let pg = PgCounters::sample(&env.pool, &env.db_name).await?;
        Ok(Sample {
            offsets,
            pg,
            hist,
            cpu,
        })
    }
}

/// The backlog's window in the database: from its first applied input to
/// its last finished run, and the transitions written in between.
struct Window {
    seconds: f64,
    transitions: u64,
}

impl Window {
    /// Measures the window of the runs matching `pattern`; fails unless
    /// every input of the `runs` runs wrote its transition.
    async fn measure(
        env: &BenchEnv,
        pattern: &str,
        label: &str,
        runs: usize,
    ) -> anyhow::Result<Window> {
        let row = sqlx::query(
            "SELECT EXTRACT(EPOCH FROM (SELECT max(finished_at) FROM runs WHERE run_id LIKE $1) \
                 - (SELECT min(created_at) FROM run_transitions WHERE run_id LIKE $1))::float8 AS seconds, \
                 (SELECT count(*) FROM run_transitions WHERE run_id LIKE $1) AS transitions",
        )
        .bind(pattern)
        .fetch_one(&env.pool)
        .await
        .context("measuring the capacity window")?;
        let seconds: f64 = row.try_get::<Option<f64>, _>("seconds")?.unwrap_or(0.0);
        let transitions = row.try_get::<i64, _>("transitions")? as u64;
        anyhow::ensure!(
            seconds > 0.0,
            "capacity ({label}): empty measurement window"
        );
        anyhow::ensure!(
            transitions == runs as u64 * INPUTS_PER_RUN as u64,
            "capacity ({label}): {transitions} transitions for {runs} runs, expected {} each",
            INPUTS_PER_RUN
        );
        Ok(Window {
            seconds,
            transitions,
        })
    }
}

/// Mean sizes of the effects the backlog wrote, in bytes.
struct EffectSizes {
    event: f64,
    dispatch: f64,
    headers: f64,
}

impl EffectSizes {
    /// Of the intents of the runs matching `pattern`.
    async fn measure(
        env: &BenchEnv,
        config: &Config,
        pattern: &str,
    ) -> anyhow::Result<EffectSizes> {
        let names = config.topic_names();
        let sizes = sqlx::query(
            "SELECT coalesce(avg(octet_length(payload)) FILTER (WHERE topic = $2), 0)::float8 AS event, \
                 coalesce(avg(octet_length(payload)) FILTER (WHERE topic = $3), 0)::float8 AS dispatch, \
                 coalesce(avg(octet_length(headers::text)), 0)::float8 AS headers \
             FROM eec_effect_intent WHERE run_id LIKE $1",
        )
        .bind(pattern)
        .bind(names.events())
        .bind(names.steps(POOL))
        .fetch_one(&env.pool)
        .await
        .context("measuring effect sizes")?;
        Ok(EffectSizes {
            event: sizes.try_get("event")?,
            dispatch: sizes.try_get("dispatch")?,
            headers: sizes.try_get("headers")?,
        })
    }
}

impl CapacityProfile {
    /// Where the time of `window` went, from the counters around it.
    fn between(
        before: &Sample,
        after: &Sample,
        window: &Window,
        sizes: EffectSizes,
    ) -> CapacityProfile {
        let (batches, apply_s) = before.hist.delta(&after.hist, "ductor_apply_seconds");
        let (_, batch_inputs) = before.hist.delta(&after.hist, "ductor_apply_batch_size");
        let (publishes, publish_s) = before
            .hist
            .delta(&after.hist, "ductor_outbox_publish_seconds");
        CapacityProfile {
            batches,
            inputs_per_batch: batch_inputs / batches.max(1.0),
            apply_ms_avg: 1000.0 * apply_s / batches.max(1.0),
            apply_busy_pct: 100.0 * apply_s / window.seconds,
            publish_ms_avg: 1000.0 * publish_s / publishes.max(1.0),
            avg_event_bytes: sizes.event,
            avg_dispatch_bytes: sizes.dispatch,
            avg_headers_bytes: sizes.headers,
            postgres_per_input: before.pg.per_input(&after.pg, window.transitions),
            cpu_cores: before.cpu.cores_until(&after.cpu),
        }
    }
}

/// The phases of an apply transaction, in order.
pub const APPLY_PHASES: [&str; 5] = ["begin", "load", "fold", "write", "commit"];

/// Open-loop latency at one rate.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Percent of the measured capacity (runs/s, synchronous commit on).
    pub load_pct: u32,
    pub runs_per_s: f64,
    /// Inputs per second the pipeline applies at this rate (each run brings
    /// its start and one result per step).
    pub inputs_per_s: f64,
    pub runs: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub profile: LatencyProfile,
}

/// The latency split at the coordinator's fold (the `at` of the event, the
/// wall-clock time of the apply): before it, producing, fetching, batching
/// and loading; after it, the rest of the apply and its commit, the drainer
/// round and the publish, and the bench's fetch. The part after the fold is
/// split again at the event's produce time (its Kafka timestamp, in whole
/// milliseconds): commit and hand-over before it, the Kafka hop after.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyProfile {
    pub to_fold_p50_ms: f64,
    pub to_fold_p99_ms: f64,
    pub fold_to_event_p50_ms: f64,
    pub fold_to_event_p99_ms: f64,
    pub fold_to_produce_p50_ms: f64,
    pub fold_to_produce_p99_ms: f64,
    pub produce_to_consume_p50_ms: f64,
    pub produce_to_consume_p99_ms: f64,
    /// Means over every input and batch of the phase (starts and results):
    /// an input's age when the ingress fetched it and when its batch began
    /// to apply, the apply transactions' size and duration, and the broker
    /// acknowledgement time of a drainer publish.
    pub fetch_age_ms_avg: f64,
    pub apply_age_ms_avg: f64,
    pub inputs_per_batch: f64,
    pub apply_ms_avg: f64,
    /// Mean time of each phase of an apply transaction (`begin`, `load`,
    /// `fold`, `write`, `commit`; see `ductor_apply_phase_seconds`).
    pub apply_phase_ms_avg: BTreeMap<String, f64>,
    pub publish_ms_avg: f64,
    /// Cores used while the phase's requests were sent and started.
    pub cpu_cores: CpuCores,
}

/// Reads the events topic from its current end and forwards `(run_id,
/// arrival)` of every `run.started` event (transition seq 1).
struct EventsReader {
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    arrivals: mpsc::Receiver<Arrival>,
}

/// A `run.started` event as the reader saw it.
struct Arrival {
    run_id: String,
    at: Instant,
    at_wall: DateTime<Utc>,
    /// The coordinator's `now` when it folded the start (the event's `at`).
    folded: Option<DateTime<Utc>>,
    /// When the drainer produced the event (its Kafka timestamp).
    produced: Option<DateTime<Utc>>,
}

impl EventsReader {
    async fn start(config: &Config, parent: &CancellationToken) -> anyhow::Result<EventsReader> {
        let consumer = events_consumer(config).await?;
        let (tx, arrivals) = mpsc::channel(EVENT_CHANNEL);
        let stop = parent.child_token();
        let task = tokio::spawn(forward_arrivals(consumer, tx, stop.clone()));
        Ok(EventsReader {
            stop,
            task,
            arrivals,
        })
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        drop(self.arrivals);
        self.task.await.context("events reader panicked")?
    }
}

/// A consumer of the events topic, assigned at its current end so that only
/// the events of runs started from now on arrive.
pub async fn events_consumer(config: &Config) -> anyhow::Result<StreamConsumer> {
    let topic = config.topic_names().events();
    let ends = topic_offsets_by_partition(config, &topic).await?;
    let mut cfg = ductor::infra::kafka::consumer_config(
        &config.kafka,
        &format!("{}-bench-events", config.kafka.group_id),
        "bench-events",
    );
    cfg.set("enable.auto.commit", "false");
    let consumer: StreamConsumer = cfg.create().context("creating the events reader")?;
    let mut tpl = TopicPartitionList::new();
    for (partition, high) in ends {
        tpl.add_partition_offset(&topic, partition, Offset::Offset(high))
            .context("assigning the events topic")?;
    }
    consumer
        .assign(&tpl)
        .context("assigning the events topic")?;
    Ok(consumer)
}

/// Forwards every `run.started` event to `tx` until `stop`, or until the
/// receiving end is gone.
async fn forward_arrivals(
    consumer: StreamConsumer,
    tx: mpsc::Sender<Arrival>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let message = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            m = consumer.recv() => m.context("reading the events topic")?,
        };
        let at = Instant::now();
        let at_wall = Utc::now();
        let Some(arrival) = Arrival::of_run_started(&message, at, at_wall) else {
            continue;
        };
        if tx.send(arrival).await.is_err() {
            return Ok(());
        }
    }
}

impl Arrival {
    /// The arrival of `message`, read at `at` (`at_wall` on the wall clock),
    /// if it is a run's first event.
    fn of_run_started(
        message: &impl Message,
        at: Instant,
        at_wall: DateTime<Utc>,
    ) -> Option<Arrival> {
        let first = message
            .headers()
            .and_then(|hs| hs.iter().find(|h| h.key == "ductor-seq"))
            .is_some_and(|h| h.value == Some(b"1".as_slice()));
        if !first {
            return None;
        }
        let run_id = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned())?;
        let folded = message
            .payload()
            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
            .and_then(|v| {
                v["at"]
                    .as_str()
                    .and_then(|a| DateTime::parse_from_rfc3339(a).ok())
            })
            .map(|t| t.with_timezone(&Utc));
        let produced = message
            .timestamp()
            .to_millis()
            .and_then(DateTime::from_timestamp_millis);
        Some(Arrival {
            run_id,
            at,
            at_wall,
            folded,
            produced,
        })
    }
}

/// High watermark of every partition of `topic`.
async fn topic_offsets_by_partition(
    config: &Config,
    topic: &str,
) -> anyhow::Result<Vec<(i32, i64)>> {
    let kafka = config.kafka.clone();
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_millis(kafka.admin_timeout_ms);
        let consumer: rdkafka::consumer::BaseConsumer =
            ductor::infra::kafka::consumer_config(&kafka, "bench-offsets", "offsets")
                .create()
                .context("creating the offsets client")?;
        let metadata = consumer.fetch_metadata(Some(&topic), timeout)?;
        let mut out = Vec::new();
        for t in metadata.topics() {
            for p in t.partitions() {
                let (_, high) = consumer.fetch_watermarks(&topic, p.id(), timeout)?;
                out.push((p.id(), high));
            }
        }
        anyhow::ensure!(!out.is_empty(), "topic {topic} has no partitions");
        Ok(out)
    })
    .await
    .context("offsets task")?
}

/// One open-loop phase per entry of `load_pcts`, each `duration` long, at
/// that percentage of `capacity_runs_per_s`. Latency runs from the
/// *intended* send time of a start request to the arrival of its
/// `run.started` event, so a stalled sender or pipeline shows up in full.
pub async fn latency(
    env: &BenchEnv,
    pipeline: &mut impl Target,
    loads: &Loads<'_>,
    parent: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<Vec<Latency>> {
    let mut reader = EventsReader::start(pipeline.config(), parent).await?;
    let mut out = Vec::with_capacity(loads.pcts.len());
    let (duration, round) = (loads.duration, loads.round);
    for &pct in loads.pcts {
        let rate = loads.reference_runs_per_s * f64::from(pct) / 100.0;
        anyhow::ensure!(
            rate > 0.0,
            "latency at {pct}%: the measured capacity is zero"
        );
        let schedule = Schedule::new(pct, rate, duration, round, pipeline.config());
        let figures = one_rate(env, pipeline, &mut reader, &schedule, progress).await;
        match figures {
            Ok(f) => {
                progress.done(&format!(
                    "latency at {pct}% ({:.0} runs/s): p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms",
                    f.runs_per_s, f.p50_ms, f.p99_ms, f.p999_ms
                ));
                out.push(f);
            }
            Err(e) => {
                let _ = reader.stop().await;
                return Err(e);
            }
        }
    }
    reader.stop().await?;
    Ok(out)
}

/// The open-loop rates of one latency pass: `pcts` % of
/// `reference_runs_per_s`, `duration` each; `round` tells its runs from
/// other passes' at the same rates.
pub struct Loads<'a> {
    pub reference_runs_per_s: f64,
    pub pcts: &'a [u32],
    pub duration: Duration,
    pub round: usize,
}

/// One open-loop phase at `rate` runs/s for `duration`: start requests sent
/// on schedule, each run's latency recorded when its `run.started` event
/// arrives, then the phase's runs left to finish.
async fn one_rate(
    env: &BenchEnv,
    pipeline: &mut impl Target,
    reader: &mut EventsReader,
    schedule: &Schedule,
    progress: &mut Progress,
) -> anyhow::Result<Latency> {
    let sender = send_on_schedule(pipeline, schedule);
    let mut histograms = LatencyHistograms::new()?;
    let hist_before = Histograms::sample();
    let cpu_before = CpuTicks::sample(&env.cpu);
    record_arrivals(pipeline, reader, schedule, &mut histograms, progress).await?;
    sender.await.context("the latency sender panicked")??;
    let hist_after = Histograms::sample();
    let cpu_after = CpuTicks::sample(&env.cpu);
    // Let the phase's runs finish, so the next rate starts from a quiet pipeline.
    pipeline
        .wait_finished(
            env,
            &schedule.prefix,
            schedule.n,
            Duration::from_secs(120),
            progress,
            &schedule.label,
        )
        .await?;
    let profile = histograms.profile(
        &hist_before,
        &hist_after,
        cpu_before.cores_until(&cpu_after),
    );
    Ok(histograms.latency(schedule, profile))
}

/// When each start request of one rate is due: `n` requests, `period`
/// apart, the first shortly after the schedule is made.
struct Schedule {
    pct: u32,
    rate: f64,
    duration: Duration,
    n: usize,
    period: Duration,
    prefix: String,
    label: String,
    topic: String,
    t0: tokio::time::Instant,
    t0_wall: DateTime<Utc>,
    intended: Vec<Instant>,
}

impl Schedule {
    /// Round `round` of the rate `pct` % (its runs' ids differ from every
    /// other round's).
    fn new(pct: u32, rate: f64, duration: Duration, round: usize, config: &Config) -> Schedule {
        let n = ((rate * duration.as_secs_f64()).ceil() as usize).max(2);
        let period = Duration::from_secs_f64(1.0 / rate);
        let prefix = format!("lat{pct}r{round}");
        let label = format!("latency at {pct}% ({rate:.0} runs/s)");
        let topic = config.topic_names().requests();
        let t0 = tokio::time::Instant::now() + Duration::from_millis(50);
        let t0_wall = Utc::now() + chrono::Duration::milliseconds(50);
        let intended: Vec<Instant> = (0..n)
            .map(|i| t0.into_std() + period.mul_f64(i as f64))
            .collect();
        Schedule {
            pct,
            rate,
            duration,
            n,
            period,
            prefix,
            label,
            topic,
            t0,
            t0_wall,
            intended,
        }
    }

    /// The index of `run_id` in this schedule, if it is one of its runs.
    fn index(&self, run_id: &str) -> Option<usize> {
        run_id
            .strip_prefix(&self.prefix)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|&i| i < self.n)
    }

    /// The wall-clock time request `i` was due.
    fn intended_wall(&self, i: usize) -> anyhow::Result<DateTime<Utc>> {
        Ok(self.t0_wall + chrono::Duration::from_std(self.period.mul_f64(i as f64))?)
    }
}

/// The sender keeps to the schedule whatever happens downstream; it only
/// enqueues, acknowledgements are collected at the end.
fn send_on_schedule(pipeline: &impl Target, schedule: &Schedule) -> JoinHandle<anyhow::Result<()>> {
    let producer = pipeline.producer().clone();
    let prefix = schedule.prefix.clone();
    let topic = schedule.topic.clone();
    let (n, t0, period) = (schedule.n, schedule.t0, schedule.period);
    let timeout = Duration::from_millis(pipeline.config().kafka.delivery_timeout_ms);
    tokio::spawn(async move {
        let mut acks = Vec::with_capacity(n);
        for i in 0..n {
            tokio::time::sleep_until(t0 + period.mul_f64(i as f64)).await;
            let id = format!("{prefix}-{i}");
            acks.push(enqueue(&producer, &topic, &id, &start_request(&id, i)).await?);
        }
        let acks = tokio::time::timeout(timeout, join_all(acks))
            .await
            .context("start requests were not acknowledged in time")?;
        let failed = acks.iter().filter(|a| !matches!(a, Ok(Ok(_)))).count();
        anyhow::ensure!(failed == 0, "{failed} start requests failed to publish");
        Ok(())
    })
}

/// Records the first arrival of every run of `schedule`, until all have
/// started; fails if the pipeline or the reader stops, or on a stall.
async fn record_arrivals(
    pipeline: &mut impl Target,
    reader: &mut EventsReader,
    schedule: &Schedule,
    histograms: &mut LatencyHistograms,
    progress: &mut Progress,
) -> anyhow::Result<()> {
    let (n, label) = (schedule.n, &schedule.label);
    let mut seen = vec![false; n];
    let mut count = 0usize;
    let mut watchdog = Watchdog::new(
        label.clone(),
        schedule.duration + Duration::from_secs(60),
        STALL,
    );
    let mut last_show = Instant::now();
    while count < n {
        pipeline.check_alive()?;
        let arrival = tokio::time::timeout(POLL, reader.arrivals.recv()).await;
        match arrival {
            Ok(Some(arrival)) => {
                if let Some(i) = schedule.index(&arrival.run_id)
                    && !seen[i]
                {
                    seen[i] = true;
                    count += 1;
                    histograms.record(&arrival, schedule, i)?;
                }
            }
            Ok(None) => anyhow::bail!("{label}: the events reader stopped"),
            Err(_) => {}
        }
        if last_show.elapsed() >= POLL {
            progress.update(&format!("{label}: {count}/{n} runs started"));
            last_show = Instant::now();
        }
        watchdog.check(count as u64, n as u64)?;
    }
    Ok(())
}

/// The latency of every run of one rate, and its split at the fold and at
/// the event's produce time, in microseconds.
struct LatencyHistograms {
    total: Histogram<u64>,
    to_fold: Histogram<u64>,
    fold_to_event: Histogram<u64>,
    fold_to_produce: Histogram<u64>,
    produce_to_consume: Histogram<u64>,
}

impl LatencyHistograms {
    fn new() -> anyhow::Result<LatencyHistograms> {
        let new_histogram = || {
            Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_US, 3)
                .context("creating a latency histogram")
        };
        Ok(LatencyHistograms {
            total: new_histogram()?,
            to_fold: new_histogram()?,
            fold_to_event: new_histogram()?,
            fold_to_produce: new_histogram()?,
            produce_to_consume: new_histogram()?,
        })
    }

    /// Records run `i` of `schedule`: from its intended send time to the
    /// arrival of its event, and the parts the event's timestamps tell.
    fn record(&mut self, arrival: &Arrival, schedule: &Schedule, i: usize) -> anyhow::Result<()> {
        let us = arrival
            .at
            .saturating_duration_since(schedule.intended[i])
            .as_micros();
        record(&mut self.total, us as i64);
        if let Some(folded) = arrival.folded {
            let intended_wall = schedule.intended_wall(i)?;
            let micros = |d: chrono::Duration| d.num_microseconds().unwrap_or(0);
            record(&mut self.to_fold, micros(folded - intended_wall));
            record(&mut self.fold_to_event, micros(arrival.at_wall - folded));
            if let Some(produced) = arrival.produced {
                record(&mut self.fold_to_produce, micros(produced - folded));
                record(
                    &mut self.produce_to_consume,
                    micros(arrival.at_wall - produced),
                );
            }
        }
        Ok(())
    }

    /// The split at the fold and Ductor's own means over the phase, from
    /// the metrics sampled around it.
    fn profile(
        &self,
        before: &Histograms,
        after: &Histograms,
        cpu_cores: CpuCores,
    ) -> LatencyProfile {
        let mean_ms = |name: &str| {
            let (count, sum) = before.delta(after, name);
            1000.0 * sum / count.max(1.0)
        };
        let (batches, batch_inputs) = before.delta(after, "ductor_apply_batch_size");
        LatencyProfile {
            to_fold_p50_ms: ms_at(&self.to_fold, 0.5),
            to_fold_p99_ms: ms_at(&self.to_fold, 0.99),
            fold_to_event_p50_ms: ms_at(&self.fold_to_event, 0.5),
            fold_to_event_p99_ms: ms_at(&self.fold_to_event, 0.99),
            fold_to_produce_p50_ms: ms_at(&self.fold_to_produce, 0.5),
            fold_to_produce_p99_ms: ms_at(&self.fold_to_produce, 0.99),
            produce_to_consume_p50_ms: ms_at(&self.produce_to_consume, 0.5),
            produce_to_consume_p99_ms: ms_at(&self.produce_to_consume, 0.99),
            fetch_age_ms_avg: mean_ms("ductor_ingress_fetch_age_seconds"),
            apply_age_ms_avg: mean_ms("ductor_ingress_apply_age_seconds"),
            inputs_per_batch: batch_inputs / batches.max(1.0),
            apply_ms_avg: mean_ms("ductor_apply_seconds"),
            apply_phase_ms_avg: APPLY_PHASES
                .iter()
                .map(|phase| {
                    let series = format!("ductor_apply_phase_seconds{{phase=\"{phase}\"}}");
                    (phase.to_string(), mean_ms(&series))
                })
                .collect(),
            publish_ms_avg: mean_ms("ductor_outbox_publish_seconds"),
            cpu_cores,
        }
    }

    /// The figures of the rate `schedule` kept to.
    fn latency(&self, schedule: &Schedule, profile: LatencyProfile) -> Latency {
        Latency {
            load_pct: schedule.pct,
            runs_per_s: schedule.rate,
            inputs_per_s: schedule.rate * f64::from(INPUTS_PER_RUN),
            runs: schedule.n,
            p50_ms: ms_at(&self.total, 0.50),
            p99_ms: ms_at(&self.total, 0.99),
            p999_ms: ms_at(&self.total, 0.999),
            max_ms: self.total.max() as f64 / 1000.0,
            profile,
        }
    }
}

/// Records `us` microseconds, clamped to what the histogram holds.
fn record(h: &mut Histogram<u64>, us: i64) {
    h.saturating_record((us.max(1) as u64).min(MAX_LATENCY_US));
}

/// The value at quantile `q` of a histogram of microseconds, in ms.
fn ms_at(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}
