//! The worker library against the real Kafka broker, and the consumer-side
//! dedup helper against the real Postgres: dispatches become exactly the
//! `attempt.result`s the coordinator decodes; offsets are stored only after
//! the result is acknowledged, never past an unfinished dispatch; a claimed
//! idempotency key commits with the effect or not at all.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use common::*;
use ductor::client::dedup::{self, Claim, ClaimError};
use ductor::client::worker::{StepDispatch, StepOutcome, WorkerOptions};
use ductor::config::Config;
use ductor::contract::effects::rfc3339;
use ductor::contract::{
    AttemptOutcome, AttemptResult, Input, InputLimits, InputTopic, decode_input,
};
use ductor::infra::crash::CrashPoint;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage, Timestamp};
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// A private topic prefix and group, and the worker options derived from them.
struct Harness {
    options: WorkerOptions,
    producer: FutureProducer,
}

struct RunningWorker {
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl RunningWorker {
    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await.expect("worker task panicked")
    }
}

impl Harness {
    /// Topics with `partitions` partitions; the expected names and group.
    async fn new(partitions: i32) -> Harness {
        let prefix: String = unique("w").chars().take(13).collect();
        let env = vec![
            ("KAFKA_BOOTSTRAP_SERVERS".to_string(), bootstrap_servers()),
            (
                "DUCTOR__KAFKA__TOPIC_PREFIX".to_string(),
                format!("{prefix}."),
            ),
            (
                "DUCTOR__KAFKA__GROUP_ID".to_string(),
                format!("{prefix}-coordinator"),
            ),
        ];
        let config = Config::load_from(None, env).expect("test configuration is valid");
        let options = WorkerOptions::from_config(&config, "default");
        assert_eq!(
            options.group_id,
            format!("{prefix}-coordinator-worker-default")
        );
        assert_eq!(options.steps_topic, format!("{prefix}.steps.default"));
        assert_eq!(options.results_topic, format!("{prefix}.attempt-results"));
        assert_eq!(options.max_in_flight, 32);
        ductor::infra::kafka::ensure_topics(
            &config.kafka,
            &[options.steps_topic.clone(), options.results_topic.clone()],
            partitions,
        )
        .await
        .expect("creating topics");
        Harness {
            options,
            producer: producer(),
        }
    }

    /// Deletes the harness' topics. Called at the end of a passing test; a
    /// failing one leaves them on the broker to be looked at.
    async fn finish(self) {
        delete_test_topics(&[
            self.options.steps_topic.clone(),
            self.options.results_topic.clone(),
        ])
        .await;
    }

