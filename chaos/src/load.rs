//! The load driver: a mixed, partly hostile workload, and the worker of every
//! step pool, logging everything it sends and what was acknowledged.
//!
//! For `duration` it produces, at `rate` operations per second:
//!
//! - client-chosen starts (`run.start` with `run_id`), some sent twice;
//! - routed starts over Kafka (no `run_id`) with an `idempotency_key`
//!   (fresh, repeated with the same request, the same key in another tenant,
//!   or reused for a different request, which must be dead-lettered) and
//!   without one (then the coordinator keys it by topic/partition/offset);
//! - `POST /v1/runs` against the given servers: fresh keys, repeated keys,
//!   bursts of concurrent duplicates to different servers, no key, and a key
//!   reused for a different request; failed requests are retried with the
//!   same key, as a client would;
//! - signals (some ids repeated) and cancels (some repeated) to runs seen
//!   alive on the events topic, and retries of failures seen there (naming
//!   the failure; some action ids repeated, some in two copies);
//! - replays of the dead letters its bad inputs caused, over the admin
//!   API, some asked for twice (see [`super::replays`]);
//! - bad inputs: malformed JSON, unknown type, unsupported schema version,
//!   wrong topic, missing field, unknown run, wrong tenant for an existing
//!   run, unknown stamp, unknown workflow, and the hostile inputs of
//!   `ductor-chaos fuzz` (U+0000, unpaired surrogates, inexact numbers,
//!   values past every limit, garbage bytes and keys).
//!
//! As the worker it answers dispatches: most promptly, some twice (identical
//! or conflicting), some never (the coordinator's timeout retries them), some
//! after their deadline (stale), some with a retryable or permanent failure,
//! and now and then it re-sends an old result (late and reordered).
//!
//! Then it winds down: no new inputs, every dispatch answered with a
//! success, until every run it saw on the events topic is terminal and
//! nothing moved for a while (at most `drain`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::LoadArgs;
use super::log::{self, LogWriter, Record};
use super::replays::Replayer;
use ductor::client::worker::{StepDispatch, StepOutcome};
use ductor::config::Config;

/// Kafka sends in flight at once.
const MAX_SENDS_IN_FLIGHT: usize = 256;
/// Operations (each may wait for acks or HTTP answers) in flight at once;
/// ticks beyond it are skipped.
const MAX_OPS_IN_FLIGHT: usize = 512;
/// HTTP requests in flight at once.
const MAX_HTTP_IN_FLIGHT: usize = 16;
/// Delayed worker answers waiting at once; beyond it, answers go out at once.
const MAX_DELAYED_ANSWERS: usize = 2000;
/// Results remembered for late re-sends.
const RECENT_RESULTS: usize = 256;
/// Runs remembered for signals, cancels and bad inputs aimed at them.
const RECENT_RUNS: usize = 512;
/// Most signals sent to one run (the coordinator keeps at most 256).
const MAX_SIGNALS_PER_RUN: usize = 16;
/// Longest padding put into inputs; keeps payloads small and bounded.
const MAX_PAD: usize = 256;
/// How long an HTTP request may take (the server's duplicate wait is 10 s).
const HTTP_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts per HTTP request (the first plus retries with the same key).
const HTTP_ATTEMPTS: u32 = 4;
/// Bound on a Kafka send, including retries while the broker is down.
const SEND_TIMEOUT_MS: u64 = 30_000;
/// Wind-down ends once nothing moved for this long and every run is terminal.
const QUIET: Duration = Duration::from_secs(4);
/// The routing pool every start uses.
const POOL: &str = "default";

/// What the driver did, printed as one JSON line at the end.
#[derive(Debug, Default, Clone, Serialize)]
pub struct LoadSummary {
    /// Logged events by kind (`start`, `routed`, `http`, `result`, ...).
    pub sent: BTreeMap<String, u64>,
    /// Kafka messages the broker acknowledged.
    pub acked: u64,
    /// Kafka messages that failed or timed out (fate unknown).
    pub unacked: u64,
    /// HTTP answers by status (`none` when nothing came back).
    pub http: BTreeMap<String, u64>,
    /// Step dispatches received as the worker.
    pub dispatches: u64,
    /// Runs seen on the events topic, and how many of them ended.
    pub runs_seen: u64,
    pub runs_terminal: u64,
    /// Ticks skipped because too many operations were in flight.
    pub skipped: u64,
    pub seconds: f64,
}

struct RunSeen {
    tenant: String,
    terminal: bool,
    /// Acknowledged signals: id and the `n` of their payload.
    signals: Vec<(String, u64)>,
}

#[derive(Clone)]
struct KeyedRequest {
    tenant: String,
    key: String,
    workflow: String,
    input: Value,
}

/// A `POST /v1/runs` to send: its idempotency key (none for a client that
/// sends none), the request, whether it must be accepted, and the log's
/// note on it.
#[derive(Clone)]
struct HttpStart {
    key: Option<String>,
    tenant: String,
    workflow: String,
    input: Value,
    good: bool,
    note: Option<&'static str>,
}

impl HttpStart {
    /// A request whose key was used before.
    fn again(k: KeyedRequest, good: bool, note: Option<&'static str>) -> HttpStart {
        HttpStart {
            key: Some(k.key),
            tenant: k.tenant,
            workflow: k.workflow,
            input: k.input,
            good,
            note,
        }
    }

    /// The log line of one attempt of it, before the answer is known.
    fn record(&self, corr: &str, attempt: u32, server: SocketAddr) -> Record {
        Record {
            ev: log::EV_HTTP.into(),
            t_ms: log::now_ms(),
            kind: Some(log::KIND_ROUTED.into()),
            good: self.good,
            tenant: Some(self.tenant.clone()),
            pool: Some(POOL.into()),
            key: self.key.clone(),
            corr: Some(corr.to_string()),
            note: match (self.note, attempt) {
                (n, 0) => n.map(Into::into),
                (n, a) => Some(format!(
                    "{}retry{a}",
                    n.map(|n| format!("{n},")).unwrap_or_default()
                )),
            },
            server: Some(server.to_string()),
            bad: (!self.good).then(|| "idempotency_mismatch".into()),
            ..Record::default()
        }
    }
}

/// What an answer (or its absence) says of an HTTP attempt, logged in
/// `rec`; true when a retry with the same key can fix it.
fn answered(mut rec: Record, result: anyhow::Result<(u16, Vec<u8>)>) -> (Record, bool) {
    let retry = match result {
        Ok((status, answer)) => {
            rec.status = Some(status);
            rec.acked = (200..300).contains(&status);
            if let Ok(v) = serde_json::from_slice::<Value>(&answer) {
                rec.answer_run_id = v.get("run_id").and_then(Value::as_str).map(Into::into);
                rec.answer_tenant = v.get("tenant").and_then(Value::as_str).map(Into::into);
                if !rec.acked {
                    let code = v
                        .pointer("/error/code")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    rec = rec.with_error(format!("{status} {code}"));
                }
            }
            status >= 500 || status == 409
        }
        Err(e) => {
            rec = rec.with_error(format!("{e:#}"));
            true
        }
    };
    (rec, retry)
}

