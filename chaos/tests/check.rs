//! The chaos checker against the real stack: a tiny load through an
//! in-process `serve` must check clean, and the same data with one run's
//! history and another's state corrupted, and a kept count of runs off by
//! one, must not. Then every run is purged, the load's inputs are
//! delivered again, and none comes back.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{Running, TestDb, bootstrap_servers, unique};
use ductor::config::Config;
use ductor_chaos::{CheckArgs, LoadArgs, check, load};
use tokio_util::sync::CancellationToken;

const WORKFLOW: &str = r#"
name = "chaos"
version = 1

[[steps]]
name = "a"
pool = "chaos-a"
timeout_ms = 1000
[steps.retry]
max_attempts = 4
initial_backoff_ms = 50
max_backoff_ms = 200

[[steps]]
name = "b"
pool = "chaos-b"
timeout_ms = 1000
[steps.retry]
max_attempts = 4
initial_backoff_ms = 50
max_backoff_ms = 200
jitter = 0.5
"#;

fn config(db: &TestDb, workflows: &std::path::Path) -> Config {
    let prefix = unique("cc").chars().take(14).collect::<String>();
    let env = [
        ("DATABASE_URL", db.url.clone()),
        ("DATABASE_MIGRATE_URL", db.owner_url.clone()),
        ("DATABASE_KEYS_URL", db.keys_url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap_servers()),
        ("DUCTOR__KAFKA__TOPIC_PREFIX", format!("{prefix}.")),
        ("DUCTOR__KAFKA__GROUP_ID", format!("{prefix}-coordinator")),
        ("DUCTOR__KAFKA__PARTITIONS", "2".into()),
        (
            "DUCTOR__KAFKA__STEP_POOLS",
            r#"["chaos-a","chaos-b"]"#.into(),
        ),
        ("DUCTOR__KAFKA__EXTRA_TOPICS", "[]".into()),
        ("DUCTOR__SERVER__LISTEN", "127.0.0.1:0".into()),
        ("DUCTOR__SERVER__ADMIN_LISTEN", "127.0.0.1:0".into()),
        (
            "DUCTOR__COORDINATOR__WORKFLOWS_DIR",
            workflows.display().to_string(),
        ),
    ];
    let config = Config::load_from(
        None,
        env.into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<Vec<_>>(),
    )
    .expect("test configuration is valid");
    db.owns_topics(config.all_topics());
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checker_passes_a_clean_run_and_flags_corrupted_ones() {
    let db = TestDb::migrated().await;
    let dir = tempfile::tempdir().unwrap();
    let workflows = dir.path().join("workflows");
    std::fs::create_dir(&workflows).unwrap();
    std::fs::write(workflows.join("chaos.toml"), WORKFLOW).unwrap();
    let config = config(&db, &workflows);
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");

    let serve = Running::start(&config).await;
    let (addr, admin) = (serve.addr, serve.admin);

    let log = dir.path().join("load.jsonl");
    let summary = load::run(
        LoadArgs {
            log: log.clone(),
            duration_s: 6,
            rate: 15.0,
            http: vec![addr],
            admin: vec![admin],
            drain_s: 60,
            replay_again: 0.35,
            tenants: vec!["acme".into(), "globex".into()],
        },
        config.clone(),
        CancellationToken::new(),
        CancellationToken::new(),
    )
    .await
    .expect("load runs");
    assert!(
        summary.acked > 20,
        "the load produced too little: {summary:?}"
    );
    assert!(summary.runs_seen > 5, "too few runs: {summary:?}");

    let args = CheckArgs {
        log,
        faults: None,
        settle_timeout_s: 60,
        afterlife: false,
    };
    let report = check::run(&args, &config).await.expect("check runs");
    assert!(
        report.ok(),
        "a fault-free run must check clean: {}",
        serde_json::to_string(&report).unwrap()
    );
    assert!(report.runs > 5 && report.inputs > 20, "{report:?}");
    let runs = report.runs;

    // Corrupt two finished runs: a hole in one history, a changed output in
    // another's state; and one of the operator's kept counts.
    let finished: Vec<(String, i64)> = sqlx::query_as(
        "SELECT run_id, last_transition_seq FROM runs \
         WHERE status <> 'running' AND last_transition_seq >= 3 ORDER BY run_id LIMIT 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(finished.len(), 2, "need two finished runs with a history");
    // As the owner: no role of Ductor's may rewrite a history.
    sqlx::query("DELETE FROM run_transitions WHERE run_id = $1 AND seq = 2")
        .bind(&finished[0].0)
        .execute(&db.owner)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE runs SET state = jsonb_set(state, '{input}', '\"tampered\"') WHERE run_id = $1",
    )
    .bind(&finished[1].0)
    .execute(&db.owner)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE run_counts SET n = n + 1 WHERE (tenant_scope, workflow_name, workflow_version, \
             status) = (SELECT tenant_scope, workflow_name, workflow_version, status \
                        FROM run_counts ORDER BY 1, 2, 3, 4 LIMIT 1)",
    )
    .execute(&db.owner)
    .await
    .unwrap();

    let report = check::run(
        &CheckArgs {
            settle_timeout_s: 10,
            ..args.clone()
        },
        &config,
    )
    .await
    .expect("check runs");
    let v = &report.violations;
    assert!(!report.ok());
    assert!(v.get("seq_gap").copied().unwrap_or(0) >= 1, "{v:?}");
    assert!(
        v.get("state_replay_mismatch").copied().unwrap_or(0) >= 1,
        "{v:?}"
    );
    assert_eq!(v.get("run_counts_differ"), Some(&1), "{v:?}");
    let examples = serde_json::to_string(&report.examples).unwrap();
    assert!(examples.contains(&finished[0].0), "{examples}");
    assert!(examples.contains(&finished[1].0), "{examples}");

    // Every run is purged, and the load's inputs delivered again bring
    // none back.
    let report = check::run(
        &CheckArgs {
            settle_timeout_s: 10,
            afterlife: true,
            ..args
        },
        &config,
    )
    .await
    .expect("check runs");
    let afterlife = report.afterlife.clone().expect("the afterlife ran");
    assert_eq!(afterlife.purged, runs, "{report:?}");
    assert!(afterlife.redelivered > 20, "{report:?}");
    for kind in ["purge_incomplete", "purged_run_resurrected"] {
        assert!(!report.violations.contains_key(kind), "{report:?}");
    }

    serve.stop().await;
    db.drop_db().await;
}
