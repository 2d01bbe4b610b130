//! The outbox drainer, the worker library and timers, end to end against
//! the real Kafka broker and Postgres.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use ductor::client::worker::{StepDispatch, StepOutcome};
use ductor::config::Config;
use ductor::infra::crash::CrashPoint;
use ductor::infra::prompt_producer::PromptProducer;
use ductor::ingress::IngressContext;
use ductor::outbox::{Drainer, FastLane, Handoff, RoundOutcome, Wakeup};
use futures::future::join_all;
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(120);

/// The headers every published effect must carry.
const EFFECT_HEADERS: [&str; 11] = [
    "idempotency-key",
    "ductor-run-id",
    "ductor-seq",
    "ductor-tenant",
    "ce_specversion",
    "ce_id",
    "ce_source",
    "ce_type",
    "ce_time",
    "ce_subject",
    "content-type",
];

struct Env {
    db: TestDb,
    config: Config,
    producer: FutureProducer,
    _workflows: tempfile::TempDir,
}

/// The workflow's output topic: not one of Ductor's own, but under the
/// test's prefix, so that it is the test's alone.
fn output_topic(config: &Config) -> String {
    format!("{}outputs", config.kafka.topic_prefix)
}

/// A workflow of three steps on pool "p", written for this test with its own
/// output topic; `retry` is the TOML of every step's retry table.
fn workflow_toml(output_topic: &str, retry: &str, timeout_ms: u64) -> String {
    let mut toml = format!("name = \"flow\"\nversion = 1\noutput_topic = \"{output_topic}\"\n");
    for step in ["a", "b", "c"] {
        toml.push_str(&format!(
            "\n[[steps]]\nname = \"{step}\"\npool = \"p\"\ntimeout_ms = {timeout_ms}\n\n[steps.retry]\n{retry}\n"
        ));
    }
    toml
}

impl Env {
    async fn new(retry: &str, timeout_ms: u64, tweak: impl FnOnce(&mut Config)) -> Env {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        let output_topic = output_topic(&config);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("flow.toml"),
            workflow_toml(&output_topic, retry, timeout_ms),
        )
        .unwrap();
        config.coordinator.workflows_dir = PathBuf::from(dir.path());
        config.kafka.step_pools = vec!["p".into()];
        config.kafka.extra_topics = vec![output_topic];
        config.drainer.poll_interval_ms = 200;
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        Env {
            db,
            config,
            producer: producer(),
            _workflows: dir,
        }
    }

    fn output_topic(&self) -> String {
        output_topic(&self.config)
    }

    fn serve(&self) -> Task {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::cli::serve::run(
            self.config.clone(),
            shutdown.clone(),
        ));
        Task { shutdown, task }
    }

    fn ingress_context(&self) -> IngressContext {
        let workflows = ductor::infra::workflows::load_dir(&self.config.coordinator.workflows_dir)
            .expect("loading workflows");
        IngressContext::new(&self.config, self.db.pool.clone(), workflows)
            .expect("creating ingress")
    }

    /// The coordinator's ingress, subscribed, for the test to drive a batch
    /// at a time ([`Env::step_starts`]); intents pile up undrained.
    fn stepped_ingress(&self) -> IngressContext {
        let ctx = self.ingress_context();
        ductor::ingress::subscribe(&ctx).expect("subscribing the ingress");
        ctx
    }

    /// Steps `ingress` through the starts `sent` by [`Env::start_runs`],
    /// and checks that each made a run.
    async fn step_starts(&self, ingress: &IngressContext, sent: &[(i32, i64)]) {
        let requests = self.config.topic_names().requests();
        let report = step_through(ingress, &requests, sent, WAIT).await;
        assert_eq!(
            report.applied,
            sent.len(),
            "every start applies: {report:?}"
        );
    }

    /// The coordinator's ingress alone, as a loop, so intents pile up
    /// undrained.
    fn ingress(&self) -> Task {
        let ctx = self.ingress_context();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::ingress::run(ctx, shutdown.clone()));
        Task { shutdown, task }
    }

    /// The coordinator's ingress and a drainer joined by the fast lane, as
    /// `serve` joins them, and a handoff of the lane that tells how many
    /// intents it published. The lane runs until the last handoff is gone:
    /// drop it before stopping the drainer.
    fn ingress_with_fast_lane(&self) -> (Task, Task, Handoff) {
        self.ingress_with_lane_of(self.drainer())
    }

    /// [`Env::ingress_with_fast_lane`] with a drainer of the test's making.
    fn ingress_with_lane_of(&self, drainer: Drainer) -> (Task, Task, Handoff) {
        let wakeup = Wakeup::default();
        let (handoff, lane) = drainer.fast_lane(&wakeup);
        let mut ctx = self.ingress_context();
        ctx.wakeup = Some(wakeup.clone());
        ctx.applier.handoff = Some(handoff.clone());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::ingress::run(ctx, shutdown.clone()));
        let ingress = Task { shutdown, task };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::outbox::run_with_fast_lane(
            drainer,
            wakeup,
            Some(lane),
            shutdown.clone(),
        ));
        (ingress, Task { shutdown, task }, handoff)
    }

    fn drainer(&self) -> Drainer {
        Drainer::new(
            self.db.pool.clone(),
            ductor::infra::kafka::producer(&self.config.kafka, "test-drainer").unwrap(),
            self.config.drainer.clone(),
            Duration::from_millis(self.config.kafka.delivery_timeout_ms),
        )
    }

    fn worker<F, Fut>(&self, handler: F) -> Task
    where
        F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = StepOutcome> + Send + 'static,
    {
        let options = ductor::client::worker::WorkerOptions::from_config(&self.config, "p");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::client::worker::run(
            options,
            handler,
            shutdown.clone(),
        ));
        Task { shutdown, task }
    }

    /// Sends a start of each run; returns where each landed on the
    /// requests topic (partition, offset).
    async fn start_runs(&self, run_ids: &[String]) -> Vec<(i32, i64)> {
        let topic = self.config.topic_names().requests();
        let sends = run_ids.iter().map(|run_id| {
            let value = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
                               "tenant": "acme", "workflow": "flow", "input": {"n": run_id}});
            let producer = &self.producer;
            let topic = &topic;
            async move { produce(producer, topic, run_id, value.to_string().as_bytes(), &[]).await }
        });
        join_all(sends).await
    }

    async fn count_status(&self, status: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM runs WHERE status = $1")
            .bind(status)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Waits for `n` runs in `status`, for the tests where serve or several
    /// drainers move the runs on their own loops.
    async fn wait_all(&self, status: &str, n: i64) {
        // A poll: the runs move on loops the test does not drive.
        eventually(&format!("{n} runs {status}"), WAIT, || async {
            (self.count_status(status).await == n).then_some(())
        })
        .await
    }

    /// Waits for the dispatch of `run_id`'s step `step_index`, for the
    /// tests where an ingress loop (serve's, or one beside racing drainers)
    /// applies it.
    async fn dispatched_stamp(&self, run_id: &str, step_index: i32) -> uuid::Uuid {
        // A poll: an ingress loop the test does not drive applies it.
        eventually(
            &format!("{run_id} step {step_index} dispatched"),
            WAIT,
            || dispatched_attempt(&self.db.pool, run_id, step_index),
        )
        .await
    }

    /// The stamp of `run_id`'s dispatched attempt of step `step_index`,
    /// which a batch applied already has committed.
    async fn attempt_stamp(&self, run_id: &str, step_index: i32) -> uuid::Uuid {
        dispatched_attempt(&self.db.pool, run_id, step_index)
            .await
            .unwrap_or_else(|| panic!("{run_id} has no dispatched step {step_index}"))
    }

    async fn send_success(&self, run_id: &str, stamp: uuid::Uuid) {
        let value = json!({"type": "attempt.result", "schema_version": 1, "run_id": run_id,
                           "tenant": "acme", "stamp": stamp, "outcome": "succeeded", "output": 1});
        produce(
            &self.producer,
            &self.config.topic_names().attempt_results(),
            run_id,
            value.to_string().as_bytes(),
            &[],
        )
        .await;
    }

    /// Runs a serve and a worker that succeeds until `run_id`, the only
    /// run, has succeeded, and proves that none of its attempts timed out.
    async fn serve_until_it_succeeds_on_time(&self, run_id: &str) {
        let serve = self.serve();
        let worker = self.worker(|step: StepDispatch| async move {
            StepOutcome::Succeeded(json!({"step": step.step}))
        });
        // A poll: serve and the worker move the run on their own loops.
        self.wait_all("succeeded", 1).await;
        let not_succeeded: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM run_attempts WHERE run_id = $1 AND status <> 'succeeded'",
        )
        .bind(run_id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap();
        assert_eq!(not_succeeded, 0, "no attempt of {run_id} timed out");
        worker.stop().await;
        serve.stop().await;
    }

    /// Distinct idempotency keys committed per topic.
    async fn intent_keys(&self) -> HashMap<String, HashSet<String>> {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT topic, idempotency_key FROM eec_effect_intent")
                .fetch_all(&self.db.pool)
                .await
                .unwrap();
        let mut out: HashMap<String, HashSet<String>> = HashMap::new();
        for (topic, key) in rows {
            out.entry(topic).or_default().insert(key);
        }
        out
    }
}

