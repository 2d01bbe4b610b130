//! The hostile-input harness: many generated inputs that Ductor must refuse,
//! interleaved with good runs on the same partitions, through the real Kafka
//! ingress and the HTTP API, against a `ductor serve` in a process of its
//! own (so that its peak RSS and a crash of it are its own).
//!
//! Every hostile input is a mutation of a valid message (truncated, bytes
//! flipped, U+0000 and control characters, unpaired surrogates, inexact
//! numbers, values deep, wide or long past a limit, wrong types, duplicated
//! keys, empty or garbage values, garbage keys and headers) that the
//! ingress's own decoder refuses; the harness keeps only those, so each one
//! has a known fate. The valid messages are a start, a signal, a result and
//! a `wakeup.retry`, whose own fields get mutations of their own too (an
//! action id too long, of characters no id has, with U+0000 or an unpaired
//! surrogate; a field missing; a failed seq of the wrong type or inexact).
//! Once every run ended it also sends retries the decoder takes, whose
//! fate is the coordinator's: a retry of a failed run's failure, the same
//! again, one naming a failure the run never had, one of a run that did not
//! fail, one in another tenant than the run's, one of a run that does not
//! exist. It then proves:
//!
//! - every good run completes (`good_run_not_completed`), although the
//!   worker sends a failure under a stamp no attempt has and a duplicate of
//!   its answer for each first step (`hostile_results`);
//! - every run whose worker returns garbage (U+0000, too deep, too long)
//!   ends failed, with the refusal's class (`garbage_run_not_failed`);
//! - every hostile Kafka input reaches the dead-letter topic exactly once,
//!   with a stage and a class (`bad_input_not_dead_lettered`,
//!   `bad_input_dead_lettered_twice`, `dead_letter_without_class`), and no
//!   good input does (`good_input_dead_lettered`);
//! - every hostile HTTP body gets a 4xx with an error code (`http_not_4xx`);
//! - of the retries the decoder takes, the one of a failure applies once
//!   (`retry_not_applied`), the others make no transition of their own
//!   (`retry_applied_wrongly`), and only the other tenant's and the
//!   unknown run's are dead-lettered, once each, as `tenant_mismatch` and
//!   `unknown_run` (`retry_not_dead_lettered_once`, `retry_misclassified`;
//!   a letter of any other is `good_input_dead_lettered`);
//! - the serve never stops, the coordinator's lag returns to zero and its
//!   `ductor_ingress_stalled_lanes` gauge, read every second, stays zero
//!   (`serve_stopped`, `lag_not_zero`, `lane_stalled`);
//! - the serve's peak RSS stays under the bound (`peak_rss_over_bound`).
//!
//! The report is one JSON line: `{"bad_inputs":N,"good_runs":N,
//! "dead_lettered":N,"http_4xx":N,"hostile_retries":N,"retries":N,
//! "retries_applied":N,"retries_dead_lettered":N,"classes":{..},
//! "peak_rss_mb":N,"violations":{..}}`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use ductor::config::Config;
use ductor::contract::Source;
use ductor::contract::{InputLimits, InputTopic};

/// What to send.
#[derive(Debug, Clone, clap::Args)]
pub struct FuzzArgs {
    /// Hostile inputs, over Kafka and HTTP together.
    #[arg(long, default_value_t = 5_000)]
    pub bad_inputs: usize,
    /// Good runs of the `example` workflow, started among them.
    #[arg(long, default_value_t = 200)]
    pub good_runs: usize,
    /// One hostile input in this many goes over HTTP instead of Kafka.
    #[arg(long, default_value_t = 10)]
    pub http_every: usize,
    /// Seed of the generator: the same seed sends the same inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Peak RSS of the serve above which the run is a violation.
    #[arg(long, default_value_t = 1024.0)]
    pub rss_bound_mb: f64,
    /// How long to wait for the good runs and the dead letters.
    #[arg(long, default_value_t = 300)]
    pub settle_timeout_s: u64,
    /// The `ductor` binary the serve runs from; by default the one beside
    /// this program.
    #[arg(long)]
    pub serve_bin: Option<PathBuf>,
}

/// The harness's verdict.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FuzzReport {
    pub bad_inputs: usize,
    pub good_runs: usize,
    pub dead_lettered: usize,
    pub http_4xx: usize,
    /// Results the harness's worker sent beside its own: a failure under a
    /// stamp no attempt has, and a duplicate of its answer.
    pub hostile_results: usize,
    /// Of the hostile inputs, those made from a `wakeup.retry`.
    pub hostile_retries: usize,
    /// Retries the decoder takes, sent once the garbage runs failed (see
    /// [`send_retries`]), and those that applied.
    pub retries: usize,
    pub retries_applied: usize,
    /// Of those, the ones the coordinator refused (another tenant's, an
    /// unknown run's), each dead-lettered once with its class.
    pub retries_dead_lettered: usize,
    /// Runs whose worker returned garbage.
    pub garbage_runs: usize,
    /// Dead letters and HTTP error codes, by class.
    pub classes: BTreeMap<String, u64>,
    pub peak_rss_mb: f64,
    pub violations: BTreeMap<String, u64>,
    pub examples: BTreeMap<String, Vec<String>>,
}

impl FuzzReport {
    fn violation(&mut self, kind: &str, example: impl FnOnce() -> String) {
        *self.violations.entry(kind.to_string()).or_default() += 1;
        let examples = self.examples.entry(kind.to_string()).or_default();
        if examples.len() < 3 {
            examples.push(example());
        }
    }

    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// One hostile message and where it goes.
#[derive(Debug, Clone)]
pub struct Hostile {
    pub topic: InputTopic,
    /// The valid message it was made from.
    pub base: Base,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// The kinds of valid message the mutations start from; the wakeups topic
/// has two, a signal and a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Start,
    Signal,
    Retry,
    Result,
}

impl Base {
    /// One of `topic`'s bases, at random.
    fn of(rng: &mut StdRng, topic: InputTopic) -> Base {
        match topic {
            InputTopic::Requests => Base::Start,
            InputTopic::Wakeups if rng.random_bool(0.5) => Base::Retry,
            InputTopic::Wakeups => Base::Signal,
            InputTopic::AttemptResults => Base::Result,
        }
    }

