//! The coordinator against the real Kafka broker and Postgres: inputs on the
//! input topics become exactly-once run state; duplicates and redeliveries
//! write zero rows; bad inputs go to the dead-letter topic without blocking
//! the good ones behind them.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ductor::apply::{Holds, InputOutcome, PendingInput};
use ductor::config::Config;
use ductor::contract::{InputLimits, InputTopic, decode_input};
use ductor::infra::crash::{CrashHooks, CrashPoint};
use ductor::ingress::{IngressContext, Progress};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::FutureProducer;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

struct Harness {
    db: TestDb,
    config: Config,
    producer: FutureProducer,
}

struct Coordinator {
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    /// What this instance has handled, read while it runs.
    progress: Arc<Progress>,
}

impl Coordinator {
    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await.expect("ingress task panicked")
    }
}

impl Harness {
    async fn new() -> Harness {
        Self::with_config(|_| {}).await
    }

    async fn with_config(tweak: impl FnOnce(&mut Config)) -> Harness {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        Harness {
            db,
            config,
            producer: producer(),
        }
    }

    fn ingress(&self, crash: CrashHooks) -> IngressContext {
        let workflows = ductor::infra::workflows::load_dir(&self.config.coordinator.workflows_dir)
            .expect("loading workflows");
        let mut ctx = IngressContext::new(&self.config, self.db.pool.clone(), workflows)
            .expect("creating ingress");
        ctx.crash = crash;
        ctx
    }

    fn start_coordinator(&self, crash: CrashHooks) -> Coordinator {
        let ctx = self.ingress(crash);
        let progress = ctx.progress.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::ingress::run(ctx, shutdown.clone()));
        Coordinator {
            shutdown,
            task,
            progress,
        }
    }

    /// An ingress subscribed to the input topics, for the test to drive
    /// with [`step_through`] instead of a running loop.
    fn stepped_ingress(&self, crash: CrashHooks) -> IngressContext {
        let ctx = self.ingress(crash);
        ductor::ingress::subscribe(&ctx).expect("subscribing the ingress");
        ctx
    }

    /// The stamp of the run's dispatched attempt for `step_index`, which
    /// a batch applied already has committed.
    async fn attempt_stamp(&self, run_id: &str, step_index: i32) -> uuid::Uuid {
        dispatched_attempt(&self.db.pool, run_id, step_index)
            .await
            .unwrap_or_else(|| panic!("run {run_id} has no dispatched attempt {step_index}"))
    }

    /// Sends a probe to every partition of the requests and
    /// attempt-results topics, round after round, until both instances have
    /// handled a batch: then both are members of the group, each owning
    /// partitions of the topics the runs use. A probe on requests starts a
    /// probe run; one on attempt-results is a result for no run, which is
    /// dead-lettered. Returns once every probe run is applied, with their
    /// ids.
    async fn probe_until_both_handle(&self, a: &Coordinator, b: &Coordinator) -> Vec<String> {
        let names = self.config.topic_names();
        let requests = names.requests();
        let results = names.attempt_results();
        let topics = [
            (&requests, self.partitions(&requests)),
            (&results, self.partitions(&results)),
        ];
        let mut probes = Vec::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        while a.progress.batches_handled() == 0 || b.progress.batches_handled() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "both instances did not handle a batch within {WAIT:?}"
            );
            for (topic, partitions) in topics {
                for partition in 0..partitions {
                    let run_id = unique("probe-");
                    if topic == &requests {
                        self.send_to(topic, partition, &run_id, &start_json(&run_id))
                            .await;
                        probes.push(run_id);
                    } else {
                        let stamp = uuid::Uuid::new_v4();
                        let result = Harness::result_json(&run_id, "acme", stamp);
                        self.send_to(topic, partition, &run_id, &result).await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // Every probe run is one transition; wait for the last of them, so
        // that what the instances apply from now on is the test's traffic.
        let applied = || a.progress.inputs_applied() + b.progress.inputs_applied();
        eventually("every probe run applied", WAIT, || async {
            (applied() == probes.len() as u64).then_some(())
        })
        .await;
        probes
    }

    /// Produces `value` to one partition of `topic`, whatever its key.
    async fn send_to(&self, topic: &str, partition: i32, key: &str, value: &serde_json::Value) {
        let payload = value.to_string();
        let record = rdkafka::producer::FutureRecord::to(topic)
            .partition(partition)
            .key(key)
            .payload(&payload);
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("producing to a partition");
    }

    /// How many partitions `topic` has, as the broker tells.
    fn partitions(&self, topic: &str) -> i32 {
        use rdkafka::producer::Producer;
        let metadata = self
            .producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("fetching topic metadata");
        metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map_or(0, |t| {
                i32::try_from(t.partitions().len()).expect("a partition count")
            })
    }

    async fn send(&self, topic: &str, key: &str, value: &serde_json::Value) -> (i32, i64) {
        produce(
            &self.producer,
            topic,
            key,
            value.to_string().as_bytes(),
            &[],
        )
        .await
    }

    async fn start_run(&self, run_id: &str, tenant: &str) -> (i32, i64) {
        self.send(
            &self.config.topic_names().requests(),
            run_id,
            &json!({
                "type": "run.start", "schema_version": 1, "run_id": run_id,
                "tenant": tenant, "workflow": "example", "input": {"order": run_id},
            }),
        )
        .await
    }

    fn result_json(run_id: &str, tenant: &str, stamp: uuid::Uuid) -> serde_json::Value {
        json!({
            "type": "attempt.result", "schema_version": 1, "run_id": run_id,
            "tenant": tenant, "stamp": stamp, "outcome": "succeeded",
            "output": {"done_by": stamp},
        })
    }

    /// Waits until the run has a dispatched attempt for `step_index`.
    async fn dispatched_stamp(&self, run_id: &str, step_index: i32) -> uuid::Uuid {
        let pool = self.db.pool.clone();
        eventually(
            &format!("run {run_id} step {step_index} dispatched"),
            WAIT,
            || {
                let pool = pool.clone();
                async move {
                    sqlx::query_scalar::<_, uuid::Uuid>(
                        "SELECT stamp FROM run_attempts \
                         WHERE run_id = $1 AND step_index = $2 AND status = 'dispatched'",
                    )
                    .bind(run_id)
                    .bind(step_index)
                    .fetch_optional(&pool)
                    .await
                    .expect("querying attempts")
                }
            },
        )
        .await
    }

    async fn run_status(&self, run_id: &str) -> Option<String> {
        sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(&self.db.pool)
            .await
            .expect("querying run")
    }

    async fn wait_status(&self, run_id: &str, status: &str) {
        eventually(&format!("run {run_id} {status}"), WAIT, || async {
            (self.run_status(run_id).await.as_deref() == Some(status)).then_some(())
        })
        .await
    }

    /// Waits until the coordinator group has committed an offset past
    /// `offset` on the partition: every message up to it is fully handled.
    async fn wait_committed_past(&self, topic: &str, partition: i32, offset: i64) {
        let group = self.config.kafka.group_id.clone();
        let topic = topic.to_string();
        eventually(
            &format!("group offset on {topic}/{partition} past {offset}"),
            WAIT,
            || {
                let group = group.clone();
                let topic = topic.clone();
                async move {
                    let committed = tokio::task::spawn_blocking(move || {
                        committed_offset(&group, &topic, partition)
                    })
                    .await
                    .expect("offset probe task");
                    (committed > offset).then_some(())
                }
            },
        )
        .await
    }

    /// Row counts of every table, and the sum of record versions.
    async fn footprint(&self) -> BTreeMap<&'static str, i64> {
        let mut out = BTreeMap::new();
        for table in [
            "runs",
            "run_transitions",
            "run_attempts",
            "eec_effect_intent",
            "eec_routing_idempotency",
        ] {
            out.insert(table, self.db.count(table).await);
        }
        let versions: i64 =
            sqlx::query_scalar("SELECT COALESCE(sum(record_version), 0)::int8 FROM runs")
                .fetch_one(&self.db.pool)
                .await
                .unwrap();
        out.insert("sum(record_version)", versions);
        out
    }

    async fn transitions(&self, run_id: &str) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT seq, input_ref FROM run_transitions WHERE run_id = $1 ORDER BY seq")
            .bind(run_id)
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    /// The seqs of a run's transitions, in order.
    async fn seqs(&self, run_id: &str) -> Vec<i64> {
        self.transitions(run_id)
            .await
            .into_iter()
            .map(|(seq, _)| seq)
            .collect()
    }

    /// Two appliers on the test database, as two coordinators (one of them
    /// a new owner after a rebalance) would hold them.
    fn two_appliers(&self) -> (ductor::apply::Applier, ductor::apply::Applier) {
        let workflows = ductor::infra::workflows::load_dir(&self.config.coordinator.workflows_dir)
            .expect("loading workflows");
        (
            ductor::apply::Applier::new(&self.config, self.db.pool.clone(), workflows.clone()),
            ductor::apply::Applier::new(&self.config, self.db.pool.clone(), workflows),
        )
    }
}

