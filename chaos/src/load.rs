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
//!   alive on the events topic;
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
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
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
    signals: Vec<String>,
}

struct KeyedRequest {
    tenant: String,
    key: String,
    workflow: String,
    input: Value,
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
    summary: LoadSummary,
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
    let workflows = ductor::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut names: Vec<String> = workflows.iter().map(|w| w.name.clone()).collect();
    names.sort();
    names.dedup();
    anyhow::ensure!(!names.is_empty(), "no workflow definitions loaded");
    let mut pools: Vec<String> = workflows
        .iter()
        .flat_map(|w| w.steps.iter().map(|s| s.pool.clone()))
        .collect();
    pools.sort();
    pools.dedup();

    let mut producer_cfg = ductor::infra::kafka::producer_config(&config.kafka, "chaos-load");
    producer_cfg.set("message.timeout.ms", SEND_TIMEOUT_MS.to_string());
    producer_cfg.set("request.timeout.ms", "5000");
    let producer: FutureProducer = producer_cfg.create().context("creating producer")?;

    let driver = Arc::new(Driver {
        producer,
        log: LogWriter::create(&args.log)?,
        requests: config.requests_topic(),
        wakeups: config.wakeups_topic(),
        results: config.attempt_results_topic(),
        limits: config.input_limits(),
        workflows: names,
        tenants: args.tenants.clone(),
        http: args.http.clone(),
        sends: Semaphore::new(MAX_SENDS_IN_FLIGHT),
        http_slots: Semaphore::new(MAX_HTTP_IN_FLIGHT),
        delayed: AtomicUsize::new(0),
        book: std::sync::Mutex::new(Book::default()),
        draining: AtomicBool::new(false),
        tasks: TaskTracker::new(),
        counter: AtomicU64::new(0),
        last_activity: std::sync::Mutex::new(Instant::now()),
    });

    // Orphaned (the script that started it was killed outright): stop.
    {
        let (stop, abort) = (stop.clone(), abort.clone());
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
    let background = CancellationToken::new();
    let steps_topics: Vec<String> = pools.iter().map(|p| config.steps_topic(p)).collect();
    let worker_consumer = reader(
        &config,
        &format!("{}-chaos-worker", config.kafka.group_id),
        &steps_topics,
    )?;
    let events_consumer = reader(
        &config,
        &format!("{}-chaos-follow-{}", config.kafka.group_id, short_id()),
        &[config.events_topic()],
    )?;
    let worker = tokio::spawn(driver.clone().work(worker_consumer, background.clone()));
    let stalls = tokio::spawn(driver.clone().watch_stalls(background.clone()));
    let follower = tokio::spawn(driver.clone().follow(events_consumer, background.clone()));

    // Load.
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
            driver.with_book(|b| b.summary.skipped += 1);
            continue;
        };
        let d = driver.clone();
        driver.tasks.spawn(async move {
            d.one_op().await;
            drop(permit);
        });
    }

    // Wind-down: a well-behaved worker until every run seen is terminal.
    driver.draining.store(true, Ordering::SeqCst);
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
        let quiet = driver
            .last_activity
            .lock()
            .map(|t| t.elapsed() >= QUIET)
            .unwrap_or(true);
        let all_terminal = driver.with_book(|b| b.runs.values().all(|r| r.terminal));
        if quiet && all_terminal {
            break;
        }
    }
    driver.tasks.close();
    if tokio::time::timeout(Duration::from_secs(60), driver.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("some operations were still in flight at the end");
    }
    background.cancel();
    let _ = worker.await;
    let _ = follower.await;
    let _ = stalls.await;
    driver.log.sync()?;
    let mut summary = driver.with_book(|b| {
        b.summary.runs_seen = b.runs.len() as u64;
        b.summary.runs_terminal = b.runs.values().filter(|r| r.terminal).count() as u64;
        b.summary.clone()
    });
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// A consumer of `topics` in `group`, from the beginning, committing as it goes.
fn reader(config: &Config, group: &str, topics: &[String]) -> anyhow::Result<StreamConsumer> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &config.kafka.bootstrap_servers)
        .set("group.id", group)
        .set(
            "client.id",
            format!("{}-chaos-load", config.kafka.client_id),
        )
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("enable.partition.eof", "false")
        .set("session.timeout.ms", "10000")
        .set("reconnect.backoff.max.ms", "2000");
    for (k, v) in config.kafka.properties.iter() {
        cfg.set(k, v);
    }
    let consumer: StreamConsumer = cfg.create().context("creating consumer")?;
    let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer.subscribe(&refs).context("subscribing")?;
    Ok(consumer)
}