    /// The field the generic mutations put their values in.
    fn field(self) -> &'static str {
        match self {
            Base::Start => "input",
            Base::Signal => "payload",
            Base::Retry => "action_id",
            Base::Result => "output",
        }
    }
}

/// A valid message of `base`'s kind, the base of the mutations.
fn base(rng: &mut StdRng, base: Base) -> Value {
    let run_id = format!("fuzz-{}", rng.random::<u64>());
    match base {
        Base::Start => json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": "example", "input": {"order": rng.random::<u32>(), "items": [1, 2.5, "x"]},
            "correlation_id": "c-1",
        }),
        Base::Signal => json!({
            "type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "signal_id": "s-1", "name": "poke", "payload": {"note": "hello"},
        }),
        Base::Retry => retry_envelope(&run_id, "acme", "a-1", rng.random_range(1..64)),
        Base::Result => json!({
            "type": "attempt.result", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "stamp": uuid::Uuid::from_u128(rng.random()), "outcome": "succeeded",
            "output": {"done": true},
        }),
    }
}

/// A `wakeup.retry` of `run_id`'s failure `failed_seq`, under `action_id`.
fn retry_envelope(run_id: &str, tenant: &str, action_id: &str, failed_seq: i64) -> Value {
    json!({
        "type": "wakeup.retry", "schema_version": 1, "run_id": run_id, "tenant": tenant,
        "action_id": action_id, "failed_seq": failed_seq, "reason": "fuzz",
    })
}