/// An input as the ingress would hand it to the apply layer.
fn pending(topic: InputTopic, value: serde_json::Value) -> PendingInput {
    PendingInput {
        input: decode_input(
            topic,
            value.to_string().as_bytes(),
            &InputLimits::sized(1 << 20),
        )
        .expect("a valid input"),
        source: None,
        trace: None,
    }
}

/// Applies a lone start of `run_id` on `applier`, as one batch.
async fn apply_start(
    applier: &ductor::apply::Applier,
    run_id: &str,
    what: &str,
) -> ductor::apply::BatchReport {
    applier
        .apply_batch(&[pending(InputTopic::Requests, start_json(run_id))])
        .await
        .expect(what)
}

/// A start of the `example` workflow for tenant `acme`.
fn start_json(run_id: &str) -> serde_json::Value {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "input": {"order": run_id},
    })
}

#[tokio::test]
async fn a_run_driven_by_kafka_inputs_succeeds_with_one_transition_per_input() {
    let h = Harness::new().await;
    let coordinator = h.start_coordinator(CrashHooks::default());
    let run_id = unique("run-");
    h.start_run(&run_id, "acme").await;
    let names = h.config.topic_names();
    for step in 0..3 {
        let stamp = h.dispatched_stamp(&run_id, step).await;
        h.send(
            &names.attempt_results(),
            &run_id,
            &Harness::result_json(&run_id, "acme", stamp),
        )
        .await;
    }
    h.wait_status(&run_id, "succeeded").await;

    let transitions = h.transitions(&run_id).await;
    let seqs: Vec<i64> = transitions.iter().map(|t| t.0).collect();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 4],
        "start + three results, gap-free: {transitions:?}"
    );
    assert_eq!(transitions[0].1, "start");
    assert!(transitions[1..].iter().all(|t| t.1.starts_with("result:")));

    let run = ductor::cli::inspect::run(&h.db.pool, &run_id)
        .await
        .unwrap()
        .expect("inspect finds the run");
    assert_eq!(run["status"], "succeeded");
    assert_eq!(run["last_transition_seq"], 4);
    assert_eq!(run["transitions"].as_array().unwrap().len(), 4);
    assert_eq!(run["attempts"].as_array().unwrap().len(), 3);
    assert!(
        run["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["status"] == "succeeded")
    );
    // Every effect was written to the outbox with its idempotency key.
    let intents: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, topic FROM eec_effect_intent WHERE run_id = $1 ORDER BY seq, effect_index",
    )
    .bind(&run_id)
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert!(intents.iter().any(|(_, t)| *t == names.steps("default")));
    assert!(intents.iter().any(|(_, t)| *t == names.events()));
    assert!(intents.iter().any(|(k, _)| k == &format!("{run_id}/4/0")));
    coordinator.stop().await.expect("clean stop");
    h.db.drop_db().await;
}