struct Task {
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Task {
    async fn stop(self) {
        self.shutdown.cancel();
        self.task
            .await
            .expect("task panicked")
            .expect("task stopped with an error");
    }
}

/// Lets `lane` publish, complete or give back everything handed to it, and
/// returns once it has: a lane ends after its last [`Handoff`] is gone,
/// which the caller has dropped. The drainer is stopped before its first
/// claim round, so whatever went out went through the lane.
async fn run_lane_out(drainer: Drainer, lane: FastLane) {
    let stopped = CancellationToken::new();
    stopped.cancel();
    ductor::outbox::run_with_fast_lane(drainer, Wakeup::default(), Some(lane), stopped)
        .await
        .expect("the fast lane stops cleanly");
}

fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()
        .and_then(|hs| hs.iter().find(|h| h.key == name).and_then(|h| h.value))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Reads `topic` from the beginning until every key in `keys` was seen;
/// returns every message read (duplicates included).
async fn read_keys(topic: &str, keys: &HashSet<String>) -> Vec<OwnedMessage> {
    let consumer = reader(&[topic]);
    let mut seen = HashSet::new();
    let mut messages = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while seen.len() < keys.len() {
        let m = match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => common::on_contract(m.detach()),
            Ok(Err(e)) => panic!("consumer error on {topic}: {e}"),
            Err(_) => panic!(
                "{topic}: saw {} of {} idempotency keys before timing out",
                seen.len(),
                keys.len()
            ),
        };
        if let Some(k) = header(&m, "idempotency-key") {
            seen.insert(k);
        }
        messages.push(m);
    }
    messages
}

/// Asserts that, per run, the first deliveries on a topic follow seq order.
fn assert_first_deliveries_in_seq_order(topic: &str, messages: &[OwnedMessage]) {
    let mut seen_keys = HashSet::new();
    let mut last: HashMap<String, (i64, i64)> = HashMap::new();
    for m in messages {
        let key = header(m, "idempotency-key").expect("idempotency-key");
        if !seen_keys.insert(key.clone()) {
            continue;
        }
        let run = header(m, "ductor-run-id").expect("ductor-run-id");
        let seq: i64 = header(m, "ductor-seq").unwrap().parse().unwrap();
        let index: i64 = key.rsplit('/').next().unwrap().parse().unwrap();
        if let Some(prev) = last.get(&run) {
            assert!(
                (seq, index) > *prev,
                "{topic}: run {run} delivered {seq}/{index} after {prev:?}"
            );
        }
        last.insert(run, (seq, index));
    }
}

fn assert_effect_headers(topic: &str, messages: &[OwnedMessage]) {
    for m in messages {
        for name in EFFECT_HEADERS {
            assert!(
                header(m, name).is_some_and(|v| !v.is_empty()),
                "{topic}: a message lacks header {name}"
            );
        }
        assert_eq!(header(m, "ce_id"), header(m, "idempotency-key"));
        assert_eq!(header(m, "ce_specversion").as_deref(), Some("1.0"));
        assert_eq!(
            m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            header(m, "ductor-run-id"),
            "{topic}: effects are keyed by run"
        );
    }
}

#[tokio::test]
async fn committed_effects_take_the_fast_lane_and_runs_finish_without_polling() {
    const RUNS: usize = 20;
    // With a ten-minute poll, only the fast lane and the wake-ups it sends
    // for intents queued behind others move effects in the test's time.
    let env = Env::new(
        "max_attempts = 1\ninitial_backoff_ms = 20\nmax_backoff_ms = 20\nmultiplier = 1.0\njitter = 0.0",
        60_000,
        |c| c.drainer.poll_interval_ms = 600_000,
    )
    .await;
    // The drainer's own lane counts what it published: other tests of this
    // process publish through lanes of their own at the same time.
    let (ingress, drainer, handoff) = env.ingress_with_fast_lane();
    let worker = env.worker(|step: StepDispatch| async move {
        StepOutcome::Succeeded(json!({"step": step.step}))
    });
    let runs: Vec<String> = (0..RUNS).map(|i| format!("{}-{i}", unique("f"))).collect();
    env.start_runs(&runs).await;
    // A poll: the fast lane's timing, on running loops, is the subject.
    env.wait_all("succeeded", RUNS as i64).await;
    // Every run's first transition has nothing undelivered ahead of it, so
    // at least its event and its first dispatch went through the fast lane.
    let handed = handoff.delivered();
    drop(handoff);
    assert!(
        handed >= 2 * RUNS as u64,
        "only {handed} effects took the fast lane for {RUNS} fresh runs"
    );
    let keys = env.intent_keys().await;
    let events_topic = env.config.topic_names().events();
    let messages = read_keys(&events_topic, &keys[events_topic.as_str()]).await;
    assert_effect_headers(&events_topic, &messages);
    assert_first_deliveries_in_seq_order(&events_topic, &messages);
    worker.stop().await;
    ingress.stop().await;
    drainer.stop().await;
    env.db.drop_db().await;
}