/// A value nested `depth` arrays deep.
fn deep(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

/// `base` with its first string value (after `field`) replaced by `raw`
/// (JSON text), or appended as a new member when the field is missing.
fn with_raw(base: &str, field: &str, raw: &str) -> String {
    let probe = format!("\"{field}\":");
    match base.find(&probe) {
        Some(at) => {
            let start = at + probe.len();
            // The old value runs to the next top-level comma or the end: good
            // enough for the flat bases above, and a mutation either way.
            let end = base[start..]
                .find(",\"")
                .map_or(base.len() - 1, |e| start + e);
            format!("{}{raw}{}", &base[..start], &base[end..])
        }
        None => format!("{},{probe}{raw}}}", &base[..base.len() - 1]),
    }
}

/// One mutation of a valid message of `kind`; what it becomes may still
/// be valid, which [`hostile`] checks. A retry gets a mutation of its own
/// fields one time in two.
fn mutate(rng: &mut StdRng, kind: Base, limits: &InputLimits) -> Vec<u8> {
    let text = base(rng, kind).to_string();
    let field = kind.field();
    if kind == Base::Retry && rng.random_bool(0.5) {
        return retry_mutation(rng, &text);
    }
    match rng.random_range(0..18u32) {
        n @ 0..=1 => damaged(rng, n, text.as_bytes()),
        n @ 2..=6 => with_bad_text(rng, n, &text, field),
        n @ 7..=10 => past_a_shape_limit(n, &text, field, limits),
        n @ 11..=16 => wrong_shape(rng, n, &text),
        // Just past the size limit.
        _ => with_raw(
            &text,
            field,
            &format!("\"{}\"", "z".repeat(limits.max_bytes)),
        )
        .into_bytes(),
    }
}

/// The message cut short (0) or with a few bits flipped (1).
fn damaged(rng: &mut StdRng, n: u32, bytes: &[u8]) -> Vec<u8> {
    if n == 0 {
        return bytes[..rng.random_range(0..bytes.len())].to_vec();
    }
    let mut b = bytes.to_vec();
    for _ in 0..rng.random_range(1..4) {
        let at = rng.random_range(0..b.len());
        b[at] ^= 1 << rng.random_range(0..8);
    }
    b
}

/// Text JSON forbids or cannot carry exactly: U+0000 in a value (2), in a
/// key (3) or in the correlation id (4), an unpaired surrogate (5), a
/// number no float holds (6).
fn with_bad_text(rng: &mut StdRng, n: u32, text: &str, field: &str) -> Vec<u8> {
    match n {
        2 => with_raw(text, field, r#""a\u0000b""#),
        3 => with_raw(text, field, r#"{"k\u0000": 1}"#),
        4 => with_raw(text, "correlation_id", r#""\u0000""#),
        5 => with_raw(text, field, r#""\ud800""#),
        _ => with_raw(
            text,
            field,
            [
                "1e400",
                "123456789012345678901234567890",
                "0.10000000000000000001",
            ][rng.random_range(0..3)],
        ),
    }
    .into_bytes()
}

/// A value one past a shape limit: too deep (7), a string too long (8), an
/// array too long (9), an object too wide (10).
fn past_a_shape_limit(n: u32, text: &str, field: &str, limits: &InputLimits) -> Vec<u8> {
    let raw = match n {
        7 => deep(limits.shape.max_depth + 1),
        8 => format!("\"{}\"", "s".repeat(limits.shape.max_string_bytes + 1)),
        9 => format!(
            "[{}]",
            vec!["0"; limits.shape.max_array_items + 1].join(",")
        ),
        _ => {
            let members: Vec<String> = (0..=limits.shape.max_object_keys)
                .map(|k| format!("\"k{k}\":0"))
                .collect();
            format!("{{{}}}", members.join(","))
        }
    };
    with_raw(text, field, &raw).into_bytes()
}

/// A message of the wrong shape: a run id of the wrong type (11), an
/// unknown type (12), a duplicated key (13), nothing (14), garbage bytes
/// (15), a JSON value that is no message (16).
fn wrong_shape(rng: &mut StdRng, n: u32, text: &str) -> Vec<u8> {
    match n {
        11 => with_raw(
            text,
            "run_id",
            ["42", "null", "[]", "\"\""][rng.random_range(0..4)],
        )
        .into_bytes(),
        12 => with_raw(text, "type", r#""run.explode""#).into_bytes(),
        13 => format!("{},\"tenant\":\"acme\"}}", &text[..text.len() - 1]).into_bytes(),
        14 => Vec::new(),
        15 => (0..rng.random_range(1..64)).map(|_| rng.random()).collect(),
        _ => ["[]", "null", "\"x\"", "1", "{}"][rng.random_range(0..5)]
            .as_bytes()
            .to_vec(),
    }
}

/// A retry whose own fields are wrong: an action id too long (0) or of
/// characters an id may not have (1), with U+0000 (2) or an unpaired
/// surrogate (3) in it; a required field missing (4); a failed seq of the
/// wrong type or past what a number holds exactly (5); a reason that is no
/// string (6).
fn retry_mutation(rng: &mut StdRng, text: &str) -> Vec<u8> {
    let max_id = ductor::contract::input::MAX_ID_LEN;
    match rng.random_range(0..7u32) {
        0 => with_raw(
            text,
            "action_id",
            &format!("\"{}\"", "a".repeat(max_id + 1)),
        ),
        1 => with_raw(
            text,
            "action_id",
            [
                r#""a b""#,
                r#""a/b""#,
                r#""\u00e9t\u00e9""#,
                r#""""#,
                r#""a\tb""#,
            ][rng.random_range(0..5)],
        ),
        2 => with_raw(text, "action_id", r#""a\u0000b""#),
        3 => with_raw(text, "action_id", r#""a\udc00""#),
        4 => {
            let field = ["run_id", "tenant", "action_id", "failed_seq"][rng.random_range(0..4)];
            let mut v: Value = serde_json::from_str(text).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.remove(field);
            }
            v.to_string()
        }
        5 => with_raw(
            text,
            "failed_seq",
            [
                r#""3""#,
                "1.5",
                "1e400",
                "null",
                "[3]",
                "99999999999999999999",
            ][rng.random_range(0..6)],
        ),
        _ => with_raw(
            text,
            "reason",
            ["7", "{}", "[\"x\"]"][rng.random_range(0..3)],
        ),
    }
    .into_bytes()
}

/// A hostile message for `topic` that the ingress's decoder refuses, with
/// a garbage key or header now and then; `None` when the mutations drawn
/// all came out valid.
pub fn hostile(rng: &mut StdRng, topic: InputTopic, limits: &InputLimits) -> Option<Hostile> {
    for _ in 0..16 {
        let kind = Base::of(rng, topic);
        let value = mutate(rng, kind, limits);
        let source = Source {
            topic: String::new(),
            partition: 0,
            offset: 0,
        };
        if ductor::harness::classify(topic, &value, &source, limits).is_ok() {
            continue;
        }
        let key = if rng.random_bool(0.2) {
            (0..rng.random_range(0..32)).map(|_| rng.random()).collect()
        } else {
            format!("k-{}", rng.random_range(0..64u32)).into_bytes()
        };
        let headers = if rng.random_bool(0.2) {
            vec![(
                "x-garbage".to_string(),
                (0..rng.random_range(0..256))
                    .map(|_| rng.random())
                    .collect(),
            )]
        } else {
            Vec::new()
        };
        return Some(Hostile {
            topic,
            base: kind,
            key,
            value,
            headers,
        });
    }
    None
}

/// Runs the harness against a `serve` started here, on `config`'s topics
/// and database (migrated, the topics created).
pub async fn run(config: &Config, args: &FuzzArgs) -> anyhow::Result<FuzzReport> {
    ductor::infra::db::migrate_database(&config.database).await?;
    ductor::infra::kafka::create_configured_topics(config).await?;
    let bin = match &args.serve_bin {
        Some(bin) => bin.clone(),
        None => ductor_testkit::programs::beside_this_program("ductor")?,
    };
    let mut serve = ductor_testkit::serve_process::ServeProcess::start(&bin, config).await?;
    let shutdown = CancellationToken::new();
    let hostile = HostileWorker::new(config)?;
    let handler = {
        let hostile = hostile.clone();
        move |step: ductor::client::worker::StepDispatch| {
            let hostile = hostile.clone();
            async move { hostile.answer(step).await }
        }
    };
    let worker = tokio::spawn(ductor::client::worker::run(
        ductor::client::worker::WorkerOptions::from_config(config, "default"),
        handler,
        shutdown.clone(),
    ));
    let watch = tokio::spawn(watch_stalls(serve.admin_addr, shutdown.clone()));
    let mut report = FuzzReport::default();
    let authorization = super::keys::issue(config, &[FUZZ_TENANT.to_string()]).await?;
    let authorization = &authorization[FUZZ_TENANT];
    let sent = send(config, args, serve.addr, authorization, &mut report).await;
    let checked = match sent {
        Ok(mut sent) => check(config, args, &mut sent, &hostile, &mut report).await,
        Err(e) => Err(e),
    };
    shutdown.cancel();
    let _ = worker.await;
    report.hostile_results = hostile.sent.load(std::sync::atomic::Ordering::Relaxed);
    let stalls = watch.await.context("watching for stalls")?;
    if stalls.samples == 0 {
        report.violation("stalls_not_watched", || {
            "the serve's /metrics never answered with the gauge".into()
        });
    }
    if stalls.stalled_samples > 0 {
        report.violation("lane_stalled", || {
            format!(
                "{} of {} samples, up to {} lanes",
                stalls.stalled_samples, stalls.samples, stalls.max_stalled
            )
        });
    }
    report.peak_rss_mb = serve
        .peak_rss_bytes()
        .map_or(0.0, |b| b as f64 / (1024.0 * 1024.0));
    if let Some(status) = serve.exited() {
        let log = serve.log_file.display().to_string();
        report.violation("serve_stopped", || format!("{status}; its log is {log}"));
    }
    serve.stop().await;
    checked?;
    if report.peak_rss_mb > args.rss_bound_mb {
        let (peak, bound) = (report.peak_rss_mb, args.rss_bound_mb);
        report.violation("peak_rss_over_bound", || {
            format!("{peak:.0} MiB over {bound:.0}")
        });
    }
    Ok(report)
}

/// Marks a good run's input so that its worker answers with garbage.
const GARBAGE_FIELD: &str = "garbage";

/// The harness's worker. Before it answers the first attempt of a first
/// step, it sends a failed result under a stamp no attempt has (which the
/// coordinator must ignore) and, but for a garbage run, the result it is
/// about to send (which the coordinator must apply once).
#[derive(Clone)]
struct HostileWorker {
    producer: FutureProducer,
    topic: String,
    sent: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Where each stale failure landed: the coordinator dead-letters it
    /// (`unknown_stamp`).
    stale: std::sync::Arc<std::sync::Mutex<HashSet<(String, i32, i64)>>>,
}

impl HostileWorker {
    fn new(config: &Config) -> anyhow::Result<HostileWorker> {
        Ok(HostileWorker {
            producer: ductor::infra::kafka::producer(&config.kafka, "fuzz-worker")?,
            topic: config.topic_names().attempt_results(),
            sent: Default::default(),
            stale: Default::default(),
        })
    }

    async fn answer(
        &self,
        step: ductor::client::worker::StepDispatch,
    ) -> ductor::client::worker::StepOutcome {
        let outcome = answer(&step);
        if step.step_index == 0 && step.attempt == 1 {
            let stale = ductor::client::worker::StepDispatch {
                stamp: uuid::Uuid::new_v4(),
                ..step.clone()
            };
            let failed = ductor::client::worker::StepOutcome::Failed {
                message: "an answer for an attempt that never was".into(),
                retryable: false,
            };
            if let Some(landed) = self.send(&step.run_id, failed.to_result_json(&stale)).await
                && let Ok(mut stale) = self.stale.lock()
            {
                stale.insert(landed);
            }
            if step.input.get(GARBAGE_FIELD).is_none() {
                self.send(&step.run_id, outcome.to_result_json(&step)).await;
            }
        }
        outcome
    }

    /// Produces `result`, and tells where it landed.
    async fn send(&self, run_id: &str, result: Value) -> Option<(String, i32, i64)> {
        let value = result.to_string();
        let record = FutureRecord::to(&self.topic)
            .key(run_id.as_bytes())
            .payload(value.as_bytes());
        match self.producer.send(record, Duration::from_secs(30)).await {
            Ok(delivery) => {
                self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some((self.topic.clone(), delivery.partition, delivery.offset))
            }
            Err((e, _)) => {
                tracing::warn!(error = %e, "producing a hostile result failed");
                None
            }
        }
    }

    fn stale_positions(&self) -> HashSet<(String, i32, i64)> {
        self.stale.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// What the harness's worker answers: each step succeeds, except the first
/// step of a garbage run, which returns an output the worker's own screen
/// refuses.
fn answer(step: &ductor::client::worker::StepDispatch) -> ductor::client::worker::StepOutcome {
    let garbage = match step.input.get(GARBAGE_FIELD).and_then(Value::as_u64) {
        Some(kind) if step.step_index == 0 => kind,
        _ => return ductor::client::worker::StepOutcome::Succeeded(json!({"step": step.step})),
    };
    let output = match garbage % 3 {
        0 => json!({"note": "a\u{0}b"}),
        1 => serde_json::from_str(&deep(100)).unwrap_or(Value::Null),
        _ => json!({"note": "g".repeat(1 << 20)}),
    };
    ductor::client::worker::StepOutcome::Succeeded(output)
}

/// What [`watch_stalls`] saw.
#[derive(Debug, Default)]
struct Stalls {
    samples: u64,
    stalled_samples: u64,
    max_stalled: u64,
}

/// Reads the serve's `ductor_ingress_stalled_lanes` every second, on its
/// admin listener `addr`, until `stop`.
async fn watch_stalls(addr: SocketAddr, stop: CancellationToken) -> Stalls {
    let mut stalls = Stalls::default();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return stalls,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let metrics = ductor_testkit::http::request(
            addr,
            "GET",
            "/metrics",
            &[],
            b"",
            Duration::from_secs(5),
        )
        .await;
        let Ok((200, body)) = metrics else { continue };
        let Some(stalled) = ductor_testkit::metrics::value(
            &String::from_utf8_lossy(&body),
            "ductor_ingress_stalled_lanes",
        ) else {
            continue;
        };
        stalls.samples += 1;
        if stalled > 0.0 {
            stalls.stalled_samples += 1;
            stalls.max_stalled = stalls.max_stalled.max(stalled as u64);
        }
    }
}

/// What was sent: hostile Kafka inputs by (topic, partition, offset), the
/// good runs, and the runs whose worker answers with garbage.
struct Sent {
    bad: HashSet<(String, i32, i64)>,
    good: Vec<String>,
    garbage: Vec<String>,
    /// Retries the decoder takes that must apply: (run, action id).
    retried: Vec<(String, String)>,
    /// Retries the decoder takes that must change nothing (a failure named
    /// again under the same action id, a stale failed seq, a run that is
    /// not failed): (run, action id).
    unapplied: Vec<(String, String)>,
    /// Retries the coordinator must refuse, where they landed, with the
    /// class it must refuse them with.
    refused_retries: HashMap<(String, i32, i64), &'static str>,
}

/// One good run in this many is a garbage run.
const GARBAGE_EVERY: usize = 10;

/// The tenant of the HTTP calls, whose key they carry.
const FUZZ_TENANT: &str = "acme";

async fn send(
    config: &Config,
    args: &FuzzArgs,
    addr: SocketAddr,
    authorization: &str,
    report: &mut FuzzReport,
) -> anyhow::Result<Sent> {
    let producer: FutureProducer = ductor::infra::kafka::producer(&config.kafka, "fuzz")?;
    let limits = config.input_limits();
    let mut rng = StdRng::seed_from_u64(args.seed);
    let names = config.topic_names();
    let topics = [
        (InputTopic::Requests, names.requests()),
        (InputTopic::Wakeups, names.wakeups()),
        (InputTopic::AttemptResults, names.attempt_results()),
    ];
    let mut sent = Sent {
        bad: HashSet::new(),
        good: Vec::new(),
        garbage: Vec::new(),
        retried: Vec::new(),
        unapplied: Vec::new(),
        refused_retries: HashMap::new(),
    };
    let good_every = (args.bad_inputs / args.good_runs.max(1)).max(1);
    let mut pending = Vec::new();
    let mut k: usize = 0;
    while report.bad_inputs < args.bad_inputs {
        k += 1;
        if k.is_multiple_of(good_every) && sent.good.len() < args.good_runs {
            start_good(config, &producer, args.seed, k, &mut sent).await?;
        }
        let (kind, topic) = &topics[rng.random_range(0..topics.len())];
        let Some(h) = hostile(&mut rng, *kind, &limits) else {
            continue;
        };
        report.bad_inputs += 1;
        if h.base == Base::Retry {
            report.hostile_retries += 1;
        }
        if args.http_every > 0 && report.bad_inputs.is_multiple_of(args.http_every) {
            post_hostile(addr, authorization, &h.value, report).await;
            continue;
        }
        pending.push((topic.clone(), h));
        if pending.len() >= 256 {
            produce_all(&producer, &mut pending, &mut sent).await?;
        }
    }
    produce_all(&producer, &mut pending, &mut sent).await?;
    while sent.good.len() < args.good_runs {
        let run_id = format!("fuzz-good-{}-tail-{}", args.seed, sent.good.len());
        let status = post_good(addr, authorization, &run_id).await?;
        anyhow::ensure!(status == 201, "a good HTTP start got {status}");
        sent.good.push(run_id);
    }
    Ok(sent)
}

/// Starts a good run over Kafka, one in [`GARBAGE_EVERY`] a garbage run.
async fn start_good(
    config: &Config,
    producer: &FutureProducer,
    seed: u64,
    k: usize,
    sent: &mut Sent,
) -> anyhow::Result<()> {
    let garbage = (sent.good.len() + sent.garbage.len() + 1).is_multiple_of(GARBAGE_EVERY);
    let run_id = format!("fuzz-good-{seed}-{k}");
    let input = match garbage {
        true => json!({"n": k, GARBAGE_FIELD: k}),
        false => json!({"n": k}),
    };
    let start = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "input": input});
    let key = format!("k-{}", k % 64);
    let value = start.to_string();
    let topic = config.topic_names().requests();
    let record = FutureRecord::to(&topic)
        .key(key.as_bytes())
        .payload(value.as_bytes());
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .context("producing a good start")?;
    match garbage {
        true => sent.garbage.push(run_id),
        false => sent.good.push(run_id),
    }
    Ok(())
}

/// Produces what is pending, all in flight at once, and records where each
/// hostile input landed.
async fn produce_all(
    producer: &FutureProducer,
    pending: &mut Vec<(String, Hostile)>,
    sent: &mut Sent,
) -> anyhow::Result<()> {
    let sends = pending.drain(..).map(|(topic, h)| async move {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &h.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_slice()),
            });
        }
        let record = FutureRecord::to(&topic)
            .key(h.key.as_slice())
            .payload(h.value.as_slice())
            .headers(headers);
        let delivery = producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .with_context(|| format!("producing a hostile input to {topic}"))?;
        anyhow::Ok((topic, delivery.partition, delivery.offset))
    });
    for landed in futures::future::join_all(sends).await {
        sent.bad.insert(landed?);
    }
    Ok(())
}

async fn post_hostile(addr: SocketAddr, authorization: &str, body: &[u8], report: &mut FuzzReport) {
    let answer = ductor_testkit::http::request(
        addr,
        "POST",
        "/v1/runs",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", authorization),
        ],
        body,
        Duration::from_secs(30),
    )
    .await;
    match answer {
        Ok((status, reply)) if (400..500).contains(&status) => {
            report.http_4xx += 1;
            let code = serde_json::from_slice::<Value>(&reply)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
            match code {
                Some(code) => *report.classes.entry(format!("http:{code}")).or_default() += 1,
                None => report.violation("http_without_code", || format!("{status}")),
            }
        }
        Ok((status, _)) => report.violation("http_not_4xx", || {
            format!(
                "{status} for {}",
                String::from_utf8_lossy(&body[..body.len().min(80)])
            )
        }),
        Err(e) => report.violation("http_not_4xx", || format!("{e:#}")),
    }
}

async fn post_good(addr: SocketAddr, authorization: &str, key: &str) -> anyhow::Result<u16> {
    let body = json!({"workflow": "example", "tenant": FUZZ_TENANT, "input": {"key": key}});
    let (status, _) = ductor_testkit::http::request(
        addr,
        "POST",
        "/v1/runs",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", authorization),
            ("Idempotency-Key", key),
        ],
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    )
    .await?;
    Ok(status)
}

