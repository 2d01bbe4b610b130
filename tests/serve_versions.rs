//! Workflow versions that disappear: `serve` refuses to start while running
//! runs need a version its workflows directory no longer defines, naming
//! them, and, told to, fails those runs as it starts, like any other
//! failure, before it consumes anything.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use ductor::apply::{Applier, InputOutcome, PendingInput};
use ductor::config::Config;
use ductor::contract::{EffectKind, Input, RunStart};
use rdkafka::message::Message;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// Runs of version 1; the refusal names the first five by id.
const OLD_RUNS: [&str; 6] = ["old-1", "old-2", "old-3", "old-4", "old-5", "old-6"];
/// A run of version 2, which stays defined.
const NEW_RUN: &str = "new-1";

/// Version `version` of workflow "flow": one step on pool "p", with a
/// timeout long enough that its attempt stays outstanding.
fn flow(version: u32) -> String {
    format!(
        "name = \"flow\"\nversion = {version}\n\n[[steps]]\nname = \"a\"\npool = \"p\"\n\
         timeout_ms = 600000\n"
    )
}

fn start(run_id: &str, version: u32) -> PendingInput {
    PendingInput {
        input: Input::Start(RunStart {
            run_id: run_id.into(),
            tenant: "acme".into(),
            workflow: "flow".into(),
            workflow_version: Some(version),
            pool: "default".into(),
            input: json!({"n": 1}),
            correlation_id: None,
            parent: None,
        }),
        source: None,
        trace: None,
    }
}

/// Starts the runs of both versions, each left with its attempt
/// outstanding.
async fn start_runs(config: &Config, db: &TestDb, dir: &Path) {
    let mut starts: Vec<PendingInput> = OLD_RUNS.iter().map(|id| start(id, 1)).collect();
    starts.push(start(NEW_RUN, 2));
    apply_starts(config, db, dir, &starts).await;
}

/// Applies `starts` with the workflows of `dir`, a batch at a time; each
/// must start its run.
async fn apply_starts(config: &Config, db: &TestDb, dir: &Path, starts: &[PendingInput]) {
    let workflows = ductor::infra::workflows::load_dir(dir).expect("loading workflows");
    let applier = Applier::new(config, db.pool.clone(), workflows);
    for batch in starts.chunks(256) {
        let report = applier.apply_batch(batch).await.expect("starting runs");
        assert!(
            report
                .outcomes
                .iter()
                .all(|o| *o == InputOutcome::Applied { seq: 1 }),
            "{:?}",
            report.outcomes
        );
    }
}