#[tokio::test]
async fn the_same_attempt_result_three_times_writes_no_new_rows() {
    let h = Harness::new().await;
    let ingress = h.stepped_ingress(CrashHooks::default());
    let run_id = unique("run-");
    let names = h.config.topic_names();
    let requests = names.requests();
    let (start_partition, start_offset) = h.start_run(&run_id, "acme").await;
    let started = step_through(
        &ingress,
        &requests,
        &[(start_partition, start_offset)],
        WAIT,
    )
    .await;
    assert_eq!((started.messages, started.applied), (1, 1), "{started:?}");
    let stamp = h.attempt_stamp(&run_id, 0).await;
    let result = Harness::result_json(&run_id, "acme", stamp);
    let topic = names.attempt_results();
    let (partition, first) = h.send(&topic, &run_id, &result).await;
    let once = step_through(&ingress, &topic, &[(partition, first)], WAIT).await;
    assert_eq!(
        (once.messages, once.applied, once.no_ops),
        (1, 1, 0),
        "the first copy applies: {once:?}"
    );
    let after_once = h.footprint().await;
    assert_eq!(h.transitions(&run_id).await.len(), 2);

    h.send(&topic, &run_id, &result).await;
    let (_, third) = h.send(&topic, &run_id, &result).await;
    let twice = step_through(&ingress, &topic, &[(partition, third)], WAIT).await;
    assert_eq!(
        (
            twice.messages,
            twice.applied,
            twice.no_ops,
            twice.dead_lettered()
        ),
        (2, 0, 2, 0),
        "both copies are no-ops: {twice:?}"
    );
    let after_thrice = h.footprint().await;
    assert_eq!(
        after_once, after_thrice,
        "duplicates must not write a single row"
    );
    assert_eq!(h.transitions(&run_id).await.len(), 2);
    // The offsets the steps stored are the group's once it leaves.
    ductor::ingress::close(&ingress);
    assert!(committed_offset(&h.config.kafka.group_id, &topic, partition) > third);
    drop(ingress);
    h.db.drop_db().await;
}

#[tokio::test]
async fn two_coordinators_in_one_group_never_double_apply() {
    let h = Harness::new().await;
    let names = h.config.topic_names();
    let requests = names.requests();
    let results_topic = names.attempt_results();
    for topic in [&requests, &results_topic] {
        assert!(
            h.partitions(topic) >= 2,
            "{topic}: two members need two partitions to share"
        );
    }
    let first = h.start_coordinator(CrashHooks::default());
    let second = h.start_coordinator(CrashHooks::default());
    let probes = h.probe_until_both_handle(&first, &second).await;
    let applied_before = [&first, &second].map(|c| c.progress.inputs_applied());
    let runs: Vec<String> = (0..24)
        .map(|i| format!("{}-{i}", unique("multi-")))
        .collect();
    for run_id in &runs {
        h.start_run(run_id, "acme").await;
    }
    let mut stopped_first = Some(first);
    for step in 0..3 {
        for run_id in &runs {
            let stamp = h.dispatched_stamp(run_id, step).await;
            let result = Harness::result_json(run_id, "acme", stamp);
            // Every result twice: the second copy must be a no-op.
            h.send(&results_topic, run_id, &result).await;
            h.send(&results_topic, run_id, &result).await;
        }
        if step == 1 {
            // One instance leaves mid-way: its partitions move to the other.
            if let Some(c) = stopped_first.take() {
                // Until now both shared the runs: each applied some of them.
                let applied = [&c, &second].map(|c| c.progress.inputs_applied());
                assert!(
                    applied[0] > applied_before[0] && applied[1] > applied_before[1],
                    "both instances apply while both are members: {applied_before:?} then {applied:?}"
                );
                c.stop().await.expect("first coordinator stops cleanly");
            }
        }
    }
    for run_id in &runs {
        h.wait_status(run_id, "succeeded").await;
        let seqs: Vec<i64> = h.transitions(run_id).await.iter().map(|t| t.0).collect();
        assert_eq!(seqs, vec![1, 2, 3, 4], "run {run_id}");
    }
    let mut versions: HashMap<String, i64> =
        sqlx::query_as("SELECT run_id, last_transition_seq FROM runs")
            .fetch_all(&h.db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    for probe in &probes {
        assert_eq!(versions.remove(probe), Some(1), "probe {probe}");
    }
    assert_eq!(versions.len(), runs.len());
    assert!(versions.values().all(|seq| *seq == 4));
    second.stop().await.expect("clean stop");
    h.db.drop_db().await;
}

#[tokio::test]
async fn a_coordinator_stopped_after_commit_before_offsets_gets_redeliveries_that_write_nothing() {
    let h = Harness::new().await;
    let mut crash = CrashHooks::default();
    crash.arm(CrashPoint::IngressAfterCommit);
    let crashing = h.stepped_ingress(crash);
    let run_id = unique("crash-");
    let topic = h.config.topic_names().requests();
    let (partition, offset) = h.start_run(&run_id, "acme").await;
    let shutdown = CancellationToken::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let err = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the start was not read within {WAIT:?}"
        );
        match ductor::ingress::step(&crashing, INGRESS_STEP_WAIT, &shutdown).await {
            Ok(None) => {}
            Ok(Some(report)) => panic!("the hook lets no batch through: {report:?}"),
            Err(e) => break e,
        }
    };
    assert!(err.to_string().contains("after commit"), "{err:#}");
    // Leaves the group as the loop does when it fails.
    ductor::ingress::close(&crashing);
    drop(crashing);
    assert_eq!(h.run_status(&run_id).await.as_deref(), Some("running"));
    assert!(
        committed_offset(&h.config.kafka.group_id, &topic, partition) <= offset,
        "the offset of the applied message was not committed"
    );
    let before = h.footprint().await;

    let restarted = h.stepped_ingress(CrashHooks::default());
    let redelivered = step_through(&restarted, &topic, &[(partition, offset)], WAIT).await;
    assert_eq!(
        (
            redelivered.applied,
            redelivered.no_ops,
            redelivered.dead_lettered()
        ),
        (0, 1, 0),
        "the redelivered start is a duplicate: {redelivered:?}"
    );
    assert_eq!(
        before,
        h.footprint().await,
        "the redelivered start wrote rows"
    );
    assert_eq!(h.transitions(&run_id).await.len(), 1);
    ductor::ingress::close(&restarted);
    assert!(
        committed_offset(&h.config.kafka.group_id, &topic, partition) > offset,
        "the redelivery's offset is committed"
    );
    drop(restarted);
    h.db.drop_db().await;
}