/// Settings under which a lingering producer would hold every record for
/// ten minutes, far past [`WAIT`].
/// Rounds that follow each other by a millisecond are still quiet.
fn lingering(config: &mut Config) {
    config.kafka.linger_ms = 600_000;
    config.kafka.prompt_after_ms = 1;
    config.kafka.delivery_timeout_ms = 900_000;
    config.drainer.lease_ms = 1_000_000;
}

/// A quiet drainer sends on its prompt producer: with a linger of ten
/// minutes, a fresh run's event and first dispatch still arrive at once.
/// Without the prompt producer (or with `kafka.prompt_max_in_flight` 0) they
/// would wait out the linger, and the test would time out.
#[tokio::test]
async fn a_quiet_drainers_effects_do_not_wait_for_the_linger() {
    let env = Env::new(
        "max_attempts = 1\ninitial_backoff_ms = 20\nmax_backoff_ms = 20\nmultiplier = 1.0\njitter = 0.0",
        600_000,
        |c| {
            lingering(c);
            c.drainer.poll_interval_ms = 600_000;
        },
    )
    .await;
    assert!(env.config.kafka.prompt_max_in_flight > 0, "on by default");
    let prompt = PromptProducer::new(
        ductor::infra::kafka::producer_config(&env.config.kafka, "test-prompt"),
        env.config.kafka.prompt_max_in_flight,
        Duration::from_millis(env.config.kafka.prompt_after_ms),
    )
    .unwrap();
    let (ingress, drainer, handoff) =
        env.ingress_with_lane_of(env.drainer().with_prompt_producer(prompt));
    let run_id = unique("quiet");
    env.start_runs(std::slice::from_ref(&run_id)).await;
    let names = env.config.topic_names();
    // The first transition's effects: its event, then the dispatch.
    for (topic, index) in [(names.events(), 0), (names.steps("p"), 1)] {
        let key = ductor::contract::idempotency_key(&run_id, 1, index);
        let messages = read_keys(&topic, &HashSet::from([key.clone()])).await;
        assert!(
            messages
                .iter()
                .any(|m| header(m, "idempotency-key").as_deref() == Some(key.as_str())),
            "{topic} carries {key}"
        );
    }
    drop(handoff);
    ingress.stop().await;
    drainer.stop().await;
    env.db.drop_db().await;
}

/// A run that moves alone crosses no linger: with a linger of ten
/// minutes, serve's drainer and the worker library both send each of the
/// run's effects and results at once, and its three steps finish in the
/// test's time.
#[tokio::test]
async fn a_run_alone_crosses_no_linger_in_serve_or_the_worker() {
    let env = Env::new("max_attempts = 1", 600_000, lingering).await;
    let run_id = unique("alone");
    env.start_runs(std::slice::from_ref(&run_id)).await;
    env.serve_until_it_succeeds_on_time(&run_id).await;
    env.db.drop_db().await;
}

/// The prompt producer's poller stops when nothing is in flight and starts
/// again with the next send: bursts one after another, each awaited
/// whole, are all acknowledged, and every record is in its topic.
#[tokio::test]
async fn the_prompt_producer_delivers_burst_after_burst() {
    const BURSTS: usize = 4;
    const RECORDS: usize = 50;
    let env = Env::new("max_attempts = 1", 60_000, lingering).await;
    let prompt = PromptProducer::new(
        ductor::infra::kafka::producer_config(&env.config.kafka, "test-prompt"),
        1,
        Duration::ZERO,
    )
    .unwrap();
    let topic = env.output_topic();
    let mut keys = HashSet::new();
    for burst in 0..BURSTS {
        let sends = (0..RECORDS).map(|i| {
            let key = format!("{}-{burst}-{i}", unique("burst"));
            keys.insert(key.clone());
            let prompt = &prompt;
            let topic = &topic;
            async move {
                let mut headers = rdkafka::message::OwnedHeaders::new();
                headers = headers.insert(rdkafka::message::Header {
                    key: "idempotency-key",
                    value: Some(key.as_bytes()),
                });
                prompt.send(topic, key.as_bytes(), b"{}", headers).await
            }
        });
        let delivered = tokio::time::timeout(WAIT, join_all(sends))
            .await
            .unwrap_or_else(|_| panic!("burst {burst} not acknowledged in {WAIT:?}"));
        for delivery in delivered {
            let delivery = delivery.expect("acknowledged");
            assert!(delivery.offset >= 0, "{delivery:?}");
        }
    }
    let messages = read_keys(&topic, &keys).await;
    assert!(messages.len() >= BURSTS * RECORDS);
    env.db.drop_db().await;
}