/// Each run's status, record version, last seq and error, by id.
async fn runs(db: &TestDb) -> Vec<(String, String, i64, i64, Option<String>)> {
    sqlx::query_as(
        "SELECT run_id, status, record_version, last_transition_seq, state->>'error' \
         FROM runs ORDER BY run_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// A workflows directory with versions `versions` of "flow", and `config`
/// pointed at it and at its step pool, with its topics made.
async fn flow_dir(config: &mut Config, versions: &[u32]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for version in versions {
        let file = dir.path().join(format!("flow-v{version}.toml"));
        std::fs::write(file, flow(*version)).unwrap();
    }
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    ductor::infra::kafka::create_configured_topics(config)
        .await
        .expect("creating topics");
    dir
}

#[tokio::test]
async fn serve_refuses_runs_of_a_removed_version_and_fails_them_when_told_to() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = flow_dir(&mut config, &[1, 2]).await;
    start_runs(&config, &db, dir.path()).await;
    let before = runs(&db).await;
    assert!(before.iter().all(|r| r.1 == "running"), "{before:?}");

    // Version 1 goes while six of its runs are running.
    std::fs::remove_file(dir.path().join("flow-v1.toml")).unwrap();
    assert!(
        !config.coordinator.fail_runs_of_missing_workflows,
        "refusing is the default"
    );
    let listeners = ductor::cli::serve::Listeners::bind(&config.server)
        .await
        .unwrap();
    let serve = ductor::cli::serve::run_on(config.clone(), listeners, CancellationToken::new());
    let refused = tokio::time::timeout(WAIT, serve)
        .await
        .expect("serve stops at once")
        .expect_err("serve refuses to start");
    let message = format!("{refused:#}");
    assert!(
        message.contains(
            "workflow \"flow\" version 1 (6 running runs, such as old-1, old-2, old-3, old-4, old-5)"
        ),
        "{message}"
    );
    assert!(
        !message.contains("old-6"),
        "five examples at most: {message}"
    );
    assert!(!message.contains("version 2"), "{message}");
    assert!(
        message.contains("coordinator.fail_runs_of_missing_workflows = true")
            && message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    assert_eq!(runs(&db).await, before, "a refusal changes nothing");

    // Told to, serve fails them as it starts, and then runs.
    config.coordinator.fail_runs_of_missing_workflows = true;
    let events = reader(&[&config.topic_names().events()]);
    let serve = Running::start(&config).await;
    // Failed before serve answers ready, let alone consumes an input.
    let error = "workflow_missing: workflow \"flow\" version 1 is no longer defined";
    let after = runs(&db).await;
    for (run_id, status, record_version, seq, run_error) in &after {
        if run_id == NEW_RUN {
            assert_eq!(
                (status.as_str(), *record_version, *seq, run_error.as_deref()),
                ("running", 1, 1, None),
                "a run of a defined version is left alone"
            );
        } else {
            assert_eq!(
                (status.as_str(), *record_version, *seq, run_error.as_deref()),
                ("failed", 2, 2, Some(error)),
                "{run_id}"
            );
        }
    }
    assert_failed_like_any_failure(&db).await;

    // The run.event of every failure is published.
    let mut unseen: Vec<&str> = OLD_RUNS.to_vec();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !unseen.is_empty() {
        let message = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no run.failed event for {unseen:?}"))
            .expect("reading events");
        let event: Value = serde_json::from_slice(message.payload().unwrap_or_default()).unwrap();
        if event["kind"] == "run.failed" && event["seq"] == 2 && event["status"] == "failed" {
            unseen.retain(|id| event["run_id"] != *id);
        }
    }

    serve.stop().await;

    // With the runs failed, serve starts without being told anything.
    config.coordinator.fail_runs_of_missing_workflows = false;
    let serve = Running::start(&config).await;
    serve.stop().await;
    db.drop_db().await;
}

/// The history, attempts and outbox of the failed runs are those of any
/// failure: a `run.failed` transition from no input with its cause,
/// written by serve's maintenance, the attempt cancelled, its pending
/// timeout timer deleted, and the `run.event` intent of the new seq.
async fn assert_failed_like_any_failure(db: &TestDb) {
    type Row = (
        String,
        String,
        String,
        Option<String>,
        String,
        Value,
        bool,
        String,
    );
    let transitions: Vec<Row> = sqlx::query_as(
        "SELECT run_id, input_ref, kind, from_status, to_status, detail, \
                source_topic IS NULL, writer \
         FROM run_transitions WHERE seq = 2 ORDER BY run_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(transitions.len(), OLD_RUNS.len(), "{transitions:?}");
    for (run_id, input_ref, kind, from, to, detail, no_source, writer) in &transitions {
        assert!(run_id.starts_with("old-"), "{run_id}");
        assert_eq!(input_ref, "maintenance:missing_workflow");
        assert_eq!(kind, "run.failed");
        assert_eq!((from.as_deref(), to.as_str()), (Some("running"), "failed"));
        assert_eq!(detail["cause"], "workflow_missing", "{detail}");
        assert!(detail["stamp"].is_string(), "{detail}");
        assert!(no_source, "made from no input");
        assert!(writer.ends_with("/maintenance#0"), "{writer}");
    }
    let attempts: Vec<(String, String)> =
        sqlx::query_as("SELECT run_id, status FROM run_attempts ORDER BY run_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    for (run_id, status) in &attempts {
        let expected = if run_id == NEW_RUN {
            "dispatched"
        } else {
            "cancelled"
        };
        assert_eq!(status, expected, "{run_id}");
    }
    let intents: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT run_id, seq, ce_type FROM eec_effect_intent \
         WHERE ce_type IN ($1, $2) ORDER BY run_id, seq",
    )
    .bind(EffectKind::RunEvent.ce_type())
    .bind(EffectKind::WakeupTimer.ce_type())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for run_id in OLD_RUNS {
        let mine: Vec<(i64, &str)> = intents
            .iter()
            .filter(|i| i.0 == run_id)
            .map(|i| (i.1, i.2.as_str()))
            .collect();
        assert_eq!(
            mine,
            [
                (1, EffectKind::RunEvent.ce_type()),
                (2, EffectKind::RunEvent.ce_type())
            ],
            "{run_id}: the start's event, the failure's event, no timeout timer"
        );
    }
    let new_timer = intents
        .iter()
        .any(|i| i.0 == NEW_RUN && i.2 == EffectKind::WakeupTimer.ce_type());
    assert!(new_timer, "the running run keeps its timeout timer");
}

/// More runs of a removed version than one batch fails: serve fails them
/// page by page, each exactly once, before it answers ready.
#[tokio::test]
async fn serve_fails_every_run_of_a_removed_version_past_one_batch() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = flow_dir(&mut config, &[1]).await;
    let count = 2 * ductor::apply::missing::MAX_FAIL_BATCH_RUNS + 3;
    let starts: Vec<PendingInput> = (0..count)
        .map(|k| start(&format!("run-{k:05}"), 1))
        .collect();
    apply_starts(&config, &db, dir.path(), &starts).await;
    std::fs::remove_file(dir.path().join("flow-v1.toml")).unwrap();

    config.coordinator.fail_runs_of_missing_workflows = true;
    let serve = Running::start(&config).await;
    let (failed, running, failures, transitions): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM runs WHERE status = 'failed'), \
                (SELECT count(*) FROM runs WHERE status = 'running'), \
                (SELECT count(*) FROM run_transitions \
                  WHERE seq = 2 AND input_ref = 'maintenance:missing_workflow'), \
                (SELECT count(*) FROM run_transitions)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let count = count as i64;
    assert_eq!((failed, running), (count, 0), "every run failed");
    assert_eq!(
        (failures, transitions),
        (count, 2 * count),
        "a start and one failure each"
    );
    serve.stop().await;
    db.drop_db().await;
}