#[tokio::test]
async fn bad_inputs_go_to_the_dead_letter_topic_and_good_ones_behind_them_apply() {
    // One apply lane: the serial ingress (the other tests run the default
    // of several lanes).
    let h = Harness::with_config(|c| {
        c.coordinator.max_input_bytes = 4096;
        c.coordinator.apply_lanes = 1;
    })
    .await;
    let coordinator = h.start_coordinator(CrashHooks::default());
    let names = h.config.topic_names();
    let requests = names.requests();
    let wakeups = names.wakeups();
    // One key, so every message lands on one partition, bad ones first;
    // the runs named are on that partition too (murmur2 of their ids).
    let key = unique("same-partition-");
    let partitions = h.config.kafka.partitions;
    let good_run = id_beside(&key, "good-", partitions);
    let start = |run_id: &str, tenant: &str, workflow: &str| {
        json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
               "tenant": tenant, "workflow": workflow})
    };
    let oversized = json!({"type": "run.start", "schema_version": 1, "run_id": "big",
        "tenant": "acme", "workflow": "example", "input": "x".repeat(5000)});
    let bad: Vec<(&str, Vec<u8>)> = vec![
        ("malformed", b"{not json".to_vec()),
        (
            "unknown_type",
            json!({"type": "run.explode", "schema_version": 1})
                .to_string()
                .into_bytes(),
        ),
        (
            "unsupported_version",
            json!({"type": "run.start", "schema_version": 99, "run_id": "v",
                   "tenant": "acme", "workflow": "example"})
            .to_string()
            .into_bytes(),
        ),
        (
            "invalid",
            json!({"type": "run.start", "schema_version": 1, "run_id": "no-workflow", "tenant": "acme"})
                .to_string()
                .into_bytes(),
        ),
        (
            "invalid",
            json!({"type": "run.start", "schema_version": 1, "run_id": 42,
                   "tenant": "acme", "workflow": "example"})
            .to_string()
            .into_bytes(),
        ),
        (
            "wrong_topic",
            json!({"type": "wakeup.signal", "schema_version": 1, "run_id": "r", "tenant": "acme",
                   "signal_id": "s1", "name": "poke"})
            .to_string()
            .into_bytes(),
        ),
        ("too_large", oversized.to_string().into_bytes()),
        (
            "unknown_workflow",
            start(&id_beside(&key, "nowf-", partitions), "acme", "no-such-workflow")
                .to_string()
                .into_bytes(),
        ),
    ];
    let mut expected: Vec<(String, i64, &str)> = Vec::new();
    for (class, payload) in &bad {
        let (_, offset) = produce(&h.producer, &requests, &key, payload, &[("trace", "t-1")]).await;
        expected.push((requests.clone(), offset, class));
    }
    let (_, good_offset) = produce(
        &h.producer,
        &requests,
        &key,
        start(&good_run, "acme", "example").to_string().as_bytes(),
        &[],
    )
    .await;
    h.wait_status(&good_run, "running").await;

    // Inputs that decode but name a run that does not exist, or the wrong
    // tenant, are rejected by the coordinator.
    for (class, payload) in [
        (
            "unknown_run",
            json!({"type": "wakeup.signal", "schema_version": 1, "run_id": id_beside(&key, "ghost-", partitions),
                   "tenant": "acme", "signal_id": "s1", "name": "poke"}),
        ),
        (
            "tenant_mismatch",
            json!({"type": "wakeup.signal", "schema_version": 1, "run_id": good_run,
                   "tenant": "intruder", "signal_id": "s1", "name": "poke"}),
        ),
    ] {
        let (_, offset) = produce(
            &h.producer,
            &wakeups,
            &key,
            payload.to_string().as_bytes(),
            &[("trace", "t-1")],
        )
        .await;
        expected.push((wakeups.clone(), offset, class));
    }
    let (wake_partition, good_signal_offset) = produce(
        &h.producer,
        &wakeups,
        &key,
        json!({"type": "wakeup.signal", "schema_version": 1, "run_id": good_run,
               "tenant": "acme", "signal_id": "s1", "name": "poke"})
        .to_string()
        .as_bytes(),
        &[],
    )
    .await;
    h.wait_committed_past(&wakeups, wake_partition, good_signal_offset)
        .await;

    let dlq = reader(&[&names.dead_letters()]);
    let letters = read_n(&dlq, expected.len(), WAIT).await;
    let header = |m: &rdkafka::message::OwnedMessage, name: &str| {
        m.headers()
            .and_then(|hs| hs.iter().find(|x| x.key == name).and_then(|x| x.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    for (topic, offset, class) in &expected {
        let letter = letters
            .iter()
            .find(|m| {
                header(m, "ductor-dlq-topic").as_deref() == Some(topic.as_str())
                    && header(m, "ductor-dlq-offset") == Some(offset.to_string())
            })
            .unwrap_or_else(|| panic!("no dead letter for {topic}@{offset} ({class})"));
        assert_eq!(
            header(letter, "ductor-dlq-error-class").as_deref(),
            Some(*class),
            "{topic}@{offset}"
        );
        assert!(header(letter, "ductor-dlq-partition").is_some());
        let stage = header(letter, "ductor-dlq-stage").unwrap();
        assert!(stage == "decode" || stage == "validate", "{stage}");
        let message = header(letter, "ductor-dlq-error").unwrap();
        assert!(!message.is_empty() && message.len() <= 512, "{message}");
        assert!(
            !message.contains(&"x".repeat(100)),
            "the error does not echo the payload"
        );
        assert_eq!(
            header(letter, "trace").as_deref(),
            Some("t-1"),
            "original headers kept"
        );
        assert_eq!(letter.key(), Some(key.as_bytes()), "original key kept");
    }
    // The original value is kept byte for byte.
    let malformed = letters
        .iter()
        .find(|m| header(m, "ductor-dlq-offset") == Some(expected[0].1.to_string()))
        .unwrap();
    assert_eq!(malformed.payload(), Some(&b"{not json"[..]));

    // The good messages behind the bad ones were applied.
    let transitions = h.transitions(&good_run).await;
    assert_eq!(
        transitions.iter().map(|t| t.1.as_str()).collect::<Vec<_>>(),
        vec!["start", "signal:s1"]
    );
    assert!(good_offset > expected[0].1);
    coordinator.stop().await.expect("clean stop");
    h.db.drop_db().await;
}

#[tokio::test]
async fn a_cached_state_made_stale_by_another_writer_never_decides_an_input() {
    let h = Harness::new().await;
    // Two appliers on one database: `a` caches what it commits, `b` moves
    // the run on behind its back (as a new owner after a rebalance would).
    let (a, b) = h.two_appliers();
    let run_id = unique("cached-");
    let report = apply_start(&a, &run_id, "applying the start").await;
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 1 }]);

    let first = h.dispatched_stamp(&run_id, 0).await;
    let first_result = Harness::result_json(&run_id, "acme", first);
    let report = b
        .apply_batch(&[pending(InputTopic::AttemptResults, first_result.clone())])
        .await
        .expect("applying the first result elsewhere");
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 2 }]);

    // `a` still holds the run at seq 1, which knows nothing of the second
    // attempt: its result must be applied all the same, not rejected.
    let second = h.dispatched_stamp(&run_id, 1).await;
    let report = a
        .apply_batch(&[pending(
            InputTopic::AttemptResults,
            Harness::result_json(&run_id, "acme", second),
        )])
        .await
        .expect("applying the second result");
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 3 }]);

    // And the first result again is a duplicate there too.
    let report = a
        .apply_batch(&[pending(InputTopic::AttemptResults, first_result)])
        .await
        .expect("applying a duplicate");
    assert!(
        matches!(report.outcomes[..], [InputOutcome::NoOp(_)]),
        "{:?}",
        report.outcomes
    );
    assert_eq!(h.transitions(&run_id).await.len(), 3);
    h.db.drop_db().await;
}