impl Driver {
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
        json!({ "n": self.next_n(), "pad": pad })
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
            74..77 => self.late_result().await,
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

    /// The same client-chosen start again: a no-op for the coordinator.
    async fn duplicate_start(&self) {
        let Some((run_id, tenant, bytes)) = self.with_book(|b| pick(&b.starts).cloned()) else {
            return self.client_start().await;
        };
        let rec = Record {
            kind: Some(log::KIND_START.into()),
            good: true,
            run_id: Some(run_id.clone()),
            tenant: Some(tenant),
            pool: Some(POOL.into()),
            input_ref: Some("start".into()),
            note: Some("dup".into()),
            ..Record::default()
        };
        self.send(rec, &self.requests, run_id.as_bytes(), &bytes)
            .await;
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
        let existing = self.with_book(|b| {
            pick(&b.kafka_keys).map(|k| {
                (
                    k.tenant.clone(),
                    k.key.clone(),
                    k.workflow.clone(),
                    k.input.clone(),
                )
            })
        });
        let (tenant, key, workflow, input, good, note) = match (roll, existing) {
            (0..30, Some((t, k, w, i))) => (t, k, w, i, true, Some("dup")),
            (30..37, Some((t, k, _, _))) => {
                let other = self.other_tenant(&t);
                // Reserved before sending: a second "first" request for the
                // same (tenant, key) in flight would really be a mismatch.
                let fresh = self.with_book(|b| b.keys_taken.insert((other.clone(), k.clone())));
                if !fresh {
                    return;
                }
                (
                    other,
                    k,
                    self.workflow(),
                    self.input(),
                    true,
                    Some("cross_tenant"),
                )
            }
            (37..42, Some((t, k, w, _))) => (t, k, w, self.input(), false, Some("mismatch")),
            _ => {
                let (tenant, key) = (self.tenant(), format!("k-{}", short_id()));
                self.with_book(|b| b.keys_taken.insert((tenant.clone(), key.clone())));
                (tenant, key, self.workflow(), self.input(), true, None)
            }
        };
        let corr = format!("corr-{}", short_id());
        let bytes = Self::routed_payload(&tenant, &workflow, &input, Some(&key), &corr);
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
            tenant: Some(tenant.clone()),
            pool: Some(POOL.into()),
            input_ref: good.then(|| "start".into()),
            key: Some(key.clone()),
            corr: Some(corr),
            bad: (!good).then(|| "idempotency_mismatch".into()),
            note: note.map(Into::into),
            ..Record::default()
        };
        let acked = self
            .send(rec, &self.requests, key.as_bytes(), &bytes)
            .await
            .is_some();
        if acked && good && note != Some("dup") {
            self.with_book(|b| {
                b.kafka_keys.push(KeyedRequest {
                    tenant,
                    key,
                    workflow,
                    input,
                })
            });
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
        let existing = self.with_book(|b| {
            pick(&b.http_keys).map(|k| {
                (
                    k.tenant.clone(),
                    k.key.clone(),
                    k.workflow.clone(),
                    k.input.clone(),
                )
            })
        });
        match (roll, existing) {
            (0..20, Some((t, k, w, i))) => {
                self.post(Some(k), t, w, i, true, Some("dup")).await;
            }
            (20..24, Some((t, k, w, _))) => {
                let input = self.input();
                self.post(Some(k), t, w, input, false, Some("mismatch"))
                    .await;
            }
            (24..32, _) => {
                let (t, w, i) = (self.tenant(), self.workflow(), self.input());
                self.post(None, t, w, i, true, None).await;
            }
            (32..42, _) => {
                // Concurrent duplicates, to different servers when there are several.
                let key = format!("h-{}", short_id());
                let (t, w, i) = (self.tenant(), self.workflow(), self.input());
                let copies = rand::random_range(2..=3);
                let mut handles = Vec::new();
                for _ in 0..copies {
                    let d = self.clone();
                    let (k, t, w, i) = (key.clone(), t.clone(), w.clone(), i.clone());
                    handles.push(tokio::spawn(async move {
                        d.post(Some(k), t, w, i, true, Some("burst")).await
                    }));
                }
                for h in handles {
                    let _ = h.await;
                }
            }
            _ => {
                let key = format!("h-{}", short_id());
                let (t, w, i) = (self.tenant(), self.workflow(), self.input());
                self.post(Some(key), t, w, i, true, None).await;
            }
        }
    }