    fn start<F, Fut>(&self, options: WorkerOptions, handler: F) -> RunningWorker
    where
        F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StepOutcome> + Send + 'static,
    {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ductor::client::worker::run(
            options,
            handler,
            shutdown.clone(),
        ));
        RunningWorker { shutdown, task }
    }

    async fn send_dispatch(&self, d: &Value) -> (i32, i64) {
        let run_id = d["run_id"].as_str().expect("dispatch has a run_id");
        self.send_raw(run_id, d.to_string().as_bytes()).await
    }

    async fn send_raw(&self, key: &str, payload: &[u8]) -> (i32, i64) {
        produce(&self.producer, &self.options.steps_topic, key, payload, &[]).await
    }

    fn results(&self) -> StreamConsumer {
        reader(&[self.options.results_topic.as_str()])
    }

    /// Waits until the worker group has committed a position past `offset`.
    async fn wait_committed_past(&self, partition: i32, offset: i64) {
        let (group, topic) = (
            self.options.group_id.clone(),
            self.options.steps_topic.clone(),
        );
        eventually(
            &format!("group position on {topic}/{partition} past {offset}"),
            WAIT,
            || {
                let (group, topic) = (group.clone(), topic.clone());
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

    fn committed(&self, partition: i32) -> i64 {
        committed_offset(&self.options.group_id, &self.options.steps_topic, partition)
    }

    /// Messages on the results topic, over all partitions.
    fn results_count(&self) -> i64 {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap_servers())
            .create()
            .expect("creating watermark probe");
        let metadata = consumer
            .fetch_metadata(Some(&self.options.results_topic), Duration::from_secs(10))
            .expect("fetching metadata");
        metadata.topics()[0]
            .partitions()
            .iter()
            .map(|p| {
                let (low, high) = consumer
                    .fetch_watermarks(&self.options.results_topic, p.id(), Duration::from_secs(10))
                    .expect("fetching watermarks");
                high - low
            })
            .sum()
    }
}

/// A `step.dispatch` as the coordinator writes it.
fn dispatch(run_id: &str, stamp: Uuid, deadline_in: TimeDelta, input: Value) -> Value {
    json!({
        "type": "step.dispatch", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "workflow_version": 1,
        "step": "reserve", "step_index": 0, "attempt": 1, "stamp": stamp,
        "deadline": rfc3339(Utc::now() + deadline_in), "input": input,
    })
}

/// The coordinator's view of a result message.
fn decode_result(msg: &OwnedMessage) -> AttemptResult {
    let payload = msg.payload().expect("result has a payload");
    match decode_input(
        InputTopic::AttemptResults,
        payload,
        &InputLimits::sized(1 << 20),
    ) {
        Ok(Input::Result(r)) => r,
        other => panic!("not an attempt.result: {other:?}"),
    }
}

fn key_of(msg: &OwnedMessage) -> String {
    String::from_utf8(msg.key().expect("result has a key").to_vec()).expect("UTF-8 key")
}

/// A handler that reports every stamp it sees and echoes its input.
fn echo(
    seen: mpsc::UnboundedSender<Uuid>,
) -> impl Fn(StepDispatch) -> std::future::Ready<StepOutcome> {
    move |step: StepDispatch| {
        let _ = seen.send(step.stamp);
        std::future::ready(StepOutcome::Succeeded(
            json!({"echo": step.input, "step": step.step}),
        ))
    }
}

#[tokio::test]
async fn dispatches_are_handled_and_exactly_their_results_published_keyed_by_run_id() {
    let h = Harness::new(3).await;
    let mut expected = BTreeMap::new();
    let mut positions = Vec::new();
    for i in 0..6 {
        let run_id = unique("run-");
        let stamp = Uuid::new_v4();
        positions.push(
            h.send_dispatch(&dispatch(
                &run_id,
                stamp,
                TimeDelta::minutes(5),
                json!({"n": i}),
            ))
            .await,
        );
        expected.insert(run_id, (stamp, i));
    }
    let (seen, _seen_rx) = mpsc::unbounded_channel();
    let worker = h.start(h.options.clone(), echo(seen));
    let results = h.results();
    for msg in read_n(&results, expected.len(), WAIT).await {
        let result = decode_result(&msg);
        let (stamp, n) = expected
            .remove(&result.run_id)
            .unwrap_or_else(|| panic!("unexpected or repeated result for {}", result.run_id));
        assert_eq!(key_of(&msg), result.run_id, "keyed by run_id");
        assert_eq!(result.tenant, "acme");
        assert_eq!(result.stamp, stamp);
        assert_eq!(
            result.outcome,
            AttemptOutcome::Succeeded {
                output: json!({"echo": {"n": n}, "step": "reserve"})
            }
        );
    }
    for (partition, offset) in positions {
        h.wait_committed_past(partition, offset).await;
    }
    worker.stop().await.expect("clean stop");
    assert_eq!(h.results_count(), 6, "one result per dispatch, no more");
    h.finish().await;
}

#[tokio::test]
async fn a_failing_handler_publishes_failed_with_the_retryable_flag_it_returned() {
    let h = Harness::new(1).await;
    let mut expected = BTreeMap::new();
    for retryable in [true, false] {
        let run_id = unique("fail-");
        let stamp = Uuid::new_v4();
        h.send_dispatch(&dispatch(
            &run_id,
            stamp,
            TimeDelta::minutes(5),
            json!({"retryable": retryable}),
        ))
        .await;
        expected.insert(run_id, (stamp, retryable));
    }
    let worker = h.start(h.options.clone(), |step: StepDispatch| async move {
        StepOutcome::Failed {
            message: format!("boom in {}", step.run_id),
            retryable: step.input["retryable"].as_bool().unwrap_or(true),
        }
    });
    for msg in read_n(&h.results(), 2, WAIT).await {
        let result = decode_result(&msg);
        let (stamp, retryable) = expected.remove(&result.run_id).expect("expected run");
        assert_eq!(result.stamp, stamp);
        assert_eq!(
            result.outcome,
            AttemptOutcome::Failed {
                message: format!("boom in {}", result.run_id),
                retryable
            }
        );
    }
    worker.stop().await.expect("clean stop");
    h.finish().await;
}

#[tokio::test]
async fn a_worker_stopped_before_publishing_leaves_the_dispatch_to_the_next_worker() {
    let h = Harness::new(1).await;
    let run_id = unique("crash-");
    let stamp = Uuid::new_v4();
    let (partition, offset) = h
        .send_dispatch(&dispatch(&run_id, stamp, TimeDelta::minutes(5), json!({})))
        .await;
    let (seen, mut seen_rx) = mpsc::unbounded_channel();

    let crashing = h.options.clone().crash_at(CrashPoint::WorkerBeforePublish);
    let first = h.start(crashing, echo(seen.clone()));
    let err = first
        .task
        .await
        .expect("worker task")
        .expect_err("the hook stops the worker after the handler");
    assert!(err.to_string().contains("before publishing"), "{err:#}");
    assert_eq!(seen_rx.recv().await, Some(stamp), "the handler ran");
    assert!(
        h.committed(partition) <= offset,
        "the offset of the unpublished dispatch was committed"
    );
    assert_eq!(h.results_count(), 0, "nothing was published");

    let second = h.start(h.options.clone(), echo(seen));
    let msg = read_n(&h.results(), 1, WAIT).await.remove(0);
    let result = decode_result(&msg);
    assert_eq!(
        (result.run_id.as_str(), result.stamp),
        (run_id.as_str(), stamp)
    );
    assert_eq!(
        seen_rx.recv().await,
        Some(stamp),
        "redelivered to the second worker"
    );
    h.wait_committed_past(partition, offset).await;
    second.stop().await.expect("clean stop");
    assert_eq!(h.results_count(), 1);
    h.finish().await;
}

#[tokio::test]
async fn expired_and_undecodable_dispatches_are_skipped_and_the_one_behind_them_is_handled() {
    let h = Harness::new(1).await;
    let run_id = unique("late-");
    let (expired, live) = (Uuid::new_v4(), Uuid::new_v4());
    h.send_raw(
        &run_id,
        b"{\"type\": \"step.dispatch\", \"schema_version\": 99}",
    )
    .await;
    h.send_dispatch(&dispatch(
        &run_id,
        expired,
        -TimeDelta::seconds(1),
        json!({}),
    ))
    .await;
    let (partition, last) = h
        .send_dispatch(&dispatch(&run_id, live, TimeDelta::minutes(5), json!({})))
        .await;
    let (seen, mut seen_rx) = mpsc::unbounded_channel();
    let worker = h.start(h.options.clone(), echo(seen));

    let msg = read_n(&h.results(), 1, WAIT).await.remove(0);
    assert_eq!(decode_result(&msg).stamp, live);
    h.wait_committed_past(partition, last).await;
    worker.stop().await.expect("clean stop");
    let mut handled = Vec::new();
    while let Ok(stamp) = seen_rx.try_recv() {
        handled.push(stamp);
    }
    assert_eq!(
        handled,
        vec![live],
        "only the live dispatch reached the handler"
    );
    assert_eq!(h.results_count(), 1);
    h.finish().await;
}

#[tokio::test]
async fn a_later_dispatch_finishing_first_does_not_move_the_offset_past_an_unfinished_one() {
    let h = Harness::new(1).await;
    let run_id = unique("order-");
    let (before, stuck, after) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    h.send_dispatch(&dispatch(&run_id, before, TimeDelta::minutes(5), json!({})))
        .await;
    let (partition, stuck_offset) = h
        .send_dispatch(&dispatch(&run_id, stuck, TimeDelta::minutes(5), json!({})))
        .await;
    h.send_dispatch(&dispatch(&run_id, after, TimeDelta::minutes(5), json!({})))
        .await;

    let mut options = h.options.clone();
    options.shutdown_grace = Duration::from_millis(200);
    let worker = h.start(options, move |step: StepDispatch| async move {
        if step.stamp == stuck {
            std::future::pending::<()>().await;
        }
        StepOutcome::Succeeded(json!({}))
    });
    let results = h.results();
    let stamps: BTreeSet<Uuid> = read_n(&results, 2, WAIT)
        .await
        .iter()
        .map(|m| decode_result(m).stamp)
        .collect();
    assert_eq!(stamps, BTreeSet::from([before, after]));
    // The stuck handler outlives the grace: it is abandoned, and the final
    // commit stops exactly at it.
    worker.stop().await.expect("clean stop");
    assert_eq!(h.committed(partition), stuck_offset);

    // The next worker gets the stuck dispatch again (and the one after it).
    let (seen, _seen_rx) = mpsc::unbounded_channel();
    let next = h.start(h.options.clone(), echo(seen));
    let redelivered: BTreeSet<Uuid> = read_n(&results, 2, WAIT)
        .await
        .iter()
        .map(|m| decode_result(m).stamp)
        .collect();
    assert_eq!(redelivered, BTreeSet::from([stuck, after]));
    next.stop().await.expect("clean stop");
    h.finish().await;
}

#[tokio::test]
async fn a_panicking_or_overrunning_handler_reports_a_retryable_failure() {
    let h = Harness::new(1).await;
    let run_id = unique("bad-");
    let (panics, hangs) = (Uuid::new_v4(), Uuid::new_v4());
    for stamp in [panics, hangs] {
        h.send_dispatch(&dispatch(&run_id, stamp, TimeDelta::minutes(5), json!({})))
            .await;
    }
    let mut options = h.options.clone();
    options.handler_timeout = Some(Duration::from_millis(300));
    let worker = h.start(options, move |step: StepDispatch| async move {
        if step.stamp == panics {
            panic!("handler bug");
        }
        std::future::pending::<()>().await;
        StepOutcome::Succeeded(json!({}))
    });
    let outcomes: BTreeMap<Uuid, AttemptOutcome> = read_n(&h.results(), 2, WAIT)
        .await
        .iter()
        .map(|m| {
            let r = decode_result(m);
            (r.stamp, r.outcome)
        })
        .collect();
    assert_eq!(
        outcomes[&panics],
        AttemptOutcome::Failed {
            message: "step handler panicked: handler bug".into(),
            retryable: true
        }
    );
    assert_eq!(
        outcomes[&hangs],
        AttemptOutcome::Failed {
            message: "step handler timed out after 300 ms".into(),
            retryable: true
        }
    );
    worker
        .stop()
        .await
        .expect("the worker survives its handler");
    h.finish().await;
}

// ---------------------------------------------------------------------------
// dedup

/// A database whose owner made the dedup table and granted its rows (and
/// nothing more) to the role the claims then run as, as a consumer's own
/// role would be.
async fn dedup_db() -> TestDb {
    let db = TestDb::migrated().await;
    dedup::ensure_schema(&db.owner)
        .await
        .expect("first ensure_schema");
    dedup::ensure_schema(&db.owner)
        .await
        .expect("second ensure_schema is a no-op");
    db.grant_rows("ductor_dedup_seen").await;
    db
}

async fn claim_once(db: &TestDb, consumer: &str, key: &str) -> Claim {
    let mut tx = db.pool.begin().await.unwrap();
    let claim = dedup::claim(&mut tx, consumer, key).await.unwrap();
    tx.commit().await.unwrap();
    claim
}

#[tokio::test]
async fn dedup_claims_a_key_once_per_consumer_and_a_rollback_releases_it() {
    let db = dedup_db().await;
    assert_eq!(claim_once(&db, "billing", "run-1/2/0").await, Claim::First);
    assert_eq!(
        claim_once(&db, "billing", "run-1/2/0").await,
        Claim::Duplicate
    );
    assert_eq!(
        claim_once(&db, "shipping", "run-1/2/0").await,
        Claim::First,
        "consumers are independent"
    );

    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        dedup::claim(&mut tx, "billing", "run-1/3/0").await.unwrap(),
        Claim::First
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        claim_once(&db, "billing", "run-1/3/0").await,
        Claim::First,
        "a rolled-back claim leaves the key claimable"
    );

    // Two transactions at once: the second waits for the first's commit.
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(
        dedup::claim(&mut first, "billing", "run-1/4/0")
            .await
            .unwrap(),
        Claim::First
    );
    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let claim = dedup::claim(&mut tx, "billing", "run-1/4/0").await.unwrap();
        tx.commit().await.unwrap();
        claim
    });
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Duplicate);

    let mut tx = db.pool.begin().await.unwrap();
    assert!(dedup::claim(&mut tx, "billing", "").await.is_err());
    drop(tx);
    assert_eq!(db.count("ductor_dedup_seen").await, 4);
    db.drop_db().await;
}