#[tokio::test]
async fn a_start_redelivered_to_an_applier_that_never_saw_its_run_is_a_duplicate() {
    let h = Harness::new().await;
    // `a` takes a start it has not cached for a new run, without reading the
    // database. `b` never saw the run, so it makes the same guess on a
    // redelivery: its insert must fall short, and the recomputation from
    // the database must find the start a duplicate that writes nothing.
    let (a, b) = h.two_appliers();
    let run_id = unique("guessed-");
    let report = apply_start(&a, &run_id, "applying the start").await;
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 1 }]);
    assert_eq!(report.conflicts, 0, "a new run needs no recomputation");
    let before = h.footprint().await;

    let report = apply_start(&b, &run_id, "applying the redelivered start").await;
    assert!(
        matches!(report.outcomes[..], [InputOutcome::NoOp(_)]),
        "{:?}",
        report.outcomes
    );
    assert_eq!(
        report.conflicts, 1,
        "the guess that the run is new loses once"
    );
    assert_eq!(h.footprint().await, before, "the duplicate wrote rows");

    // A result of the run in the same batch as a second redelivery makes
    // `b` read the run instead of guessing: the start is a duplicate and
    // the result applies, with no recomputation.
    let stamp = h.dispatched_stamp(&run_id, 0).await;
    let report = b
        .apply_batch(&[
            pending(InputTopic::Requests, start_json(&run_id)),
            pending(
                InputTopic::AttemptResults,
                Harness::result_json(&run_id, "acme", stamp),
            ),
        ])
        .await
        .expect("applying a start and a result");
    assert!(
        matches!(
            report.outcomes[..],
            [InputOutcome::NoOp(_), InputOutcome::Applied { seq: 2 }]
        ),
        "{:?}",
        report.outcomes
    );
    assert_eq!(report.conflicts, 0);
    assert_eq!(h.seqs(&run_id).await, vec![1, 2]);
    h.db.drop_db().await;
}