    /// One logical `POST /v1/runs`, retried with the same key when it fails
    /// for a reason a retry can fix.
    async fn post(
        &self,
        key: Option<String>,
        tenant: String,
        workflow: String,
        input: Value,
        good: bool,
        note: Option<&str>,
    ) {
        let Ok(_slot) = self.http_slots.acquire().await else {
            return;
        };
        let corr = format!("corr-{}", short_id());
        let body = serde_json::to_vec(&json!({
            "workflow": workflow, "tenant": tenant, "pool": POOL, "input": input, "correlation_id": corr,
        }))
        .unwrap_or_default();
        let mut pause = Duration::from_millis(500);
        for attempt in 0..HTTP_ATTEMPTS {
            let Some(&server) = pick(&self.http) else {
                return;
            };
            let mut headers = Vec::new();
            if let Some(k) = &key {
                headers.push(("Idempotency-Key", k.as_str()));
            }
            let result =
                super::http::request(server, "POST", "/v1/runs", &headers, &body, HTTP_TIMEOUT)
                    .await;
            let mut rec = Record {
                ev: log::EV_HTTP.into(),
                t_ms: log::now_ms(),
                kind: Some(log::KIND_ROUTED.into()),
                good,
                tenant: Some(tenant.clone()),
                pool: Some(POOL.into()),
                key: key.clone(),
                corr: Some(corr.clone()),
                note: match (note, attempt) {
                    (n, 0) => n.map(Into::into),
                    (n, a) => Some(format!(
                        "{}retry{a}",
                        n.map(|n| format!("{n},")).unwrap_or_default()
                    )),
                },
                server: Some(server.to_string()),
                bad: (!good).then(|| "idempotency_mismatch".into()),
                ..Record::default()
            };
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
            let acked = rec.acked;
            self.log.write(&rec);
            self.with_book(|b| {
                *b.summary.sent.entry("http".into()).or_default() += 1;
                let label = rec
                    .status
                    .map_or_else(|| "none".to_string(), |s| s.to_string());
                *b.summary.http.entry(label).or_default() += 1;
                if acked
                    && good
                    && note.is_none()
                    && attempt == 0
                    && let Some(k) = &key
                {
                    b.http_keys.push(KeyedRequest {
                        tenant: tenant.clone(),
                        key: k.clone(),
                        workflow: workflow.clone(),
                        input: input.clone(),
                    });
                }
            });
            // Without a key a retry would be a second run, as for any client.
            if !retry || key.is_none() {
                return;
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
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

    /// A signal to `run_id`: a fresh id, or now and then one already sent.
    async fn signal_to(&self, run_id: String, tenant: String, note: Option<&'static str>) {
        let (signal_id, note) = self
            .with_book(|b| {
                let r = b.runs.entry(run_id.clone()).or_insert_with(|| RunSeen {
                    tenant: tenant.clone(),
                    terminal: false,
                    signals: Vec::new(),
                });
                if r.signals.len() >= MAX_SIGNALS_PER_RUN {
                    return None;
                }
                if !r.signals.is_empty() && chance(0.25) {
                    return pick(&r.signals).map(|s| (s.clone(), Some("dup")));
                }
                let id = format!("s-{}", short_id());
                r.signals.push(id.clone());
                Some((id, note))
            })
            .unwrap_or_default();
        if signal_id.is_empty() {
            return;
        }
        let payload = json!({
            "type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": tenant,
            "signal_id": signal_id, "name": "poke", "payload": {"n": self.next_n()},
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
        self.send(rec, &self.wakeups, run_id.as_bytes(), &bytes)
            .await;
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
        let class = ductor::ingress::classify(kind, &h.value, &source, &self.limits)
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
        let (class, topic, key, payload, run_id): (&str, &str, String, Vec<u8>, Option<String>) =
            match roll {
                0 => {
                    let topic = match rand::random_range(0..3u32) {
                        0 => &self.requests,
                        1 => &self.wakeups,
                        _ => &self.results,
                    };
                    (
                        "malformed",
                        topic,
                        rid.clone(),
                        br#"{"type":"run.start","schema_version":1,"#.to_vec(),
                        None,
                    )
                }
                1 => (
                    "unknown_type",
                    &self.wakeups,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "wakeup.nope", "schema_version": 1, "run_id": rid, "tenant": tenant})).unwrap_or_default(),
                    None,
                ),
                2 => (
                    "unsupported_version",
                    &self.requests,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "run.start", "schema_version": 99, "run_id": rid, "tenant": tenant, "workflow": self.workflow()})).unwrap_or_default(),
                    None,
                ),
                3 => (
                    "wrong_topic",
                    &self.results,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "wakeup.cancel", "schema_version": 1, "run_id": rid, "tenant": tenant})).unwrap_or_default(),
                    None,
                ),
                4 => (
                    "invalid",
                    &self.wakeups,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "wakeup.signal", "schema_version": 1, "run_id": rid, "tenant": tenant, "name": "x"})).unwrap_or_default(),
                    None,
                ),
                5 => {
                    let nx = format!("nx-{}", short_id());
                    (
                        "unknown_run",
                        &self.wakeups,
                        nx.clone(),
                        serde_json::to_vec(&json!({"type": "wakeup.signal", "schema_version": 1, "run_id": nx, "tenant": tenant, "signal_id": "s-nx", "name": "poke"})).unwrap_or_default(),
                        Some(nx),
                    )
                }
                6 => {
                    let Some((run_id, owner)) = self.known_run(false) else {
                        return;
                    };
                    let other = self.other_tenant(&owner);
                    (
                        "tenant_mismatch",
                        &self.wakeups,
                        run_id.clone(),
                        serde_json::to_vec(&json!({"type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": other, "signal_id": format!("s-{}", short_id()), "name": "poke"})).unwrap_or_default(),
                        Some(run_id),
                    )
                }
                7 => {
                    // The same run id under another tenant: the original start
                    // was acknowledged earlier on the same partition.
                    let Some((run_id, owner, _)) = self.with_book(|b| pick(&b.starts).cloned())
                    else {
                        return;
                    };
                    let other = self.other_tenant(&owner);
                    (
                        "tenant_mismatch",
                        &self.requests,
                        run_id.clone(),
                        serde_json::to_vec(&json!({"type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": other, "workflow": self.workflow(), "pool": POOL})).unwrap_or_default(),
                        Some(run_id),
                    )
                }
                8 => {
                    let Some((run_id, owner)) = self.known_run(false) else {
                        return;
                    };
                    (
                        "unknown_stamp",
                        &self.results,
                        run_id.clone(),
                        serde_json::to_vec(&json!({"type": "attempt.result", "schema_version": 1, "run_id": run_id, "tenant": owner, "stamp": Uuid::new_v4().to_string(), "outcome": "succeeded", "output": null})).unwrap_or_default(),
                        Some(run_id),
                    )
                }
                9 => (
                    "unknown_workflow",
                    &self.requests,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "run.start", "schema_version": 1, "run_id": rid, "tenant": tenant, "workflow": "no-such-workflow"})).unwrap_or_default(),
                    Some(rid.clone()),
                ),
                _ => (
                    "unknown_workflow",
                    &self.requests,
                    rid.clone(),
                    serde_json::to_vec(&json!({"type": "run.start", "schema_version": 1, "tenant": tenant, "workflow": "no-such-workflow", "idempotency_key": format!("k-{}", short_id())})).unwrap_or_default(),
                    None,
                ),
            };
        let rec = Record {
            kind: Some(log::KIND_BAD.into()),
            good: false,
            run_id,
            tenant: Some(tenant),
            bad: Some(class.into()),
            ..Record::default()
        };
        self.send(rec, topic, key.as_bytes(), &payload).await;
    }

    /// Reads every serve's `ductor_ingress_stalled_lanes` each second, and
    /// logs each reading above zero (the checker's `lane_stalled`).
    async fn watch_stalls(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            for server in &self.http {
                let metrics = super::http::request(
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
                match super::fuzz::gauge(&text, "ductor_ingress_stalled_lanes") {
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
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = consumer.recv() => m,
            };
            let m = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(error = %e, "events follower error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let Some(v) = m
                .payload()
                .and_then(|p| serde_json::from_slice::<Value>(p).ok())
            else {
                continue;
            };
            if v.get("type").and_then(Value::as_str) != Some("run.event") {
                continue;
            }
            let (Some(run_id), Some(tenant), Some(status)) = (
                v.get("run_id").and_then(Value::as_str),
                v.get("tenant").and_then(Value::as_str),
                v.get("status").and_then(Value::as_str),
            ) else {
                continue;
            };
            self.touch();
            self.with_book(|b| {
                if !b.runs.contains_key(run_id) {
                    b.runs.insert(
                        run_id.to_string(),
                        RunSeen {
                            tenant: tenant.to_string(),
                            terminal: false,
                            signals: Vec::new(),
                        },
                    );
                    if b.recent_runs.len() >= RECENT_RUNS {
                        b.recent_runs.pop_front();
                    }
                    b.recent_runs.push_back(run_id.to_string());
                }
                if status != "running"
                    && let Some(r) = b.runs.get_mut(run_id)
                {
                    r.terminal = true;
                }
            });
        }
    }

    /// The worker of every step pool.
    async fn work(self: Arc<Self>, consumer: StreamConsumer, stop: CancellationToken) {
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = consumer.recv() => m,
            };
            let m = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(error = %e, "worker consumer error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
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