/// An input that must be dead-lettered: its class, its topic, message key
/// and bytes, and the run it names, when the checker can look that run up.
struct BadInput<'a> {
    class: &'static str,
    topic: &'a str,
    key: String,
    payload: Vec<u8>,
    run_id: Option<String>,
}

impl<'a> BadInput<'a> {
    fn json(
        class: &'static str,
        topic: &'a str,
        key: &str,
        payload: Value,
        run_id: Option<String>,
    ) -> BadInput<'a> {
        BadInput {
            class,
            topic,
            key: key.to_string(),
            payload: serde_json::to_vec(&payload).unwrap_or_default(),
            run_id,
        }
    }
}

#[derive(Default)]
struct Book {
    runs: HashMap<String, RunSeen>,
    /// The newest runs, for random picks (recent runs are likelier alive).
    recent_runs: VecDeque<String>,
    /// Acknowledged client-chosen starts: run id, tenant, exact payload.
    starts: Vec<(String, String, Vec<u8>)>,
    /// Acknowledged first requests per Kafka key, for duplicates and mismatches.
    kafka_keys: Vec<KeyedRequest>,
    /// Every (tenant, key) a first request was sent for, acknowledged or not.
    keys_taken: std::collections::HashSet<(String, String)>,
    http_keys: Vec<KeyedRequest>,
    recent_results: VecDeque<(String, Uuid, Vec<u8>)>,
    /// Recent failures seen on the events topic, for retries.
    failures: VecDeque<Failure>,
    summary: LoadSummary,
}

/// A run's failure, as its `run.failed` event told it, and the action ids
/// of the retries sent for it.
struct Failure {
    run_id: String,
    tenant: String,
    seq: i64,
    actions: Vec<String>,
}

struct Driver {
    producer: FutureProducer,
    log: LogWriter,
    requests: String,
    wakeups: String,
    results: String,
    /// The serves' input limits, for generating inputs they must refuse.
    limits: ductor::contract::InputLimits,
    workflows: Vec<String>,
    tenants: Vec<String>,
    http: Vec<SocketAddr>,
    /// Each tenant's `Authorization` header value for the HTTP starts.
    authorization: BTreeMap<String, String>,
    /// The serves' admin addresses, where their metrics are.
    admin: Vec<SocketAddr>,
    /// Replays dead letters through the admin addresses, when there are any.
    replayer: Option<Replayer>,
    /// The chance that a replayed letter is replayed again (`--replay-again`).
    replay_again: f64,
    sends: Semaphore,
    http_slots: Semaphore,
    delayed: AtomicUsize,
    book: std::sync::Mutex<Book>,
    draining: AtomicBool,
    tasks: TaskTracker,
    counter: AtomicU64,
    last_activity: std::sync::Mutex<Instant>,
}

fn chance(p: f64) -> bool {
    rand::random::<f64>() < p
}

fn pick<T>(items: &[T]) -> Option<&T> {
    if items.is_empty() {
        None
    } else {
        items.get(rand::random_range(0..items.len()))
    }
}

fn short_id() -> String {
    Uuid::new_v4().simple().to_string()[..12].to_string()
}

fn ms(range: std::ops::Range<u64>) -> Duration {
    Duration::from_millis(rand::random_range(range))
}

/// Runs the workload, then the wind-down, and returns what it did.
/// `stop` ends the load phase early (the wind-down still runs); `abort` ends
/// the wind-down too.
pub async fn run(
    args: LoadArgs,
    config: Config,
    stop: CancellationToken,
    abort: CancellationToken,
) -> anyhow::Result<LoadSummary> {
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    anyhow::ensure!(!args.tenants.is_empty(), "--tenants must name one tenant");
    let started = Instant::now();
    let (names, pools) = workflows_and_pools(&config)?;
    let keys = super::keys::issue(&config, &args.tenants).await?;
    let replayer = match args.admin.is_empty() {
        true => None,
        false => Replayer::new(&args.admin, super::keys::issue_admin(&config).await?),
    };
    let driver = Arc::new(Driver::new(&args, &config, names, keys, replayer)?);
    stop_when_orphaned(stop.clone(), abort.clone());
    let background = Background::start(&driver, &config, &pools)?;
    driver.clone().produce(&args, &stop, &abort).await;
    driver.wind_down(&args, &abort).await;
    background.stop().await;
    driver.log.sync()?;
    let mut summary = driver.with_book(|b| {
        b.summary.runs_seen = b.runs.len() as u64;
        b.summary.runs_terminal = b.runs.values().filter(|r| r.terminal).count() as u64;
        b.summary.clone()
    });
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// The workflows the serves load, by name, and the step pools they use.
fn workflows_and_pools(config: &Config) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let workflows = ductor::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut names: Vec<String> = workflows.iter().map(|w| w.name.clone()).collect();
    names.sort();
    names.dedup();
    anyhow::ensure!(!names.is_empty(), "no workflow definitions loaded");
    let mut pools: Vec<String> = workflows
        .iter()
        .flat_map(|w| {
            w.steps
                .iter()
                .filter_map(|s| s.task_pool().map(String::from))
        })
        .collect();
    pools.sort();
    pools.dedup();
    Ok((names, pools))
}

/// Orphaned (the script that started it was killed outright): stop.
fn stop_when_orphaned(stop: CancellationToken, abort: CancellationToken) {
    let parent = std::os::unix::process::parent_id();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if std::os::unix::process::parent_id() != parent {
                tracing::warn!("parent process gone; stopping");
                stop.cancel();
                abort.cancel();
                return;
            }
        }
    });
}

/// What runs beside the load for its whole length: the worker of every
/// step pool, the follower of the events topic and the stalled-lanes watch.
struct Background {
    token: CancellationToken,
    tasks: [tokio::task::JoinHandle<()>; 3],
}

impl Background {
    fn start(
        driver: &Arc<Driver>,
        config: &Config,
        pools: &[String],
    ) -> anyhow::Result<Background> {
        let token = CancellationToken::new();
        let names = config.topic_names();
        let steps_topics: Vec<String> = pools.iter().map(|p| names.steps(p)).collect();
        let worker_consumer = reader(
            config,
            &format!("{}-chaos-worker", config.kafka.group_id),
            &steps_topics,
        )?;
        let events_consumer = reader(
            config,
            &format!("{}-chaos-follow-{}", config.kafka.group_id, short_id()),
            &[names.events()],
        )?;
        let worker = tokio::spawn(driver.clone().work(worker_consumer, token.clone()));
        let stalls = tokio::spawn(driver.clone().watch_stalls(token.clone()));
        let follower = tokio::spawn(driver.clone().follow(events_consumer, token.clone()));
        Ok(Background {
            token,
            tasks: [worker, follower, stalls],
        })
    }