#[tokio::test]
async fn dedup_purge_removes_old_claims_in_batches_and_keeps_new_ones() {
    let db = dedup_db().await;
    sqlx::query(
        "INSERT INTO ductor_dedup_seen (consumer, idempotency_key, seen_at) \
         SELECT 'billing', 'old-' || i, now() - interval '2 days' FROM generate_series(1, 25) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for key in ["new-1", "new-2", "new-3"] {
        claim_once(&db, "billing", key).await;
    }
    let day = Duration::from_secs(24 * 3600);
    assert!(dedup::purge(&db.pool, day, 0).await.is_err());
    assert_eq!(dedup::purge(&db.pool, day, 10).await.unwrap(), 25);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM ductor_dedup_seen ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, vec!["new-1", "new-2", "new-3"]);
    assert_eq!(dedup::purge(&db.pool, day, 10).await.unwrap(), 0);
    // A purged key is claimable again: retention must outlast redelivery.
    assert_eq!(claim_once(&db, "billing", "old-1").await, Claim::First);
    db.drop_db().await;
}

fn message(headers: Option<OwnedHeaders>) -> OwnedMessage {
    OwnedMessage::new(
        Some(b"{}".to_vec()),
        Some(b"run-1".to_vec()),
        "ductor.events".to_string(),
        Timestamp::NotAvailable,
        0,
        7,
        headers,
    )
}