#[tokio::test]
async fn without_the_run_cache_a_redelivered_start_is_read_not_guessed() {
    let h = Harness::with_config(|c| c.coordinator.run_cache_size = 0).await;
    let (a, b) = h.two_appliers();
    let run_id = unique("uncached-");
    apply_start(&a, &run_id, "applying the start").await;
    let before = h.footprint().await;
    let report = apply_start(&b, &run_id, "applying the redelivered start").await;
    assert!(
        matches!(report.outcomes[..], [InputOutcome::NoOp(_)]),
        "{:?}",
        report.outcomes
    );
    assert_eq!(
        report.conflicts, 0,
        "the run was read, so nothing is retried"
    );
    assert_eq!(h.footprint().await, before);
    h.db.drop_db().await;
}

#[tokio::test]
async fn a_batch_written_over_a_run_another_writer_moved_on_is_recomputed_once() {
    let h = Harness::new().await;
    // `a` caches the run at seq 1; `b` moves it to seq 2. A cancel applies to
    // either state, so `a` folds it on its stale copy and writes: the batch
    // statement must fall short on `record_version`, roll back whole, and be
    // recomputed from the database.
    let (a, b) = h.two_appliers();
    let run_id = unique("raced-");
    apply_start(&a, &run_id, "applying the start").await;
    let first = h.dispatched_stamp(&run_id, 0).await;
    let report = b
        .apply_batch(&[pending(
            InputTopic::AttemptResults,
            Harness::result_json(&run_id, "acme", first),
        )])
        .await
        .expect("applying the first result elsewhere");
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 2 }]);

    let cancel = json!({
        "type": "wakeup.cancel", "schema_version": 1, "run_id": run_id, "tenant": "acme",
    });
    let report = a
        .apply_batch(&[pending(InputTopic::Wakeups, cancel)])
        .await
        .expect("applying the cancel");
    assert_eq!(
        report.conflicts, 1,
        "the stale write must lose the race once"
    );
    assert_eq!(report.outcomes, vec![InputOutcome::Applied { seq: 3 }]);
    assert_eq!(
        h.seqs(&run_id).await,
        vec![1, 2, 3],
        "nothing of the lost attempt is kept"
    );
    assert_eq!(h.run_status(&run_id).await.as_deref(), Some("cancelled"));
    h.db.drop_db().await;
}

/// An input that decodes but that Postgres refuses (here U+0000, put past
/// the screen on purpose) fails its batch statement with a data exception.
/// The apply path bisects: the input that fails alone is reported with its
/// class, everything around it commits, in order.
#[tokio::test]
async fn a_batch_with_an_input_postgres_refuses_commits_the_rest_and_isolates_it() {
    let h = Harness::new().await;
    let (applier, _) = h.two_appliers();
    let runs: Vec<String> = (0..6).map(|k| unique(&format!("iso-{k}-"))).collect();
    let mut inputs: Vec<PendingInput> = runs
        .iter()
        .map(|r| pending(InputTopic::Requests, start_json(r)))
        .collect();
    let poison = |run_id: &str, input: serde_json::Value| PendingInput {
        input: ductor::contract::Input::Start(ductor::contract::RunStart {
            run_id: run_id.to_string(),
            tenant: "acme".into(),
            workflow: "example".into(),
            workflow_version: None,
            pool: "default".into(),
            input,
            correlation_id: None,
            parent: None,
        }),
        source: None,
        trace: None,
    };
    let bad_a = unique("poison-a-");
    let bad_b = unique("poison-b-");
    inputs.insert(1, poison(&bad_a, json!({"note": "a\u{0}b"})));
    inputs.insert(5, poison(&bad_b, json!({"k\u{0}": 1})));
    // Before isolation, the same batch fails as a whole, every time.
    let whole = applier.apply_batch(&inputs).await.unwrap_err();
    assert_eq!(
        whole.permanent().map(|f| f.class),
        Some("data_exception"),
        "{whole}"
    );
    let retry = ductor::apply::RetryPolicy {
        min: Duration::from_millis(10),
        max: Duration::from_millis(100),
        bisect_after: 5,
    };
    let report = applier
        .apply_isolating(
            &inputs,
            &[],
            retry,
            &mut Holds::none(),
            &CancellationToken::new(),
        )
        .await
        .expect("an isolating apply ends");
    assert_eq!(report.outcomes.len(), inputs.len());
    for (k, outcome) in report.outcomes.iter().enumerate() {
        match k {
            1 | 5 => {
                let failure = outcome.as_ref().unwrap().as_ref().unwrap_err();
                assert_eq!(failure.class, "data_exception");
                assert!(failure.message.starts_with("postgres 22"), "{failure:?}");
            }
            _ => assert!(
                matches!(outcome, Some(Ok(InputOutcome::Applied { seq: 1 }))),
                "input {k}: {outcome:?}"
            ),
        }
    }
    assert!(report.statements > 1, "the batch was bisected");
    for run in &runs {
        assert_eq!(h.run_status(run).await.as_deref(), Some("running"), "{run}");
    }
    assert_eq!(h.run_status(&bad_a).await, None);
    assert_eq!(h.run_status(&bad_b).await, None);
    assert_eq!(h.db.count("runs").await, runs.len() as i64);
    h.db.drop_db().await;
}