async fn check(
    config: &Config,
    args: &FuzzArgs,
    sent: &mut Sent,
    hostile: &HostileWorker,
    report: &mut FuzzReport,
) -> anyhow::Result<()> {
    report.good_runs = sent.good.len();
    report.garbage_runs = sent.garbage.len();
    let pool = ductor::infra::db::connect(&config.database).await?;
    settle(config, args, sent, &pool).await?;
    // The garbage runs have failed: retries of them, and of runs that did
    // not fail, then everything settles again.
    send_retries(config, &pool, sent, report).await?;
    settle(config, args, sent, &pool).await?;
    retries_kept(&pool, sent, report).await?;
    // Every run has ended, so every first step has been answered.
    let stale = hostile.stale_positions();
    let letters = read_letters(config).await?;
    let seen = tally_letters(letters, sent, &stale, report);
    report.dead_lettered = seen.bad.len();
    report.retries_dead_lettered = seen.retries.len();
    dead_lettered_once(sent, &stale, &seen, report);
    runs_ended(&pool, sent, report).await?;
    let lag = ingress_lag(config).await?;
    if lag > 0 {
        report.violation("lag_not_zero", || format!("{lag} inputs unconsumed"));
    }
    Ok(())
}

/// Every dead letter, read from the beginning of the topic.
async fn read_letters(config: &Config) -> anyhow::Result<Vec<Letter>> {
    let dlq = vec![config.topic_names().dead_letters()];
    let kafka = config.kafka.clone();
    tokio::task::spawn_blocking(move || {
        let mut letters = Vec::new();
        super::topics::read_each(&kafka, &dlq, Duration::from_secs(300), |m| {
            letters.push(Letter::of(&m))
        })?;
        anyhow::Ok(letters)
    })
    .await
    .context("reading the dead-letter topic")?
}

