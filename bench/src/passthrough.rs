//! Baseline B2: the pipeline's Kafka traffic with Postgres taken out.
//!
//! A passthrough "coordinator" consumes requests and attempt results with the
//! ingress' consumer settings, in batches of the same bound and linger, keeps
//! each run's step in memory, and for every input produces what Ductor's
//! drainer would publish — the `run.event` and, while steps remain, the
//! `step.dispatch` — byte-for-byte in Ductor's format, with the same eleven
//! headers, through a producer with Ductor's settings. The real worker
//! library answers the dispatches. Messages per input, message sizes and the
//! topology are therefore those of the real pipeline (timers excepted: the
//! bench's step timeouts never fall due, so Ductor publishes none either).
//!
//! The same relay with a [`HopStore`] is the hop floor, B3 (see
//! [`super::floor`]): one small Postgres transaction per batch of inputs,
//! committed before the batch's effects are published.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::future::join_all;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::env::{BenchEnv, INPUTS_PER_RUN, POOL, STEPS, WORKFLOW};
use super::floor::HopStore;
use super::pipeline::{produce_start_requests, spawn_echo_worker};
use super::stats::{CpuCores, CpuTicks, Progress, Watchdog, messages_between, topic_offsets};
use ductor::config::Config;
use ductor::contract::EffectKind;
use ductor::infra::prompt_producer::PromptProducer;

/// Kafka-only throughput of the pipeline's traffic.
#[derive(Debug, Clone, Serialize)]
pub struct Passthrough {
    pub runs: usize,
    pub seconds: f64,
    pub inputs_per_s: f64,
    pub runs_per_s: f64,
    /// Messages produced to all topics per input; compare with the capacity
    /// phase's `msgs_per_input`.
    pub msgs_per_input: f64,
    pub profile: PassthroughProfile,
}

#[derive(Debug, Clone, Serialize)]
pub struct PassthroughProfile {
    pub cpu_cores: CpuCores,
}

/// Shared between the passthrough task and the driver.
#[derive(Default)]
pub(crate) struct Counters {
    inputs: AtomicU64,
    finished_runs: AtomicU64,
    /// Runs finished, by the prefix of their id (up to its last `-`).
    finished_by_prefix: Mutex<HashMap<String, u64>>,
    /// Micros since `epoch` of the first input consumed after arming, and of
    /// the last run finished.
    first_input_us: AtomicU64,
    last_finish_us: AtomicU64,
    armed: std::sync::atomic::AtomicBool,
}