#[tokio::test]
async fn dedup_claim_message_applies_an_effect_once_and_needs_the_header() {
    let db = dedup_db().await;
    sqlx::query("CREATE TABLE effects (n int NOT NULL)")
        .execute(&db.owner)
        .await
        .unwrap();
    db.grant_rows("effects").await;
    let keyed = message(Some(OwnedHeaders::new().insert(Header {
        key: "idempotency-key",
        value: Some("run-1/5/1"),
    })));
    // The consumer's loop: claim, apply only if first, commit; three deliveries.
    for delivery in 0..3 {
        let mut tx = db.pool.begin().await.unwrap();
        match dedup::claim_message(&mut tx, "billing", &keyed)
            .await
            .unwrap()
        {
            Claim::First => {
                assert_eq!(delivery, 0);
                sqlx::query("INSERT INTO effects (n) VALUES (1)")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            Claim::Duplicate => assert!(delivery > 0),
        }
        tx.commit().await.unwrap();
    }
    assert_eq!(db.count("effects").await, 1);

    let mut tx = db.pool.begin().await.unwrap();
    for unkeyed in [
        message(None),
        message(Some(OwnedHeaders::new().insert(Header {
            key: "ce_id",
            value: Some("x"),
        }))),
    ] {
        let err = dedup::claim_message(&mut tx, "billing", &unkeyed)
            .await
            .expect_err("a message without the header cannot be claimed");
        assert!(matches!(err, ClaimError::MissingKey), "{err}");
    }
    tx.rollback().await.unwrap();
    assert_eq!(db.count("ductor_dedup_seen").await, 1);
    db.drop_db().await;
}

/// A handler's result that the coordinator could not accept (too large,
/// holding U+0000, too deep, with a NUL in its error message) is replaced
/// by a non-retryable failure naming the class: the run fails the step at
/// once instead of waiting for a timeout behind a dead-lettered result.
#[tokio::test]
async fn a_result_the_coordinator_would_refuse_is_reported_as_a_failure_for_good() {
    let h = Harness::new(1).await;
    let cases = [
        ("big", "too_large"),
        ("nul", "nul_character"),
        ("deep", "too_deep"),
        ("nul-error", "nul_character"),
    ];
    let mut expected = BTreeMap::new();
    for (kind, class) in cases {
        let run_id = unique(&format!("{kind}-"));
        h.send_dispatch(&dispatch(
            &run_id,
            Uuid::new_v4(),
            TimeDelta::minutes(5),
            json!({"kind": kind}),
        ))
        .await;
        expected.insert(run_id, class);
    }
    let mut options = h.options.clone();
    options.max_result_bytes = 4096;
    let worker = h.start(options, |step: StepDispatch| async move {
        let deep = (0..100).fold(json!(1), |v, _| json!([v]));
        match step.input["kind"].as_str().unwrap_or_default() {
            "big" => StepOutcome::Succeeded(json!("x".repeat(10_000))),
            "nul" => StepOutcome::Succeeded(json!({"note": "a\u{0}b"})),
            "deep" => StepOutcome::Succeeded(deep),
            _ => StepOutcome::Failed {
                message: "broken\u{0}".into(),
                retryable: true,
            },
        }
    });
    for msg in read_n(&h.results(), cases.len(), WAIT).await {
        let result = decode_result(&msg);
        let class = expected.remove(&result.run_id).expect("expected run");
        let AttemptOutcome::Failed { message, retryable } = result.outcome else {
            panic!("{}: not a failure", result.run_id);
        };
        assert!(!retryable, "{}", result.run_id);
        assert!(message.contains(class), "{class}: {message}");
    }
    worker.stop().await.expect("clean stop");
    h.finish().await;
}