/// How often each input was dead-lettered: the hostile Kafka inputs, the
/// worker's stale failures and the retries the coordinator refuses.
#[derive(Default)]
struct Seen {
    bad: HashMap<(String, i32, i64), usize>,
    stale: HashMap<(String, i32, i64), usize>,
    retries: HashMap<(String, i32, i64), usize>,
}

/// Counts the dead letters by class and by input. Each names a stage and a
/// class; a stale failure is refused as `unknown_stamp`, a refused retry
/// as its plan says; a letter of none of these is a good input refused.
fn tally_letters(
    letters: Vec<Letter>,
    sent: &Sent,
    stale: &HashSet<(String, i32, i64)>,
    report: &mut FuzzReport,
) -> Seen {
    let mut seen = Seen::default();
    for letter in letters {
        let Letter {
            position,
            class,
            staged,
        } = letter;
        if class.is_empty() || !staged {
            report.violation("dead_letter_without_class", || format!("{position:?}"));
        }
        if stale.contains(&position) {
            if class != "unknown_stamp" {
                report.violation("stale_result_misclassified", || {
                    format!("{position:?} ({class})")
                });
            }
            *report.classes.entry(class).or_default() += 1;
            *seen.stale.entry(position).or_default() += 1;
            continue;
        }
        if let Some(expected) = sent.refused_retries.get(&position) {
            if class != *expected {
                report.violation("retry_misclassified", || {
                    format!("{position:?} ({class}, not {expected})")
                });
            }
            *report.classes.entry(class).or_default() += 1;
            *seen.retries.entry(position).or_default() += 1;
            continue;
        }
        if !sent.bad.contains(&position) {
            report.violation("good_input_dead_lettered", || {
                format!("{position:?} ({class})")
            });
            continue;
        }
        *report.classes.entry(class).or_default() += 1;
        *seen.bad.entry(position).or_default() += 1;
    }
    seen
}