/// An input whose statement always times out (here its run's row is
/// locked by another session past `statement_timeout`) would hold its
/// batch, and so its lane, for as long as the lock lasts: retried as a
/// transient failure, for ever. After `bisect_after` such failures the
/// batch is bisected; the others commit, and the input that keeps
/// failing alone while the database answers is isolated with class
/// `transient_exhausted`.
#[tokio::test]
async fn an_input_whose_statement_always_times_out_is_isolated_and_the_rest_commit() {
    let h = Harness::new().await;
    let (setup, _) = h.two_appliers();
    let runs: Vec<String> = (0..6).map(|k| unique(&format!("slow-{k}-"))).collect();
    let starts: Vec<PendingInput> = runs
        .iter()
        .map(|r| pending(InputTopic::Requests, start_json(r)))
        .collect();
    setup.apply_batch(&starts).await.expect("starting the runs");
    let mut config = h.config.clone();
    config.database.statement_timeout_ms = 300;
    let pool = ductor::infra::db::connect(&config.database).await.unwrap();
    let workflows = ductor::infra::workflows::load_dir(&config.coordinator.workflows_dir).unwrap();
    let applier = ductor::apply::Applier::new(&config, pool, workflows);

    let locked = runs[2].clone();
    let mut holder = h.db.owner.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM runs WHERE run_id = $1 FOR UPDATE")
        .bind(&locked)
        .execute(&mut *holder)
        .await
        .unwrap();
    let cancels: Vec<PendingInput> = runs
        .iter()
        .map(|r| {
            pending(
                InputTopic::Wakeups,
                json!({"type": "wakeup.cancel", "schema_version": 1, "run_id": r, "tenant": "acme"}),
            )
        })
        .collect();
    let retry = ductor::apply::RetryPolicy {
        min: Duration::from_millis(10),
        max: Duration::from_millis(50),
        bisect_after: 3,
    };
    let report = tokio::time::timeout(
        WAIT,
        applier.apply_isolating(
            &cancels,
            &[],
            retry,
            &mut Holds::none(),
            &CancellationToken::new(),
        ),
    )
    .await
    .expect("the lane moves on while the lock is held")
    .expect("an isolating apply ends");
    for (k, outcome) in report.outcomes.iter().enumerate() {
        if k == 2 {
            let failure = outcome.as_ref().unwrap().as_ref().unwrap_err();
            assert_eq!(failure.class, "transient_exhausted", "{failure:?}");
            assert!(failure.message.contains("57014"), "{failure:?}");
        } else {
            assert!(
                matches!(outcome, Some(Ok(InputOutcome::Applied { .. }))),
                "input {k}: {outcome:?}"
            );
        }
    }
    holder.rollback().await.unwrap();
    for (k, run) in runs.iter().enumerate() {
        let want = if k == 2 { "running" } else { "cancelled" };
        assert_eq!(h.run_status(run).await.as_deref(), Some(want), "{run}");
    }
    h.db.drop_db().await;
}