/// Runs warm-up and a backlog of `runs` through the passthrough pipeline.
pub async fn run(
    env: &BenchEnv,
    runs: usize,
    warmup_runs: usize,
    worker_in_flight: usize,
    parent: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<Passthrough> {
    let config = env.pipeline_config("b2");
    env.create_topics(&config).await?;
    let shutdown = parent.child_token();
    let _stop_on_drop = shutdown.clone().drop_guard();
    let mut b2 = Relay::start(config, worker_in_flight, None, &shutdown)?;

    b2.produce_starts("warm-b2", warmup_runs).await?;
    b2.wait_warmed_up(warmup_runs).await?;

    let topics = b2.config.all_topics();
    let offsets_before = topic_offsets(&b2.config.kafka, &topics).await?;
    let inputs_before = b2.counters.inputs.load(Ordering::Relaxed);
    let cpu_before = CpuTicks::sample(&env.cpu);
    b2.counters.armed.store(true, Ordering::SeqCst);
    b2.produce_starts("b2", runs).await?;
    b2.wait_backlog(warmup_runs, runs, progress).await?;
    let cpu_after = CpuTicks::sample(&env.cpu);
    let inputs = b2.counters.inputs.load(Ordering::Relaxed) - inputs_before;
    let seconds = b2.counters.window_seconds();
    shutdown.cancel();
    b2.join().await?;
    let offsets_after = topic_offsets(&b2.config.kafka, &topics).await?;
    anyhow::ensure!(seconds > 0.0, "B2: empty measurement window");
    anyhow::ensure!(
        inputs == runs as u64 * u64::from(INPUTS_PER_RUN),
        "B2: {inputs} inputs for {runs} runs"
    );
    Ok(Passthrough {
        runs,
        seconds,
        inputs_per_s: inputs as f64 / seconds,
        runs_per_s: runs as f64 / seconds,
        msgs_per_input: messages_between(&offsets_before, &offsets_after) as f64 / inputs as f64,
        profile: PassthroughProfile {
            cpu_cores: cpu_before.cores_until(&cpu_after),
        },
    })
}

impl Counters {
    /// Seconds from the first input consumed after arming to the last run
    /// finished.
    fn window_seconds(&self) -> f64 {
        self.last_finish_us
            .load(Ordering::SeqCst)
            .saturating_sub(self.first_input_us.load(Ordering::SeqCst)) as f64
            / 1e6
    }

    /// Notes the first input consumed once armed.
    fn mark_first_input(&self, epoch: Instant) {
        if self.armed.load(Ordering::Relaxed) {
            let _ = self.first_input_us.compare_exchange(
                0,
                epoch.elapsed().as_micros() as u64,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }

    /// Counts a published batch of `hops` (one per input).
    fn count_batch(&self, hops: &[Hop], epoch: Instant) {
        self.inputs.fetch_add(hops.len() as u64, Ordering::Relaxed);
        let finished: Vec<&str> = hops
            .iter()
            .filter(|h| h.finished)
            .map(|h| h.run_id.as_str())
            .collect();
        if finished.is_empty() {
            return;
        }
        if let Ok(mut by_prefix) = self.finished_by_prefix.lock() {
            for run_id in &finished {
                let prefix = run_id.rsplit_once('-').map_or(*run_id, |(p, _)| p);
                *by_prefix.entry(prefix.to_string()).or_default() += 1;
            }
        }
        self.finished_runs
            .fetch_add(finished.len() as u64, Ordering::SeqCst);
        self.last_finish_us
            .store(epoch.elapsed().as_micros() as u64, Ordering::SeqCst);
    }

    /// Runs finished whose ids start with `prefix-`.
    pub(crate) fn finished_with_prefix(&self, prefix: &str) -> u64 {
        self.finished_by_prefix
            .lock()
            .map_or(0, |m| m.get(prefix).copied().unwrap_or(0))
    }
}

/// The passthrough pipeline: the coordinator stand-in, the real echo
/// worker, and the bench's producer of start requests.
pub(crate) struct Relay {
    pub(crate) config: Config,
    pub(crate) counters: Arc<Counters>,
    coordinator: JoinHandle<anyhow::Result<()>>,
    worker: JoinHandle<anyhow::Result<()>>,
    pub(crate) producer: FutureProducer,
}

impl Relay {
    /// Starts the coordinator stand-in, committing each batch to `store`
    /// if given, and the worker under `shutdown`.
    pub(crate) fn start(
        config: Config,
        worker_in_flight: usize,
        store: Option<HopStore>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Relay> {
        let counters = Arc::new(Counters::default());
        let epoch = Instant::now();
        let coordinator: JoinHandle<anyhow::Result<()>> = tokio::spawn(coordinate(
            config.clone(),
            counters.clone(),
            epoch,
            store,
            shutdown.clone(),
        ));
        let worker = spawn_echo_worker(&config, worker_in_flight, shutdown);
        let producer = ductor::infra::kafka::producer(&config.kafka, "bench-client")?;
        Ok(Relay {
            config,
            counters,
            coordinator,
            worker,
            producer,
        })
    }

    /// Produces the start requests of `prefix-0 .. prefix-(n-1)`.
    async fn produce_starts(&self, prefix: &str, n: usize) -> anyhow::Result<()> {
        produce_start_requests(&self.producer, &self.config, prefix, n).await
    }

    /// Fails if the coordinator stand-in or the worker has stopped.
    pub(crate) fn check_alive(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.coordinator.is_finished() && !self.worker.is_finished(),
            "the Kafka passthrough stopped while the bench was running"
        );
        Ok(())
    }

    /// Waits until the `warmup_runs` warm-up runs are finished.
    async fn wait_warmed_up(&self, warmup_runs: usize) -> anyhow::Result<()> {
        let mut watchdog = Watchdog::new(
            "B2 warm-up",
            Duration::from_secs(120),
            Duration::from_secs(30),
        );
        while self.counters.finished_runs.load(Ordering::Relaxed) < warmup_runs as u64 {
            self.check_alive()?;
            watchdog.check(
                self.counters.finished_runs.load(Ordering::Relaxed),
                warmup_runs as u64,
            )?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Waits until the backlog of `runs`, produced after the warm-up's
    /// `warmup_runs`, is finished, showing progress.
    async fn wait_backlog(
        &self,
        warmup_runs: usize,
        runs: usize,
        progress: &mut Progress,
    ) -> anyhow::Result<()> {
        let target = (warmup_runs + runs) as u64;
        let limit = Duration::from_secs(120) + Duration::from_millis(100 * runs as u64);
        let mut watchdog = Watchdog::new("B2 Kafka passthrough", limit, Duration::from_secs(30));
        let started = Instant::now();
        loop {
            let finished = self.counters.finished_runs.load(Ordering::Relaxed);
            let done = finished.saturating_sub(warmup_runs as u64);
            let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
            progress.update(&format!(
                "B2 Kafka passthrough: {done}/{runs} runs finished ({rate:.0} runs/s)"
            ));
            if finished >= target {
                return Ok(());
            }
            self.check_alive()?;
            watchdog.check(done, runs as u64)?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for both tasks once shut down, and reports how they ended.
    pub(crate) async fn join(&mut self) -> anyhow::Result<()> {
        (&mut self.coordinator)
            .await
            .context("the passthrough panicked")??;
        (&mut self.worker)
            .await
            .context("the B2 worker panicked")??;
        Ok(())
    }
}

/// A run as the passthrough remembers it.
struct RunMemo {
    tenant: String,
    /// Steps completed so far.
    completed: u32,
    seq: i64,
}

/// What one input did to its run: the run's new transition `seq`, and
/// whether the run finished.
pub(crate) struct Hop {
    pub(crate) run_id: String,
    pub(crate) seq: i64,
    pub(crate) finished: bool,
}

/// One message to publish.
struct Out {
    topic: String,
    key: String,
    payload: Vec<u8>,
    headers: OwnedHeaders,
}

/// The passthrough "coordinator": batches inputs as the ingress does and
/// publishes for each what Ductor's drainer would, until `shutdown`.
async fn coordinate(
    config: Config,
    counters: Arc<Counters>,
    epoch: Instant,
    mut store: Option<HopStore>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let consumer = passthrough_consumer(&config)?;
    let producer: FutureProducer = ductor::infra::kafka::producer(&config.kafka, "b2-drainer")?;
    // Ductor's drainer sends a quiet round without linger; the relay does
    // the same, with the same bound.
    let prompt = PromptProducer::new(
        ductor::infra::kafka::producer_config(&config.kafka, "b2-drainer-prompt"),
        config.kafka.prompt_max_in_flight,
        Duration::from_millis(config.kafka.prompt_after_ms),
    )?;
    let mut runs = Runs::new(&config);
    let max_batch = config.coordinator.batch_max_inputs;
    let linger = Duration::from_millis(config.coordinator.batch_linger_ms);
    let timeout = Duration::from_millis(config.kafka.delivery_timeout_ms);
    loop {
        // The ingress' batching: wait for one message, then fill up to the
        // bound or until the linger time has passed.
        let mut batch: Vec<OwnedMessage> = Vec::new();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            m = consumer.recv() => batch.push(m.context("passthrough consumer")?.detach()),
        }
        counters.mark_first_input(epoch);
        let deadline = tokio::time::Instant::now() + linger;
        while batch.len() < max_batch {
            tokio::select! {
                biased;
                m = consumer.recv() => batch.push(m.context("passthrough consumer")?.detach()),
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }

        let mut outs = Vec::with_capacity(batch.len() * 2);
        let mut hops = Vec::with_capacity(batch.len());
        for msg in &batch {
            hops.push(runs.effects(msg, &mut outs)?);
        }
        if let Some(store) = &mut store {
            store.commit(&hops).await?;
        }
        publish(&producer, &prompt, &outs, timeout).await?;
        counters.count_batch(&hops, epoch);
        store_offsets(&consumer, &batch);
    }
}

/// A consumer of requests and attempt results with the ingress' settings
/// and consumer group.
fn passthrough_consumer(config: &Config) -> anyhow::Result<StreamConsumer> {
    let consumer: StreamConsumer =
        ductor::infra::kafka::consumer_config(&config.kafka, &config.kafka.group_id, "b2-ingress")
            .create()
            .context("creating the passthrough consumer")?;
    let names = config.topic_names();
    let requests = names.requests();
    let results = names.attempt_results();
    consumer
        .subscribe(&[requests.as_str(), results.as_str()])
        .context("subscribing the passthrough")?;
    Ok(consumer)
}

/// The runs in flight as the passthrough remembers them, and the topics
/// their effects go to.
struct Runs {
    memo: HashMap<String, RunMemo>,
    events: String,
    steps: String,
}

impl Runs {
    fn new(config: &Config) -> Runs {
        let names = config.topic_names();
        Runs {
            memo: HashMap::new(),
            events: names.events(),
            steps: names.steps(POOL),
        }
    }

    /// Adds to `outs` what the drainer would publish for the input `msg`:
    /// its run's event and, while steps remain, the next dispatch. Returns
    /// what the input did to its run.
    fn effects(&mut self, msg: &OwnedMessage, outs: &mut Vec<Out>) -> anyhow::Result<Hop> {
        let value: Value = serde_json::from_slice(msg.payload().unwrap_or_default())
            .context("passthrough input is not JSON")?;
        let run_id = value["run_id"].as_str().unwrap_or_default().to_string();
        let input = self.advance(&run_id, &value)?;
        let run = &self.memo[&run_id];
        let done = run.completed == STEPS;
        let now = Utc::now();
        let at = now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let event = run_event(&run_id, run, &at);
        outs.push(out(
            &self.events,
            &run_id,
            &run.tenant,
            run.seq,
            0,
            EffectKind::RunEvent.ce_type(),
            &at,
            &event,
        )?);
        let hop = Hop {
            run_id: run_id.clone(),
            seq: run.seq,
            finished: done,
        };
        if done {
            self.memo.remove(&run_id);
            return Ok(hop);
        }
        let dispatch = step_dispatch(&run_id, run, now, input);
        outs.push(out(
            &self.steps,
            &run_id,
            &run.tenant,
            run.seq,
            1,
            EffectKind::StepDispatch.ce_type(),
            &at,
            &dispatch,
        )?);
        Ok(hop)
    }

    /// Folds the input `value` into its run's memo: a start remembers the
    /// run, a result completes its step. Returns the input the next step
    /// gets.
    fn advance(&mut self, run_id: &str, value: &Value) -> anyhow::Result<Value> {
        let input = match value["type"].as_str() {
            Some("run.start") => {
                self.memo.insert(
                    run_id.to_string(),
                    RunMemo {
                        tenant: value["tenant"].as_str().unwrap_or_default().to_string(),
                        completed: 0,
                        seq: 0,
                    },
                );
                value["input"].clone()
            }
            _ => value["output"].clone(),
        };
        let Some(run) = self.memo.get_mut(run_id) else {
            anyhow::bail!("passthrough: result for unknown run {run_id}");
        };
        if value["type"] != "run.start" {
            run.completed += 1;
        }
        run.seq += 1;
        Ok(input)
    }
}

/// The `run.event` of `run`'s latest transition, at `at`.
fn run_event(run_id: &str, run: &RunMemo, at: &str) -> Value {
    let done = run.completed == STEPS;
    let kind = match (run.seq, done) {
        (1, _) => "run.started",
        (_, true) => "run.succeeded",
        _ => "step.succeeded",
    };
    json!({
        "type": "run.event", "schema_version": 1, "run_id": run_id, "tenant": run.tenant,
        "seq": run.seq, "kind": kind, "status": if done { "succeeded" } else { "running" },
        "step_index": run.completed.min(STEPS - 1), "attempt": 1, "at": at,
    })
}

/// The `step.dispatch` of `run`'s next step, with `input`, at `now`.
fn step_dispatch(run_id: &str, run: &RunMemo, now: DateTime<Utc>, input: Value) -> Value {
    let stamp = Uuid::new_v4();
    let deadline =
        (now + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    json!({
        "type": "step.dispatch", "schema_version": 1, "run_id": run_id,
        "tenant": run.tenant, "workflow": WORKFLOW, "workflow_version": 1,
        "step": format!("s{}", run.completed + 1), "step_index": run.completed,
        "attempt": 1, "stamp": stamp.to_string(), "deadline": deadline, "input": input,
    })
}

/// Publishes a batch's effects and waits for every acknowledgement.
async fn publish(
    producer: &FutureProducer,
    prompt: &PromptProducer,
    outs: &[Out],
    timeout: Duration,
) -> anyhow::Result<()> {
    let turn = prompt.enter(outs.len());
    let sends = outs.iter().map(|o| async {
        if turn.prompt {
            return prompt
                .send(&o.topic, o.key.as_bytes(), &o.payload, o.headers.clone())
                .await;
        }
        let record = FutureRecord::to(&o.topic)
            .key(&o.key)
            .payload(&o.payload)
            .headers(o.headers.clone());
        producer.send(record, timeout).await.map_err(|(e, _)| e)
    });
    for result in join_all(sends).await {
        if let Err(e) = result {
            anyhow::bail!("passthrough publish failed: {e}");
        }
    }
    Ok(())
}

/// An effect with Ductor's headers.
#[allow(clippy::too_many_arguments)]
fn out(
    topic: &str,
    run_id: &str,
    tenant: &str,
    seq: i64,
    index: usize,
    ce_type: &str,
    at: &str,
    payload: &Value,
) -> anyhow::Result<Out> {
    let key = ductor::contract::idempotency_key(run_id, seq, index);
    let seq_text = seq.to_string();
    let source = format!("/ductor/workflows/{WORKFLOW}/v1");
    let pairs = [
        ("idempotency-key", key.as_str()),
        ("ductor-run-id", run_id),
        ("ductor-seq", seq_text.as_str()),
        ("ductor-tenant", tenant),
        ("ce_specversion", "1.0"),
        ("ce_id", key.as_str()),
        ("ce_source", source.as_str()),
        ("ce_type", ce_type),
        ("ce_time", at),
        ("ce_subject", run_id),
        ("content-type", "application/json"),
    ];
    let mut headers = OwnedHeaders::new_with_capacity(pairs.len());
    for (k, v) in pairs {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    Ok(Out {
        topic: topic.to_string(),
        key: run_id.to_string(),
        payload: serde_json::to_vec(payload)?,
        headers,
    })
}

fn store_offsets(consumer: &StreamConsumer, batch: &[OwnedMessage]) {
    if let Err(e) = consumer.store_offsets(&ductor::ingress::next_offsets(batch)) {
        tracing::debug!(error = %e, "passthrough offsets not stored");
    }
}