/// Every hostile Kafka input, every stale failure and every retry the
/// coordinator refuses was dead-lettered exactly once.
fn dead_lettered_once(
    sent: &Sent,
    stale: &HashSet<(String, i32, i64)>,
    seen: &Seen,
    report: &mut FuzzReport,
) {
    for position in &sent.bad {
        match seen.bad.get(position) {
            None => report.violation("bad_input_not_dead_lettered", || format!("{position:?}")),
            Some(1) => {}
            Some(n) => report.violation("bad_input_dead_lettered_twice", || {
                format!("{position:?} {n} times")
            }),
        }
    }
    for position in stale {
        if seen.stale.get(position) != Some(&1) {
            let n = seen.stale.get(position).copied().unwrap_or(0);
            report.violation("stale_result_not_dead_lettered_once", || {
                format!("{position:?} {n} times")
            });
        }
    }
    for position in sent.refused_retries.keys() {
        if seen.retries.get(position) != Some(&1) {
            let n = seen.retries.get(position).copied().unwrap_or(0);
            report.violation("retry_not_dead_lettered_once", || {
                format!("{position:?} {n} times")
            });
        }
    }
}

/// Every good run completed, and every garbage run failed with the
/// refusal of its output.
async fn runs_ended(
    pool: &sqlx::PgPool,
    sent: &Sent,
    report: &mut FuzzReport,
) -> anyhow::Result<()> {
    let completed = count_status(pool, &sent.good, "succeeded").await?;
    if completed < sent.good.len() {
        let missing = sent.good.len() - completed;
        for _ in 0..missing {
            report.violation("good_run_not_completed", || {
                format!("{missing} of {} good runs", sent.good.len())
            });
        }
    }
    let failed = garbage_failed(pool, &sent.garbage).await?;
    for run in sent.garbage.iter().filter(|r| !failed.contains(*r)) {
        report.violation("garbage_run_not_failed", || run.clone());
    }
    Ok(())
}