/// A retry's backoff is a timer committed with the failed attempt: the
/// drainer, idle, is told when it falls due and looks again then, without
/// a claim round at the commit. With a ten-minute poll nothing else can
/// publish the retries in the test's time.
#[tokio::test]
async fn timers_committed_while_the_drainer_idles_are_published_when_due_without_a_poll() {
    const RUNS: usize = 10;
    let env = Env::new(
        "max_attempts = 3\ninitial_backoff_ms = 300\nmax_backoff_ms = 300\nmultiplier = 1.0\njitter = 0.0",
        60_000,
        |c| c.drainer.poll_interval_ms = 600_000,
    )
    .await;
    let (ingress, drainer, handoff) = env.ingress_with_fast_lane();
    let worker = env.worker(|step: StepDispatch| async move {
        if step.attempt == 1 {
            StepOutcome::Failed {
                message: "transient".into(),
                retryable: true,
            }
        } else {
            StepOutcome::Succeeded(json!({"step": step.step}))
        }
    });
    let runs: Vec<String> = (0..RUNS).map(|i| format!("{}-{i}", unique("t"))).collect();
    env.start_runs(&runs).await;
    // A poll: the drainer's timing, on running loops, is the subject.
    env.wait_all("succeeded", RUNS as i64).await;
    let retried: i64 = sqlx::query_scalar("SELECT count(*) FROM run_attempts WHERE attempt > 1")
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert!(
        retried >= RUNS as i64,
        "every step was retried after its backoff: {retried} retries"
    );
    // The fast lane ends once the apply's side of it is gone.
    drop(handoff);
    worker.stop().await;
    ingress.stop().await;
    drainer.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn a_thousand_runs_with_a_flaky_step_all_succeed_with_headers_and_order() {
    const RUNS: usize = 1000;
    let env = Env::new(
        "max_attempts = 5\ninitial_backoff_ms = 20\nmax_backoff_ms = 200\nmultiplier = 2.0\njitter = 0.5",
        60_000,
        |_| {},
    )
    .await;
    let serve = env.serve();
    // Step "b" fails (retryably) on its first attempt for every third run.
    let worker = env.worker(|step: StepDispatch| async move {
        let flaky = step.run_id.ends_with(['0', '3', '6', '9']);
        if step.step == "b" && step.attempt == 1 && flaky {
            StepOutcome::Failed {
                message: "transient".into(),
                retryable: true,
            }
        } else {
            StepOutcome::Succeeded(json!({"step": step.step, "input": step.input}))
        }
    });
    let runs: Vec<String> = (0..RUNS).map(|i| format!("{}-{i}", unique("r"))).collect();
    env.start_runs(&runs).await;
    // A poll: serve and the worker move a thousand runs on their own loops.
    env.wait_all("succeeded", RUNS as i64).await;
    let retried: i64 = sqlx::query_scalar("SELECT count(*) FROM run_attempts WHERE attempt > 1")
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert!(retried > 0, "the flaky step caused retries");

    let keys = env.intent_keys().await;
    // A poll: serve's drainer publishes on its own loop.
    eventually("every intent drained", WAIT, || async {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM eec_effect_intent WHERE status <> 'completed' AND not_before <= now()",
        )
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        (left == 0).then_some(())
    })
    .await;
    let names = env.config.topic_names();
    let steps_topic = names.steps("p");
    let events_topic = names.events();
    let output_topic = env.output_topic();
    for topic in [&steps_topic, &events_topic, &output_topic] {
        let messages = read_keys(topic, &keys[topic.as_str()]).await;
        assert_effect_headers(topic, &messages);
        assert_first_deliveries_in_seq_order(topic, &messages);
    }
    assert_eq!(keys[&output_topic].len(), RUNS, "one output per run");
    assert_eq!(
        keys[&events_topic].len() as i64,
        env.db.count("run_transitions").await,
        "one event per transition"
    );
    worker.stop().await;
    serve.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn a_drainer_stopped_after_publishing_republishes_with_the_same_key_and_dedup_applies_once() {
    let env = Env::new("max_attempts = 1", 60_000, |c| {
        c.kafka.delivery_timeout_ms = 2_000;
        c.drainer.lease_ms = 2_500;
    })
    .await;
    let ingress = env.stepped_ingress();
    let run_id = unique("crash-");
    let sent = env.start_runs(std::slice::from_ref(&run_id)).await;
    env.step_starts(&ingress, &sent).await;
    env.attempt_stamp(&run_id, 0).await;

    let mut crashing = env.drainer();
    crashing.crash.arm(CrashPoint::DrainerAfterPublish);
    let err = crashing
        .drain_once()
        .await
        .expect_err("the hook stops the drainer after publishing");
    assert!(err.to_string().contains("after publishing"), "{err:#}");
    let claimed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM eec_effect_intent WHERE status = 'claimed' AND run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert!(claimed > 0, "published intents stay claimed, not completed");

    // A new drainer cannot take them while the lease holds; once it expires
    // the reconciler redrives them and they are published again.
    let restarted = env.drainer();
    // A poll: only Postgres's clock ends the lease of the drainer that died.
    eventually("the claim lease expires", WAIT, || async {
        (restarted.reconcile().await.unwrap() > 0).then_some(())
    })
    .await;
    assert!(matches!(
        restarted.drain_once().await.unwrap(),
        RoundOutcome::Drained { completed, released: 0, .. } if completed > 0
    ));

    let events_topic = env.config.topic_names().events();
    let consumer = reader(&[&events_topic]);
    let copies = read_n(&consumer, 2, WAIT).await;
    assert_eq!(
        header(&copies[0], "idempotency-key"),
        header(&copies[1], "idempotency-key"),
        "a redriven effect carries the key of its first delivery"
    );
    assert_eq!(
        copies[0].payload(),
        copies[1].payload(),
        "and the same bytes"
    );

    // The consumer-side helper applies the effect once. Its tables are the
    // owner's to create and grant; the application role uses them.
    ductor::client::dedup::ensure_schema(&env.db.owner)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE applied (run_id text NOT NULL, key text NOT NULL)")
        .execute(&env.db.owner)
        .await
        .unwrap();
    env.db.grant_rows("ductor_dedup_seen").await;
    env.db.grant_rows("applied").await;
    for m in &copies {
        let mut tx = env.db.pool.begin().await.unwrap();
        if ductor::client::dedup::claim_message(&mut tx, "test-consumer", m)
            .await
            .unwrap()
            == ductor::client::dedup::Claim::First
        {
            sqlx::query("INSERT INTO applied VALUES ($1, $2)")
                .bind(header(m, "ductor-run-id"))
                .bind(header(m, "idempotency-key"))
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    assert_eq!(env.db.count("applied").await, 1, "applied exactly once");
    ductor::ingress::close(&ingress);
    env.db.drop_db().await;
}

#[tokio::test]
async fn two_drainers_at_once_lose_nothing_and_keep_per_run_order() {
    let env = Env::new("max_attempts = 1", 60_000, |c| {
        // Small batches make the two drainers interleave on the same runs.
        c.drainer.batch_max_intents = 7;
        c.drainer.poll_interval_ms = 20;
    })
    .await;
    let ingress = env.ingress();
    let stop = CancellationToken::new();
    let drainers: Vec<JoinHandle<anyhow::Result<()>>> = (0..2)
        .map(|_| {
            tokio::spawn(ductor::outbox::run(
                env.drainer(),
                Wakeup::default(),
                stop.clone(),
            ))
        })
        .collect();
    let runs: Vec<String> = (0..40).map(|i| format!("{}-{i}", unique("two-"))).collect();
    env.start_runs(&runs).await;
    for step in 0..3 {
        for run_id in &runs {
            // A poll: the ingress loop applies results while two drainers race.
            let stamp = env.dispatched_stamp(run_id, step).await;
            env.send_success(run_id, stamp).await;
        }
    }
    // A poll: the ingress loop moves the runs while two drainers race.
    env.wait_all("succeeded", runs.len() as i64).await;
    // A poll: two drainer loops racing for the same runs are the subject.
    eventually("every due intent completed", WAIT, || async {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM eec_effect_intent WHERE status <> 'completed' AND not_before <= now()",
        )
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        (left == 0).then_some(())
    })
    .await;
    stop.cancel();
    for d in drainers {
        d.await.unwrap().expect("drainer stops cleanly");
    }
    let keys = env.intent_keys().await;
    let names = env.config.topic_names();
    for topic in [names.events(), names.steps("p")] {
        let messages = read_keys(&topic, &keys[&topic]).await;
        assert_effect_headers(&topic, &messages);
        assert_first_deliveries_in_seq_order(&topic, &messages);
        let delivered: HashSet<String> = messages
            .iter()
            .filter_map(|m| header(m, "idempotency-key"))
            .collect();
        assert_eq!(delivered, keys[&topic], "{topic}: nothing lost");
    }
    ingress.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn a_retry_fires_after_its_backoff_and_a_pending_timer_survives_a_restart() {
    let env = Env::new(
        "max_attempts = 3\ninitial_backoff_ms = 1500\nmax_backoff_ms = 1500\nmultiplier = 1.0\njitter = 0.0",
        60_000,
        |_| {},
    )
    .await;
    let first = env.serve();
    let worker = env.worker(|step: StepDispatch| async move {
        if step.step == "a" && step.attempt == 1 {
            StepOutcome::Failed {
                message: "try again".into(),
                retryable: true,
            }
        } else {
            StepOutcome::Succeeded(json!(step.step))
        }
    });
    let run_id = unique("timer-");
    env.start_runs(std::slice::from_ref(&run_id)).await;
    let pool = env.db.pool.clone();
    let names = env.config.topic_names();
    // The retry timer: a wakeup intent with a future not_before.
    // A poll: serve applies the failure on its own loops, and is restarted.
    let (timer_id, not_before): (i64, chrono::DateTime<chrono::Utc>) =
        eventually("the retry timer is committed", WAIT, || async {
            sqlx::query_as(
                "SELECT intent_id, not_before FROM eec_effect_intent \
                 WHERE run_id = $1 AND topic = $2 AND convert_from(payload, 'UTF8')::jsonb->>'timer' = 'retry'",
            )
            .bind(&run_id)
            .bind(names.wakeups())
            .fetch_optional(&pool)
            .await
            .unwrap()
        })
        .await;
    // Restart serve while the timer is pending.
    first.stop().await;
    let status: String =
        sqlx::query_scalar("SELECT status FROM eec_effect_intent WHERE intent_id = $1")
            .bind(timer_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_ne!(
        status, "completed",
        "the timer had not fired before the restart"
    );
    let second = env.serve();
    // A poll: the restarted serve fires the timer when its backoff ends.
    eventually("the run succeeds after the retry", WAIT, || async {
        let s: Option<String> = sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
            .bind(&run_id)
            .fetch_optional(&pool)
            .await
            .unwrap();
        (s.as_deref() == Some("succeeded")).then_some(())
    })
    .await;

    let second_attempt: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT dispatched_at FROM run_attempts WHERE run_id = $1 AND step_index = 0 AND attempt = 2",
    )
    .bind(&run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        second_attempt >= not_before,
        "attempt 2 at {second_attempt} before the backoff ended at {not_before}"
    );
    // The wakeup itself was published no earlier than its not_before.
    let wakeups = reader(&[&names.wakeups()]);
    let mut fired = None;
    while fired.is_none() {
        let m = read_n(&wakeups, 1, WAIT).await.remove(0);
        if header(&m, "idempotency-key").is_some()
            && m.payload()
                .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                .is_some_and(|v| v["timer"] == "retry")
        {
            fired = Some(m);
        }
    }
    let fired = fired.unwrap();
    let published_ms = fired.timestamp().to_millis().expect("broker timestamp");
    assert!(
        published_ms >= not_before.timestamp_millis(),
        "the timer was published at {published_ms} ms, before its not_before {not_before}"
    );
    worker.stop().await;
    second.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn drained_intents_are_purged_after_retention_and_pending_ones_never() {
    // No retention: an intent completed by an earlier statement is past it.
    let env = Env::new("max_attempts = 1", 60_000, |c| c.drainer.retention_ms = 0).await;
    let ingress = env.stepped_ingress();
    let run_id = unique("purge-");
    let sent = env.start_runs(std::slice::from_ref(&run_id)).await;
    env.step_starts(&ingress, &sent).await;
    env.attempt_stamp(&run_id, 0).await;
    let drainer = env.drainer();
    assert!(matches!(
        drainer.drain_once().await.unwrap(),
        RoundOutcome::Drained { .. }
    ));
    let by_status = |pool: sqlx::PgPool| async move {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM eec_effect_intent GROUP BY status")
                .fetch_all(&pool)
                .await
                .unwrap();
        rows.into_iter().collect::<BTreeMap<_, _>>()
    };
    let before = by_status(env.db.pool.clone()).await;
    let completed = before.get("completed").copied().unwrap_or(0);
    assert!(completed > 0);
    let pending_before = before.get("pending").copied().unwrap_or(0);
    assert!(pending_before > 0, "the timeout timer is still pending");
    let purged = drainer.purge().await.unwrap();
    assert_eq!(purged, completed as u64, "one retention round purges them");
    let after = by_status(env.db.pool.clone()).await;
    assert!(
        !after.contains_key("completed"),
        "completed intents purged: {after:?}"
    );
    assert_eq!(after.get("pending").copied().unwrap_or(0), pending_before);
    ductor::ingress::close(&ingress);
    env.db.drop_db().await;
}

#[tokio::test]
async fn claims_of_a_batch_statement_whose_reply_was_lost_go_back_without_waiting_for_the_lease() {
    // A lease far longer than the test: only the hand-back can free them.
    let env = Env::new("max_attempts = 1", 60_000, |c| c.drainer.lease_ms = 600_000).await;
    let ingress = env.stepped_ingress();
    let run_id = unique("orphan-");
    let sent = env.start_runs(std::slice::from_ref(&run_id)).await;
    env.step_starts(&ingress, &sent).await;
    env.attempt_stamp(&run_id, 0).await;
    ductor::ingress::close(&ingress);

    // As a batch statement that committed its fast-lane claims and whose
    // reply never came back leaves them: claimed by a live drainer that
    // never heard of them.
    let drainer = env.drainer();
    let positions: Vec<(String, i64, i32)> = sqlx::query_as(
        "UPDATE eec_effect_intent SET status = 'claimed', claimed_by = $2, \
             claim_expires_at = now() + interval '10 minutes', attempts = 1 \
         WHERE run_id = $1 AND status = 'pending' AND not_before <= now() \
         RETURNING run_id, seq, effect_index",
    )
    .bind(&run_id)
    .bind(&drainer.drainer_id)
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    assert!(!positions.is_empty(), "the start committed due intents");

    let (handoff, lane) = drainer.fast_lane(&Wakeup::default());
    let given_back = positions
        .iter()
        .map(
            |(run_id, seq, effect_index)| ductor::outbox::IntentPosition {
                run_id: run_id.clone(),
                seq: *seq,
                effect_index: *effect_index,
            },
        )
        .collect();
    handoff.uncertain_at(given_back).await;
    drop(handoff);
    run_lane_out(drainer, lane).await;

    // Given back, any drainer may claim them; still claimed, none could
    // for ten minutes.
    let round = env.drainer().drain_once().await.unwrap();
    assert_eq!(
        round,
        RoundOutcome::Drained {
            completed: positions.len(),
            released: 0,
            transient: 0
        },
        "the handed-back intents are claimed and published"
    );
    let runs: Vec<String> = positions.iter().map(|p| p.0.clone()).collect();
    let seqs: Vec<i64> = positions.iter().map(|p| p.1).collect();
    let indexes: Vec<i32> = positions.iter().map(|p| p.2).collect();
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM eec_effect_intent i \
         JOIN UNNEST($1::text[], $2::int8[], $3::int4[]) AS u(run_id, seq, effect_index) \
           USING (run_id, seq, effect_index) \
         WHERE i.status = 'completed'",
    )
    .bind(&runs)
    .bind(&seqs)
    .bind(&indexes)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(
        completed as usize,
        positions.len(),
        "the handed-back intents are published"
    );
    env.db.drop_db().await;
}

#[tokio::test]
async fn completing_claims_probes_the_primary_key_after_the_outbox_was_analyzed_drained() {
    // Statistics taken while the outbox was drained say that no intent is
    // undelivered, while the partial index of undelivered intents still holds
    // an entry for every intent until a vacuum. Then new claims arrive.
    let db = TestDb::migrated().await;
    let insert_claimed = |from: i32, to: i32| {
        sqlx::query_scalar::<_, i64>(
            "INSERT INTO eec_effect_intent (run_id, seq, effect_index, idempotency_key, \
                 tenant_scope, topic, message_key, headers, payload, ce_type, not_before, \
                 status, claimed_by, claim_expires_at, attempts) \
             SELECT 'run-' || g, 1, 0, 'key-' || g, 'acme', 'events', '\\x00', '{}', \
                 '\\x00', 'run.started', now(), 'claimed', 'me', \
                 now() + interval '1 minute', 1 \
             FROM generate_series($1::int4, $2::int4) AS g \
             RETURNING intent_id",
        )
        .bind(from)
        .bind(to)
        .fetch_all(&db.pool)
    };
    insert_claimed(1, 3000).await.unwrap();
    sqlx::query(
        "UPDATE eec_effect_intent SET status = 'completed', completed_at = now(), \
             claimed_by = NULL, claim_expires_at = NULL",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Only the table's owner may analyse it.
    sqlx::query("ANALYZE eec_effect_intent")
        .execute(&db.owner)
        .await
        .unwrap();
    let claimed = insert_claimed(3001, 3005).await.unwrap();
    assert_eq!(claimed.len(), 5);

    let explain = format!("EXPLAIN {}", ductor::outbox::COMPLETE_SQL);
    let plan: Vec<String> = sqlx::query_scalar(&explain)
        .bind(&claimed[..3])
        .bind("me")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("eec_effect_intent_pkey"), "{plan}");
    assert!(!plan.contains("run_order_idx"), "{plan}");

    // And it completes exactly this drainer's claims among the ids given.
    let mut ids = claimed[..3].to_vec();
    ids.push(100); // delivered already
    let complete_as = |drainer: &'static str| {
        sqlx::query(ductor::outbox::COMPLETE_SQL)
            .bind(ids.clone())
            .bind(drainer)
            .execute(&db.pool)
    };
    assert_eq!(
        complete_as("someone-else").await.unwrap().rows_affected(),
        0
    );
    assert_eq!(complete_as("me").await.unwrap().rows_affected(), 3);
    let still_claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM eec_effect_intent WHERE status = 'claimed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(still_claimed, 2);
    db.drop_db().await;
}

/// The first delivery of an effect goes through the fast lane, with the
/// headers as the apply built them; a redelivery is read back from the
/// outbox's `jsonb`. Both carry the same key, value and headers, in the
/// same order.
#[tokio::test]
async fn a_redelivered_effect_is_byte_identical_to_its_first_delivery_headers_in_order() {
    let env = Env::new("max_attempts = 1", 60_000, |_| {}).await;
    // The apply hands what it commits to a drainer's fast lane, as in serve.
    let drainer = env.drainer();
    let (handoff, lane) = drainer.fast_lane(&Wakeup::default());
    let mut ingress = env.stepped_ingress();
    ingress.applier.handoff = Some(handoff);
    let run_id = unique("bytes-");
    let sent = env.start_runs(std::slice::from_ref(&run_id)).await;
    env.step_starts(&ingress, &sent).await;
    ingress.applier.handoff = None;
    run_lane_out(drainer, lane).await;
    let pool = env.db.pool.clone();
    let events_topic = env.config.topic_names().events();
    let undelivered = || {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT CASE WHEN count(*) > 0 THEN count(*) FILTER (WHERE status <> 'completed') END \
             FROM eec_effect_intent WHERE run_id = $1 AND seq = 1 AND topic = $2",
        )
        .bind(&run_id)
        .bind(&events_topic)
        .fetch_one(&pool)
    };
    assert_eq!(
        undelivered().await.unwrap(),
        Some(0),
        "the first transition's effects are delivered"
    );
    // Put them back as a redrive after a lost acknowledgement would.
    let reset = sqlx::query(
        "UPDATE eec_effect_intent SET status = 'pending', claimed_by = NULL, \
             claim_expires_at = NULL, completed_at = NULL \
         WHERE run_id = $1 AND seq = 1 AND topic = $2",
    )
    .bind(&run_id)
    .bind(&events_topic)
    .execute(&env.db.pool)
    .await
    .unwrap();
    assert!(reset.rows_affected() > 0);
    let round = env.drainer().drain_once().await.unwrap();
    assert_eq!(
        round,
        RoundOutcome::Drained {
            completed: reset.rows_affected() as usize,
            released: 0,
            transient: 0
        },
        "a claim round delivers them again"
    );
    let key = format!("{run_id}/1/0");
    let consumer = reader(&[&events_topic]);
    let mut copies = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while copies.len() < 2 {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .expect("both deliveries arrive")
            .expect("reading events")
            .detach();
        let m = common::on_contract(m);
        if header(&m, "idempotency-key").as_deref() == Some(key.as_str()) {
            copies.push(m);
        }
    }
    let all_headers = |m: &OwnedMessage| -> Vec<(String, Option<Vec<u8>>)> {
        m.headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(all_headers(&copies[0]).len() >= EFFECT_HEADERS.len());
    assert_eq!(all_headers(&copies[0]), all_headers(&copies[1]));
    assert_eq!(copies[0].key(), copies[1].key());
    assert_eq!(copies[0].payload(), copies[1].payload());
    ductor::ingress::close(&ingress);
    env.db.drop_db().await;
}

/// An effect the broker refuses for good (here a run output larger than
/// its topic takes) is tried a bounded number of times, then parked with
/// its error; it holds up nothing else; `redrive` puts it back once the
/// cause is fixed, and it is published as committed.
#[tokio::test]
async fn an_effect_the_broker_refuses_is_parked_without_holding_anything_up_and_redriven() {
    let env = Env::new("max_attempts = 1", 60_000, |c| {
        c.drainer.park_after_failures = 2;
        c.drainer.publish_retry_min_ms = 50;
        c.drainer.max_backoff_ms = 200;
    })
    .await;
    let serve = env.serve();
    let worker = env.worker(|step: StepDispatch| async move {
        if step.step == "c" && step.run_id.starts_with("big-") {
            // Random hex: lz4 cannot shrink it below the topic's limit.
            let noise: String = (0..256)
                .map(|_| uuid::Uuid::new_v4().simple().to_string())
                .collect();
            StepOutcome::Succeeded(json!({ "noise": noise }))
        } else {
            StepOutcome::Succeeded(json!({ "step": step.step }))
        }
    });
    let warm = format!("small-{}", unique(""));
    env.start_runs(std::slice::from_ref(&warm)).await;
    // A poll: serve and the worker move the run on their own loops.
    env.wait_all("succeeded", 1).await;
    let output_topic = env.output_topic();
    set_topic_limit(&env.config.kafka, &output_topic, 1024).await;

    let big = format!("big-{}", unique(""));
    let small = format!("small-{}", unique(""));
    env.start_runs(&[big.clone(), small.clone()]).await;
    // A poll: serve and the worker move the runs on their own loops.
    env.wait_all("succeeded", 3).await;
    let output_status = |run_id: String| {
        let pool = env.db.pool.clone();
        let topic = output_topic.clone();
        async move {
            sqlx::query_as::<_, (String, i32, Option<String>)>(
                "SELECT status, publish_failures, last_error FROM eec_effect_intent \
                 WHERE run_id = $1 AND topic = $2",
            )
            .bind(run_id)
            .bind(topic)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    // A poll: serve's drainer parks it on its own rounds, after a backoff.
    let parked = eventually("the big output is parked", WAIT, || async {
        let row = output_status(big.clone()).await;
        (row.0 == "parked").then_some(row)
    })
    .await;
    assert_eq!(parked.1, 2, "parked after park_after_failures");
    assert!(
        parked.2.is_some_and(|e| e.to_lowercase().contains("size")),
        "the error is kept"
    );
    // A poll: serve's drainer publishes it on its own loop.
    eventually("the small output is delivered", WAIT, || async {
        (output_status(small.clone()).await.0 == "completed").then_some(())
    })
    .await;
    // The run's followers learn of it on the events topic.
    // A poll: serve's drainer publishes the notice on its own loop.
    let notice: Vec<u8> = eventually("the parked effect's notice is published", WAIT, || async {
        sqlx::query_scalar(
            "SELECT payload FROM eec_effect_intent \
             WHERE run_id = $1 AND ce_type = $2 AND status = 'completed'",
        )
        .bind(&big)
        .bind(ductor::contract::EffectKind::EffectParked.ce_type())
        .fetch_optional(&env.db.pool)
        .await
        .unwrap()
    })
    .await;
    let notice: serde_json::Value = serde_json::from_slice(&notice).unwrap();
    assert_eq!(notice["type"], "run.effect_parked");
    assert_eq!(notice["topic"], output_topic.as_str());
    assert!(notice["error"].as_str().is_some_and(|e| !e.is_empty()));
    let inspected = ductor::cli::inspect::run(&env.db.pool, &big)
        .await
        .unwrap()
        .unwrap();
    let listed = inspected["parked_effects"].as_array().unwrap();
    assert_eq!(listed.len(), 1, "{inspected}");
    assert_eq!(listed[0]["topic"], output_topic.as_str());

    // Fixed: the topic takes the record again, and a redrive publishes it.
    set_topic_limit(&env.config.kafka, &output_topic, 1_048_588).await;
    let redriven = ductor::outbox::Drainer::redrive_parked(&env.db.pool, Some(&big), None)
        .await
        .unwrap();
    assert_eq!(redriven, 1);
    // A poll: serve's drainer, woken by the redrive, publishes it.
    eventually("the redriven output is delivered", WAIT, || async {
        (output_status(big.clone()).await.0 == "completed").then_some(())
    })
    .await;
    let stored: Vec<u8> = sqlx::query_scalar(
        "SELECT payload FROM eec_effect_intent WHERE run_id = $1 AND topic = $2",
    )
    .bind(&big)
    .bind(&output_topic)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    let consumer = reader(&[&output_topic]);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .expect("the output arrives")
            .unwrap()
            .detach();
        let m = common::on_contract(m);
        if m.key() == Some(big.as_bytes()) {
            assert_eq!(m.payload(), Some(stored.as_slice()));
            break;
        }
    }
    worker.stop().await;
    serve.stop().await;
    env.db.drop_db().await;
}

/// A process that committed a step's dispatch, claimed it for its fast
/// lane and died before publishing it must not cost the run anything: the
/// claim is given back once the dead drainer's heartbeat stops (the lease
/// here is ten minutes, so nothing else can explain it within the test),
/// the reconciler that gave it back wakes its drainer (the safety-net poll
/// is ten minutes too), and the step's timeout, shorter than that, waits
/// for the dispatch and counts from its publication. With one attempt per
/// step, a timeout would fail the run.
#[tokio::test]
async fn a_dispatch_claimed_by_a_drainer_that_died_is_redriven_and_its_timeout_waits_for_it() {
    // The step's timer falls due after the test's wait: the drainer cannot
    // have woken for it either.
    let env = Env::new("max_attempts = 1", 300_000, |c| {
        c.drainer.lease_ms = 600_000;
        c.drainer.poll_interval_ms = 600_000;
        c.drainer.heartbeat_interval_ms = 250;
        c.drainer.member_timeout_ms = 1_000;
        c.drainer.reconcile_interval_ms = 250;
    })
    .await;
    let dead = env.drainer();
    let run_id = started_under(&env, &dead, "orphan-").await;
    env.attempt_stamp(&run_id, 0).await;
    let claimed_by_dead = claimed_by(&env, &run_id, &dead.drainer_id).await;
    assert!(claimed_by_dead > 0, "the dead process holds the dispatch");
    drop(dead);

    env.serve_until_it_succeeds_on_time(&run_id).await;
    env.db.drop_db().await;
}

/// Starts a run (id `prefix` and a unique suffix) in a process that then
/// dies: `dead` announced itself, and its fast lane claimed the run's
/// effects at commit and is gone before publishing them, as a SIGKILL
/// leaves it.
async fn started_under(env: &Env, dead: &Drainer, prefix: &str) -> String {
    dead.heartbeat().await.unwrap();
    let (handoff, lane) = dead.fast_lane(&Wakeup::default());
    drop(lane);
    let mut ingress = env.stepped_ingress();
    ingress.applier.handoff = Some(handoff);
    let run_id = unique(prefix);
    let sent = env.start_runs(std::slice::from_ref(&run_id)).await;
    env.step_starts(&ingress, &sent).await;
    ductor::ingress::close(&ingress);
    drop(ingress);
    run_id
}

/// How many intents of `run_id` `drainer_id` holds claimed.
async fn claimed_by(env: &Env, run_id: &str, drainer_id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM eec_effect_intent \
         WHERE run_id = $1 AND status = 'claimed' AND claimed_by = $2",
    )
    .bind(run_id)
    .bind(drainer_id)
    .fetch_one(&env.db.pool)
    .await
    .unwrap()
}

/// A serve restarted under its instance name (`kafka.group_instance_id`)
/// takes back the claims its killed predecessor held as soon as its own
/// drainer is recorded, without waiting for the predecessor's heartbeat to
/// be silent for a member timeout (ten minutes here, as is the lease); a
/// drainer of another name, or of none, takes nothing.
#[tokio::test]
async fn a_restarted_instance_takes_back_its_predecessors_claims_at_once() {
    let env = Env::new("max_attempts = 1", 300_000, |c| {
        c.drainer.lease_ms = 600_000;
        c.drainer.member_timeout_ms = 600_000;
    })
    .await;
    let dead = env.drainer().with_instance(Some("serve-1".into()));
    let run_id = started_under(&env, &dead, "reborn-").await;
    let held = claimed_by(&env, &run_id, &dead.drainer_id).await;
    assert!(held > 0, "the dead process holds the run's effects");

    for other in [
        env.drainer().with_instance(Some("serve-2".into())),
        env.drainer(),
    ] {
        other.heartbeat().await.unwrap();
        assert_eq!(other.take_over_predecessors().await.unwrap(), 0);
        assert_eq!(
            other.reconcile().await.unwrap(),
            0,
            "the dead one is not silent long enough"
        );
    }
    assert_eq!(claimed_by(&env, &run_id, &dead.drainer_id).await, held);

    let reborn = env.drainer().with_instance(Some("serve-1".into()));
    reborn.heartbeat().await.unwrap();
    assert_eq!(reborn.take_over_predecessors().await.unwrap(), held as u64);
    assert_eq!(claimed_by(&env, &run_id, &dead.drainer_id).await, 0);
    let members: Vec<String> =
        sqlx::query_scalar("SELECT drainer_id FROM eec_drainer_member WHERE instance = 'serve-1'")
            .fetch_all(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(
        members,
        [reborn.drainer_id.as_str()],
        "the predecessor is forgotten"
    );
    // A second take-over finds nothing left.
    assert_eq!(reborn.take_over_predecessors().await.unwrap(), 0);

    reborn.drain_once().await.expect("a drain round");
    let due_left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM eec_effect_intent \
         WHERE run_id = $1 AND cancel_key IS NULL AND status <> 'completed'",
    )
    .bind(&run_id)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(due_left, 0, "the given-back effects are published");
    env.db.drop_db().await;
}

/// A worker answers in time while no serve reads the attempt results (the
/// one that owned them crashed): the step's timeout is held until the
/// result has been applied, and the run succeeds instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_sent_in_time_holds_the_timeout_while_no_serve_reads_it() {
    let env = Env::new("max_attempts = 1", 2_000, |_| {}).await;
    let serve = env.serve();
    let run_id = unique("frontier-");
    env.start_runs(std::slice::from_ref(&run_id)).await;
    // A poll: the serve that crashes next dispatches the step on its loops.
    let stamp = env.dispatched_stamp(&run_id, 0).await;
    serve.stop().await;
    env.send_success(&run_id, stamp).await;
    let deadline: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT deadline FROM run_attempts WHERE stamp = $1")
            .bind(stamp)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    // The step's clock runs out with the result still unread.
    let left = (deadline - chrono::Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(100)).await;
    let options = ductor::outbox::frontier::FrontierOptions {
        kafka: env.config.kafka.clone(),
        group_id: env.config.kafka.group_id.clone(),
        topic: env.config.topic_names().attempt_results(),
        interval: Duration::from_millis(env.config.drainer.results_frontier_interval_ms),
        lag: Duration::from_millis(env.config.drainer.results_frontier_lag_ms),
    };
    let covered =
        tokio::task::spawn_blocking(move || ductor::outbox::frontier::probe_once(&options))
            .await
            .unwrap()
            .expect("probing the frontier");
    assert!(
        covered.is_none_or(|at| at < deadline.timestamp_millis()),
        "the unread result holds the frontier before the deadline: {covered:?}"
    );
    let frontier = ductor::outbox::frontier::Frontier::tracked();
    if let Some(at) = covered {
        frontier.advance(at);
    }
    let drainer = env.drainer().with_results_frontier(frontier);
    drainer.drain_once().await.expect("a drain round");
    let timer: String = sqlx::query_scalar(
        "SELECT status FROM eec_effect_intent WHERE run_id = $1 AND cancel_key IS NOT NULL",
    )
    .bind(&run_id)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(timer, "pending", "the timeout is held past its deadline");

    // The serve comes back; a worker answers the later steps.
    env.serve_until_it_succeeds_on_time(&run_id).await;
    env.db.drop_db().await;
}

/// Reads `consumer` until a message keyed by `run_id` arrives; `None` after
/// `timeout`.
async fn effect_for(
    consumer: &rdkafka::consumer::StreamConsumer,
    run_id: &str,
    timeout: Duration,
) -> Option<OwnedMessage> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let message = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .ok()?;
        let message = common::on_contract(message.expect("reading the steps topic").detach());
        if message.key() == Some(run_id.as_bytes()) {
            return Some(message);
        }
    }
}