/// The hostile inputs that once stopped a lane for good: each reaches the
/// dead-letter topic with its class, and the good starts behind them on
/// the same partition all apply.
#[tokio::test]
async fn hostile_json_on_kafka_is_dead_lettered_with_its_class_and_good_inputs_behind_it_apply() {
    let h = Harness::new().await;
    let coordinator = h.start_coordinator(CrashHooks::default());
    let names = h.config.topic_names();
    let requests = names.requests();
    let results = names.attempt_results();
    let key = unique("same-partition-");
    let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
    let start = |extra: &str| {
        format!(
            r#"{{"type": "run.start", "schema_version": 1, "run_id": "{}", "tenant": "acme", "workflow": "example"{extra}}}"#,
            unique("hostile-")
        )
    };
    let bad: Vec<(&str, String, String)> = vec![
        (
            "nul_character",
            requests.clone(),
            start(r#", "input": {"note": "a\u0000b"}"#),
        ),
        (
            "nul_character",
            requests.clone(),
            start(r#", "correlation_id": "c\u0000""#),
        ),
        (
            "unpaired_surrogate",
            requests.clone(),
            start(r#", "input": "\udc00""#),
        ),
        (
            "inexact_number",
            requests.clone(),
            start(r#", "input": 1e400"#),
        ),
        (
            "too_deep",
            requests.clone(),
            start(&format!(r#", "input": {deep}"#)),
        ),
        (
            "duplicate_key",
            requests.clone(),
            start(r#", "input": 1, "input": 2"#),
        ),
        (
            "nul_character",
            results.clone(),
            format!(
                r#"{{"type": "attempt.result", "schema_version": 1, "run_id": "r", "tenant": "acme", "stamp": "{}", "outcome": "failed", "error": {{"message": "boom\u0000", "retryable": true}}}}"#,
                uuid::Uuid::new_v4()
            ),
        ),
    ];
    let mut expected = Vec::new();
    for (class, topic, payload) in &bad {
        let (_, offset) = produce(&h.producer, topic, &key, payload.as_bytes(), &[]).await;
        expected.push((topic.clone(), offset, *class));
    }
    let good: Vec<String> = (0..20).map(|k| unique(&format!("good-{k}-"))).collect();
    for run in &good {
        produce(
            &h.producer,
            &requests,
            &key,
            start_json(run).to_string().as_bytes(),
            &[],
        )
        .await;
    }
    for run in &good {
        h.wait_status(run, "running").await;
    }
    let dlq = reader(&[&names.dead_letters()]);
    let letters = read_n(&dlq, expected.len(), WAIT).await;
    let header = |m: &rdkafka::message::OwnedMessage, name: &str| {
        m.headers()
            .and_then(|hs| hs.iter().find(|x| x.key == name).and_then(|x| x.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    for (topic, offset, class) in &expected {
        let letter = letters
            .iter()
            .find(|m| {
                header(m, "ductor-dlq-topic").as_deref() == Some(topic.as_str())
                    && header(m, "ductor-dlq-offset") == Some(offset.to_string())
            })
            .unwrap_or_else(|| panic!("no dead letter for {topic}@{offset} ({class})"));
        assert_eq!(
            header(letter, "ductor-dlq-error-class").as_deref(),
            Some(*class),
            "{topic}@{offset}"
        );
        assert_eq!(
            header(letter, "ductor-dlq-stage").as_deref(),
            Some("decode")
        );
    }
    assert_eq!(h.db.count("runs").await, good.len() as i64);
    coordinator.stop().await.expect("clean stop");
    h.db.drop_db().await;
}

/// An input the dead-letter topic cannot take whole even compressed (2 MiB
/// of random text, on a requests topic that takes 8 MiB) is dead-lettered
/// cut, with a header that says so, and recorded whole in Postgres; one
/// whose headers alone are over the topic's limit loses them on the topic
/// only; and the partition moves on. (A compressible one arrives whole:
/// tests/dead_letters.rs.)
#[tokio::test]
async fn an_input_too_large_to_dead_letter_whole_is_cut_to_fit_and_the_partition_moves_on() {
    use rand::Rng;
    let h = Harness::new().await;
    let names = h.config.topic_names();
    let requests = names.requests();
    set_topic_limit(&h.config.kafka, &requests, 8 << 20).await;
    let coordinator = h.start_coordinator(CrashHooks::default());
    let big_producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .set("compression.type", "lz4")
        .set("message.max.bytes", (8 << 20).to_string())
        .set("linger.ms", "0")
        .create()
        .expect("creating a compressing producer");
    let noise = |n: usize| -> String {
        rand::rng()
            .sample_iter(&rand::distr::Alphanumeric)
            .take(n)
            .map(char::from)
            .collect()
    };
    let key = unique("same-partition-");
    let value = json!({"type": "run.start", "schema_version": 1, "run_id": unique("big-"),
        "tenant": "acme", "workflow": "example", "input": noise(2 << 20)})
    .to_string();
    let (_, big_offset) = produce(&big_producer, &requests, &key, value.as_bytes(), &[]).await;
    let huge_header = noise(2 << 20);
    let (_, header_offset) = produce(
        &big_producer,
        &requests,
        &key,
        b"{}",
        &[("garbage", huge_header.as_str())],
    )
    .await;
    let good = unique("good-");
    produce(
        &h.producer,
        &requests,
        &key,
        start_json(&good).to_string().as_bytes(),
        &[],
    )
    .await;
    h.wait_status(&good, "running").await;
    let dlq = reader(&[&names.dead_letters()]);
    let letters = read_n(&dlq, 2, WAIT).await;
    let header = |m: &rdkafka::message::OwnedMessage, name: &str| {
        m.headers()
            .and_then(|hs| hs.iter().find(|x| x.key == name).and_then(|x| x.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let limit = h.config.kafka.message_max_bytes as usize;
    let of = |offset: i64| {
        letters
            .iter()
            .find(|m| header(m, "ductor-dlq-offset") == Some(offset.to_string()))
            .unwrap_or_else(|| panic!("no dead letter for offset {offset}"))
    };
    let big = of(big_offset);
    assert_eq!(
        header(big, "ductor-dlq-error-class").as_deref(),
        Some("too_large")
    );
    assert_eq!(
        header(big, "ductor-dlq-truncated"),
        Some(value.len().to_string())
    );
    let kept = big.payload().unwrap();
    assert!(
        kept.len() < limit && kept.len() > limit / 8,
        "{}",
        kept.len()
    );
    assert_eq!(
        kept,
        &value.as_bytes()[..kept.len()],
        "the value's start, as sent"
    );
    assert_eq!(big.key(), Some(key.as_bytes()));
    let headers_letter = of(header_offset);
    assert_eq!(
        header(headers_letter, "ductor-dlq-dropped").as_deref(),
        Some("headers")
    );
    assert_eq!(header(headers_letter, "garbage"), None);
    assert_eq!(headers_letter.payload(), Some(&b"{}"[..]));
    // The rows keep what the topic could not: the value and the headers.
    let recorded: Vec<(i64, i32, i32, i32)> = sqlx::query_as(
        "SELECT source_offset, length(value), value_bytes, jsonb_array_length(headers) \
         FROM dead_letters ORDER BY source_offset",
    )
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    let whole = value.len() as i32;
    assert_eq!(
        recorded,
        [(big_offset, whole, whole, 0), (header_offset, 2, 2, 1)]
    );
    assert_eq!(h.db.count("runs").await, 1);
    coordinator.stop().await.expect("clean stop");
    h.db.drop_db().await;
}