    async fn stop(self) {
        self.token.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// A consumer of `topics` in `group`, from the beginning, committing as it goes.
fn reader(config: &Config, group: &str, topics: &[String]) -> anyhow::Result<StreamConsumer> {
    let mut cfg = ductor_testkit::kafka::reader_config(&config.kafka, group, "chaos-load");
    cfg.set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "true")
        .set("session.timeout.ms", "10000")
        // Back soon after the broker's crashes, which chaos makes on purpose.
        .set("reconnect.backoff.max.ms", "2000");
    let consumer: StreamConsumer = cfg.create().context("creating consumer")?;
    let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer.subscribe(&refs).context("subscribing")?;
    Ok(consumer)
}

/// The next message of `consumer`, riding out broker errors; `None` once
/// `stop` is cancelled.
async fn next_message<'c>(
    consumer: &'c StreamConsumer,
    stop: &CancellationToken,
    on_error: &str,
) -> Option<BorrowedMessage<'c>> {
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return None,
            m = consumer.recv() => m,
        };
        match msg {
            Ok(m) => return Some(m),
            Err(e) => {
                tracing::debug!(error = %e, "{on_error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Run id, tenant and status of a `run.event`.
fn run_event(v: &Value) -> Option<(&str, &str, &str)> {
    if v.get("type").and_then(Value::as_str) != Some("run.event") {
        return None;
    }
    Some((
        v.get("run_id").and_then(Value::as_str)?,
        v.get("tenant").and_then(Value::as_str)?,
        v.get("status").and_then(Value::as_str)?,
    ))
}

impl Book {
    /// A failure seen on the events topic, remembered among the recent
    /// ones for retries.
    fn saw_failure(&mut self, run_id: &str, tenant: &str, seq: i64) {
        if self.failures.len() >= RECENT_RUNS {
            self.failures.pop_front();
        }
        self.failures.push_back(Failure {
            run_id: run_id.to_string(),
            tenant: tenant.to_string(),
            seq,
            actions: Vec::new(),
        });
    }

    /// A run seen on the events topic: remembered among the recent runs
    /// the first time, and marked terminal once it ended.
    fn saw_run(&mut self, run_id: &str, tenant: &str, terminal: bool) {
        if !self.runs.contains_key(run_id) {
            self.runs.insert(
                run_id.to_string(),
                RunSeen {
                    tenant: tenant.to_string(),
                    terminal: false,
                    signals: Vec::new(),
                },
            );
            if self.recent_runs.len() >= RECENT_RUNS {
                self.recent_runs.pop_front();
            }
            self.recent_runs.push_back(run_id.to_string());
        }
        if terminal && let Some(r) = self.runs.get_mut(run_id) {
            r.terminal = true;
        }
    }
}

impl Driver {
    fn new(
        args: &LoadArgs,
        config: &Config,
        workflows: Vec<String>,
        authorization: BTreeMap<String, String>,
        replayer: Option<Replayer>,
    ) -> anyhow::Result<Driver> {
        let mut producer_cfg = ductor::infra::kafka::producer_config(&config.kafka, "chaos-load");
        producer_cfg.set("message.timeout.ms", SEND_TIMEOUT_MS.to_string());
        producer_cfg.set("request.timeout.ms", "5000");
        let producer: FutureProducer = producer_cfg.create().context("creating producer")?;
        let names = config.topic_names();
        Ok(Driver {
            producer,
            log: LogWriter::create(&args.log)?,
            requests: names.requests(),
            wakeups: names.wakeups(),
            results: names.attempt_results(),
            limits: config.input_limits(),
            workflows,
            tenants: args.tenants.clone(),
            http: args.http.clone(),
            authorization,
            admin: args.admin.clone(),
            replayer,
            replay_again: args.replay_again,
            sends: Semaphore::new(MAX_SENDS_IN_FLIGHT),
            http_slots: Semaphore::new(MAX_HTTP_IN_FLIGHT),
            delayed: AtomicUsize::new(0),
            book: std::sync::Mutex::new(Book::default()),
            draining: AtomicBool::new(false),
            tasks: TaskTracker::new(),
            counter: AtomicU64::new(0),
            last_activity: std::sync::Mutex::new(Instant::now()),
        })
    }

    /// The load: one operation a tick at `--rate` for `--duration-s`, or
    /// until stopped; a tick finding too many operations in flight is
    /// skipped.
    async fn produce(
        self: Arc<Self>,
        args: &LoadArgs,
        stop: &CancellationToken,
        abort: &CancellationToken,
    ) {
        let ops = Arc::new(Semaphore::new(MAX_OPS_IN_FLIGHT));
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let load_end = Instant::now() + Duration::from_secs(args.duration_s);
        tracing::info!(
            duration_s = args.duration_s,
            rate = args.rate,
            "chaos load started"
        );
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = abort.cancelled() => break,
                _ = tokio::time::sleep_until(load_end) => break,
                _ = tick.tick() => {}
            }
            let Ok(permit) = ops.clone().try_acquire_owned() else {
                self.with_book(|b| b.summary.skipped += 1);
                continue;
            };
            let d = self.clone();
            self.tasks.spawn(async move {
                d.one_op().await;
                drop(permit);
            });
        }
    }

    /// Wind-down: a well-behaved worker until every run seen is terminal
    /// and nothing moved for a while (at most `--drain-s`), then the
    /// operations still in flight finish.
    async fn wind_down(&self, args: &LoadArgs, abort: &CancellationToken) {
        self.draining.store(true, Ordering::SeqCst);
        tracing::info!("chaos load winding down");
        let drain_end = Instant::now() + Duration::from_secs(args.drain_s);
        loop {
            tokio::select! {
                _ = abort.cancelled() => break,
                _ = tokio::time::sleep_until(drain_end) => {
                    tracing::warn!("wind-down bound reached with runs still going");
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            let quiet = self
                .last_activity
                .lock()
                .map(|t| t.elapsed() >= QUIET)
                .unwrap_or(true);
            let all_terminal = self.with_book(|b| b.runs.values().all(|r| r.terminal));
            if quiet && all_terminal {
                break;
            }
        }
        self.tasks.close();
        if tokio::time::timeout(Duration::from_secs(60), self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("some operations were still in flight at the end");
        }
    }

    fn with_book<T>(&self, f: impl FnOnce(&mut Book) -> T) -> T {
        let mut guard = self.book.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    fn touch(&self) {
        if let Ok(mut t) = self.last_activity.lock() {
            *t = Instant::now();
        }
    }

    fn next_n(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    fn tenant(&self) -> String {
        pick(&self.tenants).cloned().unwrap_or_default()
    }

    fn other_tenant(&self, not: &str) -> String {
        let others: Vec<&String> = self.tenants.iter().filter(|t| *t != not).collect();
        match pick(&others) {
            Some(t) => (*t).clone(),
            None => format!("{not}-x"),
        }
    }

    fn workflow(&self) -> String {
        pick(&self.workflows).cloned().unwrap_or_default()
    }

    fn input(&self) -> Value {
        let pad = "x".repeat(rand::random_range(0..MAX_PAD));
        // What a map step maps over: none to three items.
        let items: Vec<u32> = (0..rand::random_range(0..4)).collect();
        json!({ "n": self.next_n(), "pad": pad, "items": items })
    }

    /// Produces one message and logs its fate. Returns partition and offset
    /// when the broker acknowledged it.
    async fn send(
        &self,
        mut rec: Record,
        topic: &str,
        key: &[u8],
        payload: &[u8],
    ) -> Option<(i32, i64)> {
        let _permit = self.sends.acquire().await.ok()?;
        let result = self
            .producer
            .send(
                FutureRecord::to(topic).key(key).payload(payload),
                Duration::from_secs(5),
            )
            .await;
        rec.ev = log::EV_INPUT.to_string();
        rec.topic = Some(topic.to_string());
        rec.t_ms = log::now_ms();
        let kind = rec.kind.clone().unwrap_or_default();
        let out = match result {
            Ok(d) => {
                rec.acked = true;
                rec.partition = Some(d.partition);
                rec.offset = Some(d.offset);
                Some((d.partition, d.offset))
            }
            Err((e, _)) => {
                rec = rec.with_error(e);
                None
            }
        };
        self.log.write(&rec);
        self.with_book(|b| {
            *b.summary.sent.entry(kind).or_default() += 1;
            if out.is_some() {
                b.summary.acked += 1;
            } else {
                b.summary.unacked += 1;
            }
        });
        out
    }

    async fn one_op(self: Arc<Self>) {
        let has_http = !self.http.is_empty();
        let roll = rand::random_range(0..100u32);
        match roll {
            0..16 => self.client_start().await,
            16..18 => self.duplicate_start().await,
            18..30 => self.routed_keyed().await,
            30..35 => self.routed_unkeyed().await,
            35..50 if has_http => self.http_start().await,
            35..50 => self.client_start().await,
            50..70 => self.signal().await,
            70..74 => self.cancel().await,
            74..76 => self.late_result().await,
            76..78 => self.retry().await,
            78..80 => self.replay().await,
            _ => self.bad().await,
        }
    }

    async fn client_start(&self) {
        let run_id = format!("c-{}", short_id());
        let tenant = self.tenant();
        let corr = format!("corr-{}", short_id());
        let payload = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": tenant,
            "workflow": self.workflow(), "pool": POOL, "input": self.input(), "correlation_id": corr,
        });
        let bytes = serde_json::to_vec(&payload).unwrap_or_default();
        let rec = Record {
            kind: Some(log::KIND_START.into()),
            good: true,
            run_id: Some(run_id.clone()),
            tenant: Some(tenant.clone()),
            pool: Some(POOL.into()),
            input_ref: Some("start".into()),
            corr: Some(corr),
            ..Record::default()
        };
        if self
            .send(rec, &self.requests, run_id.as_bytes(), &bytes)
            .await
            .is_some()
        {
            self.with_book(|b| b.starts.push((run_id, tenant, bytes)));
        }
    }

    /// The same client-chosen start again: a no-op for the coordinator; or
    /// now and then its run id with another input, which the coordinator
    /// dead-letters as `idempotency_mismatch`.
    async fn duplicate_start(&self) {
        let Some((run_id, tenant, bytes)) = self.with_book(|b| pick(&b.starts).cloned()) else {
            return self.client_start().await;
        };
        let (bytes, good) = if chance(0.3) {
            (self.with_other_input(&bytes), false)
        } else {
            (bytes, true)
        };
        let rec = Record {
            kind: Some(log::KIND_START.into()),
            good,
            run_id: Some(run_id.clone()),
            tenant: Some(tenant),
            pool: Some(POOL.into()),
            input_ref: good.then(|| "start".into()),
            note: Some(if good { "dup" } else { "mismatch" }.into()),
            bad: (!good).then(|| "idempotency_mismatch".into()),
            ..Record::default()
        };
        self.send(rec, &self.requests, run_id.as_bytes(), &bytes)
            .await;
    }

    /// A start request with its input replaced.
    fn with_other_input(&self, bytes: &[u8]) -> Vec<u8> {
        let mut request: Value = serde_json::from_slice(bytes).unwrap_or_default();
        request["input"] = json!({"other": self.next_n()});
        serde_json::to_vec(&request).unwrap_or_default()
    }

    fn routed_payload(
        tenant: &str,
        workflow: &str,
        input: &Value,
        key: Option<&str>,
        corr: &str,
    ) -> Vec<u8> {
        let mut v = json!({
            "type": "run.start", "schema_version": 1, "tenant": tenant, "workflow": workflow,
            "pool": POOL, "input": input, "correlation_id": corr,
        });
        if let (Some(k), Some(obj)) = (key, v.as_object_mut()) {
            obj.insert("idempotency_key".into(), k.into());
        }
        serde_json::to_vec(&v).unwrap_or_default()
    }

    /// A routed start with an idempotency key: fresh, a duplicate, the same
    /// key in another tenant, or the key reused for another request (bad).
    /// The message key is the idempotency key, so requests with one key stay
    /// in order on one partition.
    async fn routed_keyed(&self) {
        let roll = rand::random_range(0..100u32);
        let existing = self.with_book(|b| pick(&b.kafka_keys).cloned());
        let Some((request, good, note)) = self.keyed_request(roll, existing) else {
            return;
        };
        let acked = self.send_keyed(&request, good, note).await;
        if acked && good && note != Some("dup") {
            self.with_book(|b| b.kafka_keys.push(request));
        }
    }

    /// Sends `request` as a routed start over Kafka, keyed by its
    /// idempotency key; whether the broker acknowledged it.
    async fn send_keyed(
        &self,
        request: &KeyedRequest,
        good: bool,
        note: Option<&'static str>,
    ) -> bool {
        let corr = format!("corr-{}", short_id());
        let bytes = Self::routed_payload(
            &request.tenant,
            &request.workflow,
            &request.input,
            Some(&request.key),
            &corr,
        );
        let rec = Record {
            kind: Some(
                if good {
                    log::KIND_ROUTED
                } else {
                    log::KIND_BAD
                }
                .into(),
            ),
            good,
            tenant: Some(request.tenant.clone()),
            pool: Some(POOL.into()),
            input_ref: good.then(|| "start".into()),
            key: Some(request.key.clone()),
            corr: Some(corr),
            bad: (!good).then(|| "idempotency_mismatch".into()),
            note: note.map(Into::into),
            ..Record::default()
        };
        self.send(rec, &self.requests, request.key.as_bytes(), &bytes)
            .await
            .is_some()
    }

    /// Which keyed request `roll` sends, whether it must be accepted, and
    /// the log's note on it; `None` when its (tenant, key) is already taken.
    fn keyed_request(
        &self,
        roll: u32,
        existing: Option<KeyedRequest>,
    ) -> Option<(KeyedRequest, bool, Option<&'static str>)> {
        match (roll, existing) {
            (0..30, Some(k)) => Some((k, true, Some("dup"))),
            (30..37, Some(k)) => {
                let other = self.other_tenant(&k.tenant);
                // Reserved before sending: a second "first" request for the
                // same (tenant, key) in flight would really be a mismatch.
                let fresh = self.with_book(|b| b.keys_taken.insert((other.clone(), k.key.clone())));
                if !fresh {
                    return None;
                }
                let request = KeyedRequest {
                    tenant: other,
                    key: k.key,
                    workflow: self.workflow(),
                    input: self.input(),
                };
                Some((request, true, Some("cross_tenant")))
            }
            (37..42, Some(k)) => {
                let request = KeyedRequest {
                    input: self.input(),
                    ..k
                };
                Some((request, false, Some("mismatch")))
            }
            _ => {
                let (tenant, key) = (self.tenant(), format!("k-{}", short_id()));
                self.with_book(|b| b.keys_taken.insert((tenant.clone(), key.clone())));
                let request = KeyedRequest {
                    tenant,
                    key,
                    workflow: self.workflow(),
                    input: self.input(),
                };
                Some((request, true, None))
            }
        }
    }

    /// A routed start without a key: keyed by its Kafka position.
    async fn routed_unkeyed(&self) {
        let tenant = self.tenant();
        let corr = format!("corr-{}", short_id());
        let bytes = Self::routed_payload(&tenant, &self.workflow(), &self.input(), None, &corr);
        let rec = Record {
            kind: Some(log::KIND_ROUTED.into()),
            good: true,
            tenant: Some(tenant),
            pool: Some(POOL.into()),
            input_ref: Some("start".into()),
            corr: Some(corr.clone()),
            ..Record::default()
        };
        self.send(rec, &self.requests, corr.as_bytes(), &bytes)
            .await;
    }

    async fn http_start(self: Arc<Self>) {
        let roll = rand::random_range(0..100u32);
        let existing = self.with_book(|b| pick(&b.http_keys).cloned());
        match (roll, existing) {
            (0..20, Some(k)) => {
                self.post(HttpStart::again(k, true, Some("dup"))).await;
            }
            (20..24, Some(k)) => {
                let input = self.input();
                let start = HttpStart::again(KeyedRequest { input, ..k }, false, Some("mismatch"));
                self.post(start).await;
            }
            (24..32, _) => {
                self.post(self.fresh_http(None, None)).await;
            }
            (42..50, _) => self.raced_over_both().await,
            (32..42, _) => {
                // Concurrent duplicates, to different servers when there are several.
                let key = format!("h-{}", short_id());
                let start = self.fresh_http(Some(key), Some("burst"));
                let copies = rand::random_range(2..=3);
                let mut handles = Vec::new();
                for _ in 0..copies {
                    let d = self.clone();
                    let start = start.clone();
                    handles.push(tokio::spawn(async move { d.post(start).await }));
                }
                for h in handles {
                    let _ = h.await;
                }
            }
            _ => {
                let key = format!("h-{}", short_id());
                self.post(self.fresh_http(Some(key), None)).await;
            }
        }
    }

    /// The same keyed request over HTTP and over Kafka at once: one of
    /// them decides and the other is its duplicate. A Kafka start that
    /// finds the key held by the HTTP request, still deciding, is parked
    /// beside its lane until the key is decided or swept.
    async fn raced_over_both(self: Arc<Self>) {
        let start = self.fresh_http(Some(format!("hk-{}", short_id())), Some("raced"));
        let request = KeyedRequest {
            tenant: start.tenant.clone(),
            key: start.key.clone().unwrap_or_default(),
            workflow: start.workflow.clone(),
            input: start.input.clone(),
        };
        self.with_book(|b| {
            b.keys_taken
                .insert((request.tenant.clone(), request.key.clone()))
        });
        let http = {
            let d = self.clone();
            tokio::spawn(async move { d.post(start).await })
        };
        self.send_keyed(&request, true, Some("raced")).await;
        let _ = http.await;
    }

    /// A good HTTP start of a random tenant, workflow and input.
    fn fresh_http(&self, key: Option<String>, note: Option<&'static str>) -> HttpStart {
        HttpStart {
            key,
            tenant: self.tenant(),
            workflow: self.workflow(),
            input: self.input(),
            good: true,
            note,
        }
    }

    /// One logical `POST /v1/runs`, retried with the same key when it fails
    /// for a reason a retry can fix.
    async fn post(&self, start: HttpStart) {
        let Ok(_slot) = self.http_slots.acquire().await else {
            return;
        };
        let corr = format!("corr-{}", short_id());
        let body = serde_json::to_vec(&json!({
            "workflow": start.workflow, "tenant": start.tenant, "pool": POOL, "input": start.input,
            "correlation_id": corr,
        }))
        .unwrap_or_default();
        let mut pause = Duration::from_millis(500);
        for attempt in 0..HTTP_ATTEMPTS {
            let Some(&server) = pick(&self.http) else {
                return;
            };
            let mut headers = Vec::new();
            if let Some(auth) = self.authorization.get(&start.tenant) {
                headers.push(("Authorization", auth.as_str()));
            }
            if let Some(k) = &start.key {
                headers.push(("Idempotency-Key", k.as_str()));
            }
            let result = ductor_testkit::http::request(
                server,
                "POST",
                "/v1/runs",
                &headers,
                &body,
                HTTP_TIMEOUT,
            )
            .await;
            let (rec, retry) = answered(start.record(&corr, attempt, server), result);
            self.log.write(&rec);
            self.book_answer(&start, &rec, attempt);
            // Without a key a retry would be a second run, as for any client.
            if !retry || start.key.is_none() {
                return;
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }

    /// Counts an HTTP answer; the first answer to a fresh keyed request
    /// makes its key one to repeat.
    fn book_answer(&self, start: &HttpStart, rec: &Record, attempt: u32) {
        self.with_book(|b| {
            *b.summary.sent.entry("http".into()).or_default() += 1;
            let label = rec
                .status
                .map_or_else(|| "none".to_string(), |s| s.to_string());
            *b.summary.http.entry(label).or_default() += 1;
            if rec.acked
                && start.good
                && start.note.is_none()
                && attempt == 0
                && let Some(k) = &start.key
            {
                b.http_keys.push(KeyedRequest {
                    tenant: start.tenant.clone(),
                    key: k.clone(),
                    workflow: start.workflow.clone(),
                    input: start.input.clone(),
                });
            }
        });
    }

    /// A run seen alive (most of the time) on the events topic.
    fn known_run(&self, alive: bool) -> Option<(String, String)> {
        self.with_book(|b| {
            for _ in 0..8 {
                if b.recent_runs.is_empty() {
                    return None;
                }
                let id = b
                    .recent_runs
                    .get(rand::random_range(0..b.recent_runs.len()))?;
                let r = b.runs.get(id)?;
                if !alive || !r.terminal {
                    return Some((id.clone(), r.tenant.clone()));
                }
            }
            None
        })
    }

    async fn signal(&self) {
        let Some((run_id, tenant)) = self.known_run(chance(0.8)) else {
            return;
        };
        self.signal_to(run_id, tenant, None).await;
    }

    /// A signal to `run_id`: a fresh id, or now and then one already
    /// acknowledged, sent again with its payload (a duplicate) or with
    /// another (a mismatch, dead-lettered if the first copy was recorded).
    async fn signal_to(&self, run_id: String, tenant: String, note: Option<&'static str>) {
        let Some((signal_id, n, note)) = self.with_book(|b| {
            let r = b.runs.entry(run_id.clone()).or_insert_with(|| RunSeen {
                tenant: tenant.clone(),
                terminal: false,
                signals: Vec::new(),
            });
            if r.signals.len() >= MAX_SIGNALS_PER_RUN {
                return None;
            }
            match (pick(&r.signals), rand::random_range(0..100u32)) {
                (Some((id, n)), 0..20) => Some((id.clone(), Some(*n), Some("dup"))),
                (Some((id, _)), 20..25) => Some((id.clone(), None, Some("mismatch"))),
                _ => Some((format!("s-{}", short_id()), None, note)),
            }
        }) else {
            return;
        };
        let fresh = note != Some("dup") && note != Some("mismatch");
        let n = n.unwrap_or_else(|| self.next_n());
        let payload = json!({
            "type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": tenant,
            "signal_id": signal_id, "name": "poke", "payload": {"n": n},
        });
        let rec = Record {
            kind: Some(log::KIND_SIGNAL.into()),
            good: true,
            run_id: Some(run_id.clone()),
            tenant: Some(tenant),
            input_ref: Some(format!("signal:{signal_id}")),
            note: note.map(Into::into),
            ..Record::default()
        };
        let bytes = serde_json::to_vec(&payload).unwrap_or_default();
        let acked = self
            .send(rec, &self.wakeups, run_id.as_bytes(), &bytes)
            .await
            .is_some();
        // Only an acknowledged signal is reused: a copy sent after the
        // acknowledgement lands after it in the run's partition.
        if acked && fresh {
            self.with_book(|b| {
                if let Some(r) = b.runs.get_mut(&run_id) {
                    r.signals.push((signal_id, n));
                }
            });
        }
    }

    async fn cancel(&self) {
        let Some((run_id, tenant)) = self.known_run(true) else {
            return;
        };
        let payload = json!({
            "type": "wakeup.cancel", "schema_version": 1, "run_id": run_id, "tenant": tenant,
            "reason": "chaos",
        });
        let bytes = serde_json::to_vec(&payload).unwrap_or_default();
        let copies = if chance(0.3) { 2 } else { 1 };
        for i in 0..copies {
            let rec = Record {
                kind: Some(log::KIND_CANCEL.into()),
                good: true,
                run_id: Some(run_id.clone()),
                tenant: Some(tenant.clone()),
                input_ref: Some("cancel".into()),
                note: (i > 0).then(|| "dup".into()),
                ..Record::default()
            };
            self.send(rec, &self.wakeups, run_id.as_bytes(), &bytes)
                .await;
        }
    }

    /// A retry of a failure seen on the events topic, naming it: mostly
    /// under a fresh action id, now and then under one already sent for it
    /// (the same retry again) or in two copies. At most one retry of a
    /// failure applies; the rest change nothing.
    async fn retry(&self) {
        let Some((run_id, tenant, seq, action_id)) = self.with_book(|b| {
            if b.failures.is_empty() {
                return None;
            }
            let i = rand::random_range(0..b.failures.len());
            let f = b.failures.get_mut(i)?;
            let action_id = match pick(&f.actions) {
                Some(used) if chance(0.3) => used.clone(),
                _ => {
                    let fresh = format!("a-{}", short_id());
                    f.actions.push(fresh.clone());
                    fresh
                }
            };
            Some((f.run_id.clone(), f.tenant.clone(), f.seq, action_id))
        }) else {
            return;
        };
        let payload = json!({
            "type": "wakeup.retry", "schema_version": 1, "run_id": run_id, "tenant": tenant,
            "action_id": action_id, "failed_seq": seq, "reason": "chaos",
        });
        let bytes = serde_json::to_vec(&payload).unwrap_or_default();
        let copies = if chance(0.2) { 2 } else { 1 };
        for i in 0..copies {
            let rec = Record {
                kind: Some(log::KIND_RETRY.into()),
                good: true,
                run_id: Some(run_id.clone()),
                tenant: Some(tenant.clone()),
                input_ref: Some(format!("retry:{action_id}")),
                failed_seq: Some(seq),
                note: (i > 0).then(|| "dup".into()),
                ..Record::default()
            };
            self.send(rec, &self.wakeups, run_id.as_bytes(), &bytes)
                .await;
        }
    }

    /// A replay of a dead letter, as an operator would: one pending letter,
    /// or the few oldest of its class and topic; a replayed letter is now
    /// and then replayed again a few seconds later on the other serve (a
    /// second replay, which must produce nothing), often after a serve died
    /// meanwhile. Without admin addresses, a bad input instead.
    async fn replay(self: Arc<Self>) {
        let Some(replayer) = &self.replayer else {
            return self.bad().await;
        };
        let Some(letter) = replayer.pending().await else {
            return;
        };
        if chance(0.2) {
            let calls = replayer.replay_set(&self.log, &letter).await;
            return self.count_replays(calls);
        }
        let first = rand::random_range(0..self.admin.len().max(1));
        let (calls, answered_by) = replayer.replay(&self.log, &letter, first, None).await;
        self.count_replays(calls);
        let Some(server) = answered_by.filter(|_| chance(self.replay_again)) else {
            return;
        };
        let d = self.clone();
        self.tasks.spawn(async move {
            tokio::time::sleep(ms(2_000..12_000)).await;
            if let Some(replayer) = &d.replayer {
                let again = Some(log::NOTE_AGAIN);
                let (calls, _) = replayer.replay(&d.log, &letter, server + 1, again).await;
                d.count_replays(calls);
            }
        });
    }

    fn count_replays(&self, calls: u64) {
        self.with_book(|b| *b.summary.sent.entry("replay".into()).or_default() += calls);
    }

    /// Re-sends an old result: late and out of order; the coordinator must
    /// treat it as a duplicate or a stale answer.
    async fn late_result(&self) {
        let Some((run_id, stamp, bytes)) = self.with_book(|b| {
            if b.recent_results.is_empty() {
                return None;
            }
            let i = rand::random_range(0..b.recent_results.len());
            b.recent_results.get(i).cloned()
        }) else {
            return;
        };
        let tenant = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("tenant").and_then(Value::as_str).map(String::from));
        let rec = Record {
            kind: Some(log::KIND_RESULT.into()),
            good: true,
            run_id: Some(run_id.clone()),
            tenant,
            input_ref: Some(format!("result:{stamp}")),
            note: Some("replay".into()),
            ..Record::default()
        };
        self.send(rec, &self.results, run_id.as_bytes(), &bytes)
            .await;
    }

    /// One of the fuzz harness's hostile inputs, on a random input topic.
    async fn hostile(&self) {
        use ductor::contract::InputTopic;
        use rand::SeedableRng;
        let (kind, topic) = match rand::random_range(0..3u32) {
            0 => (InputTopic::Requests, &self.requests),
            1 => (InputTopic::Wakeups, &self.wakeups),
            _ => (InputTopic::AttemptResults, &self.results),
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let Some(h) = super::fuzz::hostile(&mut rng, kind, &self.limits) else {
            return;
        };
        let source = ductor::contract::Source {
            topic: topic.clone(),
            partition: 0,
            offset: 0,
        };
        let class = ductor::harness::classify(kind, &h.value, &source, &self.limits)
            .err()
            .map(|refused| refused.class.as_str().to_string());
        let rec = Record {
            kind: Some(log::KIND_BAD.into()),
            good: false,
            bad: Some(format!("hostile:{}", class.unwrap_or_default())),
            ..Record::default()
        };
        self.send(rec, topic, &h.key, &h.value).await;
    }

    /// One input that must end in the dead-letter topic.
    async fn bad(&self) {
        let tenant = self.tenant();
        let rid = format!("c-{}", short_id());
        let roll = rand::random_range(0..15u32);
        if roll >= 11 {
            return self.hostile().await;
        }
        let input = match roll {
            0..5 => self.undecodable(roll, &tenant, &rid),
            5 | 9 | 10 => self.inapplicable(roll, &tenant, &rid),
            _ => match self.misaddressed(roll) {
                Some(input) => input,
                None => return,
            },
        };
        let rec = Record {
            kind: Some(log::KIND_BAD.into()),
            good: false,
            run_id: input.run_id,
            tenant: Some(tenant),
            bad: Some(input.class.into()),
            ..Record::default()
        };
        self.send(rec, input.topic, input.key.as_bytes(), &input.payload)
            .await;
    }

    /// A bad input the ingress refuses before any run is looked at: not
    /// JSON, an unknown type or version, the wrong topic, a missing field.
    fn undecodable(&self, roll: u32, tenant: &str, rid: &str) -> BadInput<'_> {
        match roll {
            0 => {
                let topic = match rand::random_range(0..3u32) {
                    0 => &self.requests,
                    1 => &self.wakeups,
                    _ => &self.results,
                };
                BadInput {
                    class: "malformed",
                    topic,
                    key: rid.to_string(),
                    payload: br#"{"type":"run.start","schema_version":1,"#.to_vec(),
                    run_id: None,
                }
            }
            1 => BadInput::json(
                "unknown_type",
                &self.wakeups,
                rid,
                json!({"type": "wakeup.nope", "schema_version": 1, "run_id": rid, "tenant": tenant}),
                None,
            ),
            2 => BadInput::json(
                "unsupported_version",
                &self.requests,
                rid,
                json!({"type": "run.start", "schema_version": 99, "run_id": rid, "tenant": tenant, "workflow": self.workflow()}),
                None,
            ),
            3 => BadInput::json(
                "wrong_topic",
                &self.results,
                rid,
                json!({"type": "wakeup.cancel", "schema_version": 1, "run_id": rid, "tenant": tenant}),
                None,
            ),
            _ => BadInput::json(
                "invalid",
                &self.wakeups,
                rid,
                json!({"type": "wakeup.signal", "schema_version": 1, "run_id": rid, "tenant": tenant, "name": "x"}),
                None,
            ),
        }
    }

    /// A well-formed input the coordinator cannot apply: to a run that does
    /// not exist, or a start of a workflow that does not exist.
    fn inapplicable(&self, roll: u32, tenant: &str, rid: &str) -> BadInput<'_> {
        match roll {
            5 => {
                let nx = format!("nx-{}", short_id());
                BadInput::json(
                    "unknown_run",
                    &self.wakeups,
                    &nx,
                    json!({"type": "wakeup.signal", "schema_version": 1, "run_id": nx, "tenant": tenant, "signal_id": "s-nx", "name": "poke"}),
                    Some(nx.clone()),
                )
            }
            9 => BadInput::json(
                "unknown_workflow",
                &self.requests,
                rid,
                json!({"type": "run.start", "schema_version": 1, "run_id": rid, "tenant": tenant, "workflow": "no-such-workflow"}),
                Some(rid.to_string()),
            ),
            _ => BadInput::json(
                "unknown_workflow",
                &self.requests,
                rid,
                json!({"type": "run.start", "schema_version": 1, "tenant": tenant, "workflow": "no-such-workflow", "idempotency_key": format!("k-{}", short_id())}),
                None,
            ),
        }
    }

    /// A bad input aimed at a run the driver knows: in another tenant than
    /// the run's, or a result under a stamp no attempt has; `None` before
    /// any such run is known.
    fn misaddressed(&self, roll: u32) -> Option<BadInput<'_>> {
        let input = match roll {
            6 => {
                let (run_id, owner) = self.known_run(false)?;
                let other = self.other_tenant(&owner);
                BadInput::json(
                    "tenant_mismatch",
                    &self.wakeups,
                    &run_id,
                    json!({"type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": other, "signal_id": format!("s-{}", short_id()), "name": "poke"}),
                    Some(run_id.clone()),
                )
            }
            7 => {
                // The same run id under another tenant: the original start
                // was acknowledged earlier on the same partition.
                let (run_id, owner, _) = self.with_book(|b| pick(&b.starts).cloned())?;
                let other = self.other_tenant(&owner);
                BadInput::json(
                    "tenant_mismatch",
                    &self.requests,
                    &run_id,
                    json!({"type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": other, "workflow": self.workflow(), "pool": POOL}),
                    Some(run_id.clone()),
                )
            }
            _ => {
                let (run_id, owner) = self.known_run(false)?;
                BadInput::json(
                    "unknown_stamp",
                    &self.results,
                    &run_id,
                    json!({"type": "attempt.result", "schema_version": 1, "run_id": run_id, "tenant": owner, "stamp": Uuid::new_v4().to_string(), "outcome": "succeeded", "output": null}),
                    Some(run_id.clone()),
                )
            }
        };
        Some(input)
    }

    /// Reads every serve's `ductor_ingress_stalled_lanes` (on its admin
    /// listener) each second, and logs each reading above zero (the
    /// checker's `lane_stalled`).
    async fn watch_stalls(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            for server in &self.admin {
                let metrics = ductor_testkit::http::request(
                    *server,
                    "GET",
                    "/metrics",
                    &[],
                    b"",
                    Duration::from_secs(2),
                )
                .await;
                let Ok((200, body)) = metrics else { continue };
                let text = String::from_utf8_lossy(&body);
                match ductor_testkit::metrics::value(&text, "ductor_ingress_stalled_lanes") {
                    Some(lanes) if lanes > 0.0 => self.log.write(&Record {
                        ev: log::EV_STALL.into(),
                        t_ms: log::now_ms(),
                        server: Some(server.to_string()),
                        note: Some(format!("{lanes} lanes stalled")),
                        ..Record::default()
                    }),
                    _ => {}
                }
            }
        }
    }

    /// Follows the events topic: which runs exist, their tenant, which ended.
    async fn follow(self: Arc<Self>, consumer: StreamConsumer, stop: CancellationToken) {
        while let Some(m) = next_message(&consumer, &stop, "events follower error").await {
            let Some(v) = m
                .payload()
                .and_then(|p| serde_json::from_slice::<Value>(p).ok())
            else {
                continue;
            };
            let Some((run_id, tenant, status)) = run_event(&v) else {
                continue;
            };
            self.touch();
            let failed_at = (v.get("kind").and_then(Value::as_str) == Some("run.failed"))
                .then(|| v.get("seq").and_then(Value::as_i64))
                .flatten();
            self.with_book(|b| {
                b.saw_run(run_id, tenant, status != "running");
                if let Some(seq) = failed_at {
                    b.saw_failure(run_id, tenant, seq);
                }
            });
        }
    }

    /// The worker of every step pool.
    async fn work(self: Arc<Self>, consumer: StreamConsumer, stop: CancellationToken) {
        while let Some(m) = next_message(&consumer, &stop, "worker consumer error").await {
            let Ok(step) = StepDispatch::decode(m.payload().unwrap_or_default()) else {
                continue;
            };
            self.touch();
            self.with_book(|b| b.summary.dispatches += 1);
            let d = self.clone();
            self.tasks.spawn(async move { d.answer(step).await });
        }
    }

    async fn answer(&self, step: StepDispatch) {
        let success = StepOutcome::Succeeded(json!({
            "step": step.step, "attempt": step.attempt, "n": self.next_n(),
        }));
        if self.draining.load(Ordering::SeqCst) {
            return self.send_result(&step, &success, None).await;
        }
        let until_deadline = (step.deadline - chrono::Utc::now())
            .to_std()
            .unwrap_or_default();
        let roll = rand::random_range(0..100u32);
        match roll {
            0..15 => {
                // The result and a signal to the same run at the same instant:
                // they travel on different topics, often to different
                // coordinators, which then race on the run's record_version.
                tokio::time::sleep(ms(0..100)).await;
                let signal = self.signal_to(step.run_id.clone(), step.tenant.clone(), Some("race"));
                tokio::join!(self.send_result(&step, &success, None), signal);
            }
            15..60 => {
                tokio::time::sleep(ms(0..100)).await;
                self.send_result(&step, &success, None).await;
            }
            60..68 => {
                self.send_result(&step, &success, None).await;
                tokio::time::sleep(ms(0..500)).await;
                self.send_result(&step, &success, Some("dup")).await;
            }
            68..72 => {
                // A conflicting second answer for the same stamp: the first wins.
                self.send_result(&step, &success, None).await;
                let failure = StepOutcome::Failed {
                    message: "conflicting duplicate".into(),
                    retryable: true,
                };
                self.send_result(&step, &failure, Some("conflict")).await;
            }
            72..80 => {
                // Never answered: the coordinator's timeout retries it.
            }
            80..88 => {
                // Answered after the deadline: stale, unless it wins the race
                // against the timeout timer.
                let delay = until_deadline + ms(200..1500);
                self.delayed(step, success, delay, "late").await;
            }
            88..97 => {
                let failure = StepOutcome::Failed {
                    message: "transient chaos failure".into(),
                    retryable: true,
                };
                tokio::time::sleep(ms(0..100)).await;
                self.send_result(&step, &failure, None).await;
            }
            _ => {
                let failure = StepOutcome::Failed {
                    message: "permanent chaos failure".into(),
                    retryable: false,
                };
                self.send_result(&step, &failure, None).await;
            }
        }
    }

    async fn delayed(&self, step: StepDispatch, outcome: StepOutcome, delay: Duration, note: &str) {
        if self.delayed.fetch_add(1, Ordering::SeqCst) >= MAX_DELAYED_ANSWERS {
            self.delayed.fetch_sub(1, Ordering::SeqCst);
            return self.send_result(&step, &outcome, Some(note)).await;
        }
        tokio::time::sleep(delay).await;
        self.send_result(&step, &outcome, Some(note)).await;
        self.delayed.fetch_sub(1, Ordering::SeqCst);
    }

    async fn send_result(&self, step: &StepDispatch, outcome: &StepOutcome, note: Option<&str>) {
        let bytes = serde_json::to_vec(&outcome.to_result_json(step)).unwrap_or_default();
        let rec = Record {
            kind: Some(log::KIND_RESULT.into()),
            good: true,
            run_id: Some(step.run_id.clone()),
            tenant: Some(step.tenant.clone()),
            input_ref: Some(format!("result:{}", step.stamp)),
            note: note.map(Into::into),
            ..Record::default()
        };
        if self
            .send(rec, &self.results, step.run_id.as_bytes(), &bytes)
            .await
            .is_some()
        {
            self.with_book(|b| {
                if b.recent_results.len() >= RECENT_RESULTS {
                    b.recent_results.pop_front();
                }
                b.recent_results
                    .push_back((step.run_id.clone(), step.stamp, bytes));
            });
        }
    }
}