/// Starts a run of "flow" the way `ductor submit` does, in a writer with no
/// drainer of its own; returns its run id.
async fn submit_run(config: &Config) -> String {
    let args = ductor::cli::commands::SubmitArgs {
        workflow: "flow".into(),
        input: "{}".into(),
        tenant: "acme".into(),
        pool: "default".into(),
        workflow_version: None,
        idempotency_key: None,
    };
    let decision = ductor::cli::commands::submit(args, config)
        .await
        .expect("submitting a run");
    decision["run_id"].as_str().expect("a run id").to_string()
}

#[tokio::test]
async fn writers_without_a_drainer_wake_the_drainer_by_notify() {
    // With a ten-minute poll, only the commit's NOTIFY can explain a
    // publish within the test's time.
    const NOTIFIED: Duration = Duration::from_secs(30);
    let env = Env::new("max_attempts = 1", 60_000, |c| {
        c.drainer.poll_interval_ms = 600_000
    })
    .await;
    let steps = env.config.topic_names().steps("p");
    let consumer = reader(&[&steps]);
    // A run committed before the drainer starts: its dispatch tells that
    // the drainer's first rounds have run and found everything there was.
    let before = submit_run(&env.config).await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(ductor::outbox::run(
        env.drainer(),
        Wakeup::default(),
        shutdown.clone(),
    ));
    let drainer = Task { shutdown, task };
    // A poll: the drainer's loop and its LISTEN, woken by commits of other
    // processes, are the subject.
    eventually("the drainer listens", WAIT, || async {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
        )
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        (listening > 0).then_some(())
    })
    .await;
    assert!(
        effect_for(&consumer, &before, WAIT).await.is_some(),
        "the drainer's first round publishes what was there"
    );

    // `ductor submit` commits the run and its first dispatch itself.
    let submitted = submit_run(&env.config).await;
    assert!(
        effect_for(&consumer, &submitted, NOTIFIED).await.is_some(),
        "a run submitted by `ductor submit` was not published within {NOTIFIED:?}"
    );

    // `ductor outbox redrive` puts a parked dispatch back from outside
    // every drainer: park the one just published, as a permanent publish
    // failure would have, and redrive it.
    let parked = sqlx::query(
        "UPDATE eec_effect_intent SET status = 'parked', parked_at = now(), \
             completed_at = NULL, claimed_by = NULL, claim_expires_at = NULL \
         WHERE run_id = $1 AND topic = $2",
    )
    .bind(&submitted)
    .bind(&steps)
    .execute(&env.db.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(parked, 1);
    let redriven = ductor::cli::commands::redrive(&env.config, Some(&submitted), None)
        .await
        .expect("redriving");
    assert_eq!(redriven, 1);
    assert!(
        effect_for(&consumer, &submitted, NOTIFIED).await.is_some(),
        "a dispatch redriven by `ductor outbox redrive` was not published again within {NOTIFIED:?}"
    );

    // The HTTP API of a `serve` without a drainer commits its starts itself.
    let mut config = env.config.clone();
    config.drainer.enabled = false;
    let serve = Running::start(&config).await;
    let addr = serve.addr;
    let token = api_key(&env.db, "acme", &[ductor::auth::Scope::RunsWrite]).await;
    let auth = bearer(&token);
    let headers = [
        (auth.0, auth.1.as_str()),
        ("Content-Type", "application/json"),
    ];
    let body = json!({"workflow": "flow", "input": {}}).to_string();
    let (status, body) = http(addr, "POST", "/v1/runs", &headers, body.as_bytes()).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let started = answer["run_id"].as_str().expect("a run id");
    assert!(
        effect_for(&consumer, started, NOTIFIED).await.is_some(),
        "a run started through the API of a serve without a drainer was not published within {NOTIFIED:?}"
    );

    serve.stop().await;
    drainer.stop().await;
    env.db.drop_db().await;
}