/// Waits, within the settle bound, until the dead-letter topic holds at
/// least a letter per hostile Kafka input, every retry that must apply
/// has, every good and garbage run has ended and the coordinator's lag is
/// zero. Counting watermarks keeps the
/// wait in constant memory however long the topic is.
async fn settle(
    config: &Config,
    args: &FuzzArgs,
    sent: &Sent,
    pool: &sqlx::PgPool,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.settle_timeout_s);
    let mut runs = sent.good.clone();
    runs.extend(sent.garbage.iter().cloned());
    loop {
        let letters = {
            let kafka = config.kafka.clone();
            let dlq = vec![config.topic_names().dead_letters()];
            tokio::task::spawn_blocking(move || super::topics::message_count(&kafka, &dlq))
                .await
                .context("counting dead letters")??
        };
        let ended = count_status(pool, &runs, "succeeded").await?
            + count_status(pool, &runs, "failed").await?;
        // Offsets are committed a moment after they are stored: the lag
        // returning to zero is part of settling.
        let done = letters >= (sent.bad.len() + sent.refused_retries.len()) as i64
            && applied_retries(pool, &sent.retried).await? >= sent.retried.len()
            && ended >= runs.len()
            && ingress_lag(config).await? == 0;
        if done || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs that get the retries of [`send_retries`], of each kind.
const MAX_RETRIED_RUNS: i64 = 16;

/// The retries of [`send_retries`] and what each must come to.
enum Fate {
    /// Retries the run: a `run.retried` transition under its action id.
    Applies,
    /// Changes nothing: no transition of its own.
    NoOp,
    /// Refused by the coordinator: dead-lettered once, with this class.
    DeadLettered(&'static str),
}

/// Retries the decoder takes, sent once every run ended, each keyed by its
/// run: for each garbage run (failed), a retry of its failure (it applies,
/// and the run fails again as its worker answers garbage again), the same
/// retry again (a no-op), a retry naming a failure it never had (a no-op)
/// and one in another tenant (dead-lettered: `tenant_mismatch`); for a
/// good run, which did not fail, a retry (a no-op); and a retry of a run
/// that does not exist (dead-lettered: `unknown_run`).
async fn send_retries(
    config: &Config,
    pool: &sqlx::PgPool,
    sent: &mut Sent,
    report: &mut FuzzReport,
) -> anyhow::Result<()> {
    let failed: Vec<(String, i64)> = sqlx::query_as(
        "SELECT run_id, COALESCE((state->>'failed_seq')::int8, last_transition_seq) FROM runs \
         WHERE run_id = ANY($1) AND status = 'failed' ORDER BY run_id LIMIT $2",
    )
    .bind(&sent.garbage)
    .bind(MAX_RETRIED_RUNS)
    .fetch_all(pool)
    .await
    .context("reading the failed runs")?;
    let succeeded: Vec<String> = sqlx::query_scalar(
        "SELECT run_id FROM runs WHERE run_id = ANY($1) AND status = 'succeeded' \
         ORDER BY run_id LIMIT $2",
    )
    .bind(&sent.good)
    .bind(MAX_RETRIED_RUNS)
    .fetch_all(pool)
    .await
    .context("reading the succeeded runs")?;
    let retries = retry_plan(&failed, &succeeded);
    let producer: FutureProducer = ductor::infra::kafka::producer(&config.kafka, "fuzz-retries")?;
    let topic = config.topic_names().wakeups();
    for (envelope, fate) in retries {
        let run_id = envelope["run_id"].as_str().unwrap_or_default().to_owned();
        let action = envelope["action_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let value = envelope.to_string();
        let record = FutureRecord::to(&topic)
            .key(run_id.as_bytes())
            .payload(value.as_bytes());
        // One at a time: a run's retries reach its partition in this order.
        let delivery = producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .context("producing a retry")?;
        report.retries += 1;
        match fate {
            Fate::Applies => sent.retried.push((run_id, action)),
            Fate::NoOp => sent.unapplied.push((run_id, action)),
            Fate::DeadLettered(class) => {
                let at = (topic.clone(), delivery.partition, delivery.offset);
                sent.refused_retries.insert(at, class);
            }
        }
    }
    Ok(())
}

/// The retries of [`send_retries`] for the failed runs (with the seq of
/// their failure) and the succeeded ones, in the order they are sent.
fn retry_plan(failed: &[(String, i64)], succeeded: &[String]) -> Vec<(Value, Fate)> {
    let mut retries = Vec::new();
    for (k, (run_id, seq)) in failed.iter().enumerate() {
        let action = format!("fuzz-retry-{k}");
        for fate in [Fate::Applies, Fate::NoOp] {
            retries.push((retry_envelope(run_id, "acme", &action, *seq), fate));
        }
        let stale = format!("fuzz-stale-{k}");
        retries.push((
            retry_envelope(run_id, "acme", &stale, seq + 1_000_000),
            Fate::NoOp,
        ));
        let other = format!("fuzz-other-{k}");
        retries.push((
            retry_envelope(run_id, "globex", &other, *seq),
            Fate::DeadLettered("tenant_mismatch"),
        ));
    }
    for (k, run_id) in succeeded.iter().enumerate() {
        let action = format!("fuzz-unfailed-{k}");
        retries.push((retry_envelope(run_id, "acme", &action, 1), Fate::NoOp));
        let nx = format!("fuzz-nx-{k}");
        retries.push((
            retry_envelope(&nx, "acme", &action, 1),
            Fate::DeadLettered("unknown_run"),
        ));
    }
    retries
}

/// How many transitions each (run, action id) of `retries` made.
async fn retry_transitions(
    pool: &sqlx::PgPool,
    retries: &[(String, String)],
) -> anyhow::Result<HashMap<(String, String), i64>> {
    // Each (run, action id) once: the same retry sent twice is one row.
    let retries: std::collections::BTreeSet<&(String, String)> = retries.iter().collect();
    let runs: Vec<&str> = retries.iter().map(|(r, _)| r.as_str()).collect();
    let refs: Vec<String> = retries.iter().map(|(_, a)| format!("retry:{a}")).collect();
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT t.run_id, t.input_ref, count(*) FROM run_transitions t \
         JOIN UNNEST($1::text[], $2::text[]) AS r(run_id, input_ref) USING (run_id, input_ref) \
         GROUP BY 1, 2",
    )
    .bind(&runs)
    .bind(&refs)
    .fetch_all(pool)
    .await
    .context("reading the retries' transitions")?;
    Ok(rows
        .into_iter()
        .map(|(run, input_ref, n)| {
            let action = input_ref.trim_start_matches("retry:").to_owned();
            ((run, action), n)
        })
        .collect())
}

/// How many of `retries` made their transition.
async fn applied_retries(
    pool: &sqlx::PgPool,
    retries: &[(String, String)],
) -> anyhow::Result<usize> {
    if retries.is_empty() {
        return Ok(0);
    }
    Ok(retry_transitions(pool, retries).await?.len())
}

/// Each retry that must apply made one transition, `run.retried`; each
/// that must change nothing made none of its own (a retry sent again
/// under an applied one's action id adds none).
async fn retries_kept(
    pool: &sqlx::PgPool,
    sent: &Sent,
    report: &mut FuzzReport,
) -> anyhow::Result<()> {
    let mut all = sent.retried.clone();
    all.extend(sent.unapplied.iter().cloned());
    let made = retry_transitions(pool, &all).await?;
    let applied: HashSet<&(String, String)> = sent.retried.iter().collect();
    for retry in &sent.retried {
        match made.get(retry) {
            Some(1) => report.retries_applied += 1,
            n => report.violation("retry_not_applied", || {
                format!("{retry:?} made {} transitions", n.copied().unwrap_or(0))
            }),
        }
    }
    for retry in sent.unapplied.iter().filter(|r| !applied.contains(r)) {
        if let Some(n) = made.get(retry) {
            report.violation("retry_applied_wrongly", || {
                format!("{retry:?} made {n} transitions")
            });
        }
    }
    Ok(())
}

/// What the checks need of a dead letter: where its input was, its class,
/// and whether it names a stage.
struct Letter {
    position: (String, i32, i64),
    class: String,
    staged: bool,
}

impl Letter {
    fn of(m: &super::topics::Msg) -> Letter {
        let position = (
            m.header_str(ductor::contract::headers::DLQ_TOPIC)
                .unwrap_or_default()
                .to_string(),
            m.header_str(ductor::contract::headers::DLQ_PARTITION)
                .and_then(|p| p.parse().ok())
                .unwrap_or(-1),
            m.header_str(ductor::contract::headers::DLQ_OFFSET)
                .and_then(|o| o.parse().ok())
                .unwrap_or(-1),
        );
        Letter {
            position,
            class: m
                .header_str(ductor::contract::headers::DLQ_CLASS)
                .unwrap_or_default()
                .to_string(),
            staged: m.header_str(ductor::contract::headers::DLQ_STAGE).is_some(),
        }
    }
}

/// Garbage runs that ended failed, with the worker's refusal of its own
/// output as the error.
async fn garbage_failed(pool: &sqlx::PgPool, runs: &[String]) -> anyhow::Result<HashSet<String>> {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT run_id FROM runs WHERE run_id = ANY($1) AND status = 'failed' \
             AND state->>'error' LIKE '%result cannot be accepted (%'",
    )
    .bind(runs)
    .fetch_all(pool)
    .await
    .context("reading garbage runs")?;
    Ok(rows.into_iter().collect())
}

/// What the coordinator's group has not committed past on the input topics.
async fn ingress_lag(config: &Config) -> anyhow::Result<i64> {
    let (kafka, group) = (config.kafka.clone(), config.kafka.group_id.clone());
    let topics = config.topic_names().inputs();
    tokio::task::spawn_blocking(move || super::topics::group_lag(&kafka, &group, &topics))
        .await
        .context("measuring lag")?
}

/// Runs of `runs` in `status`: started over Kafka under their id, or over
/// HTTP under their idempotency key.
async fn count_status(pool: &sqlx::PgPool, runs: &[String], status: &str) -> anyhow::Result<usize> {
    let ids: Vec<&str> = runs.iter().map(String::as_str).collect();
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runs WHERE status = $2 AND (run_id = ANY($1) \
             OR run_id IN (SELECT decision_id FROM eec_routing_idempotency \
                           WHERE idempotency_key = ANY($1)))",
    )
    .bind(&ids)
    .bind(status)
    .fetch_one(pool)
    .await
    .context("counting runs")?;
    Ok(count as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every generated input is refused by the decoder, and every kind of
    /// mutation comes out now and then.
    #[test]
    fn generated_inputs_are_all_refused_and_varied() {
        let limits = InputLimits {
            max_bytes: 65_536,
            shape: ductor::contract::ShapeLimits {
                max_depth: 16,
                max_string_bytes: 1_024,
                max_array_items: 100,
                max_object_keys: 50,
            },
            max_payload_bytes: 65_536,
        };
        let mut rng = StdRng::seed_from_u64(7);
        let mut classes = BTreeMap::new();
        let mut retry_classes = BTreeMap::new();
        let source = Source {
            topic: String::new(),
            partition: 0,
            offset: 0,
        };
        for k in 0..3_000 {
            let topic = [
                InputTopic::Requests,
                InputTopic::Wakeups,
                InputTopic::AttemptResults,
            ][k % 3];
            let Some(h) = hostile(&mut rng, topic, &limits) else {
                continue;
            };
            let refused = ductor::harness::classify(topic, &h.value, &source, &limits)
                .expect_err("only refused inputs are kept");
            *classes.entry(refused.class.as_str()).or_insert(0) += 1;
            if h.base == Base::Retry {
                *retry_classes.entry(refused.class.as_str()).or_insert(0) += 1;
            }
        }
        for class in [
            "malformed",
            "nul_character",
            "unpaired_surrogate",
            "inexact_number",
            "invalid",
        ] {
            assert!(
                retry_classes.contains_key(class),
                "{class} never drawn from a retry: {retry_classes:?}"
            );
        }
        for class in [
            "malformed",
            "nul_character",
            "unpaired_surrogate",
            "inexact_number",
            "too_deep",
            "string_too_long",
            "array_too_long",
            "object_too_wide",
            "duplicate_key",
            "invalid",
            "unknown_type",
            "too_large",
        ] {
            assert!(
                classes.contains_key(class),
                "{class} never drawn: {classes:?}"
            );
        }
    }

    /// Each failed run gets a retry that applies, the same again, one of a
    /// failure it never had and one of another tenant; each succeeded run
    /// a retry and one of a run that does not exist.
    #[test]
    fn the_retries_the_decoder_takes_have_each_fate() {
        let failed = [("f-1".to_string(), 7), ("f-2".to_string(), 9)];
        let plan = retry_plan(&failed, &["s-1".to_string()]);
        let fates = |f: fn(&Fate) -> bool| plan.iter().filter(|(_, fate)| f(fate)).count();
        assert_eq!(fates(|f| matches!(f, Fate::Applies)), 2);
        assert_eq!(fates(|f| matches!(f, Fate::NoOp)), 5);
        assert_eq!(fates(|f| matches!(f, Fate::DeadLettered(_))), 3);
        let limits = ductor::config::Config::load_from(None, Vec::<(String, String)>::new())
            .unwrap()
            .input_limits();
        let source = Source {
            topic: String::new(),
            partition: 0,
            offset: 0,
        };
        for (envelope, _) in &plan {
            let bytes = envelope.to_string().into_bytes();
            assert!(
                ductor::harness::classify(InputTopic::Wakeups, &bytes, &source, &limits).is_ok(),
                "the decoder takes {envelope}"
            );
        }
        let (first, again) = (&plan[0].0, &plan[1].0);
        assert_eq!(first, again, "the same retry twice");
        assert_eq!(first["failed_seq"], 7);
        assert_eq!(plan[2].0["failed_seq"], 1_000_007, "a failure it never had");
        assert_eq!(plan[3].0["tenant"], "globex");
    }
}
