//! The stack and the schema: a Kafka round trip, migrations on a fresh
//! database, and the constraints that make duplicates impossible.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::time::Duration;

use common::*;
use rdkafka::message::{Headers, Message};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn kafka_round_trip_through_a_random_topic() {
    let topic = unique("roundtrip-");
    let outcomes =
        ductor::infra::kafka::ensure_topics(&kafka_config(), std::slice::from_ref(&topic), 1)
            .await
            .expect("creating topic");
    assert_eq!(outcomes.len(), 1);
    assert!(outcomes[0].created, "a random topic is new");
    // Creating it again is not an error: `topics create` is idempotent.
    let again =
        ductor::infra::kafka::ensure_topics(&kafka_config(), std::slice::from_ref(&topic), 1)
            .await
            .expect("creating topic again");
    assert!(!again[0].created);

    let producer = producer();
    let payload = format!("hello {}", unique(""));
    produce(&producer, &topic, "k1", payload.as_bytes(), &[("h", "v")]).await;
    let consumer = reader(&[&topic]);
    let got = read_n(&consumer, 1, Duration::from_secs(30)).await;
    assert_eq!(got[0].payload(), Some(payload.as_bytes()));
    assert_eq!(got[0].key(), Some(&b"k1"[..]));
    let headers = got[0].headers().expect("headers kept");
    assert_eq!(headers.get(0).key, "h");
    delete_test_topics(std::slice::from_ref(&topic)).await;
}

/// The database settings of `ductor migrate` on the test database: the
/// application role's URL, the migrator's and the keys role's.
fn database_config(db: &TestDb) -> ductor::config::DatabaseConfig {
    let env = [
        ("DATABASE_URL", &db.url),
        ("DATABASE_MIGRATE_URL", &db.owner_url),
        ("DATABASE_KEYS_URL", &db.keys_url),
    ];
    ductor::config::Config::load_from(None, env.map(|(k, v)| (k.to_string(), v.clone())))
        .expect("test configuration is valid")
        .database
}

#[tokio::test]
async fn migrations_apply_to_a_fresh_database_and_are_idempotent() {
    let db = TestDb::empty().await;
    let config = database_config(&db);
    ductor::infra::db::check_migrated(&db.owner)
        .await
        .expect_err("a fresh database is not migrated");
    ductor::infra::db::migrate_database(&config)
        .await
        .expect("first migration");
    ductor::infra::db::migrate_database(&config)
        .await
        .expect("second migration is a no-op");
    ductor::infra::db::check_migrated(&db.pool)
        .await
        .expect("the application role sees a current schema");
    ductor::auth::store::list(&db.keys, None)
        .await
        .expect("the keys role, granted by the same command, reads the keys");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = 'public' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for expected in [
        "eec_effect_intent",
        "eec_routing_idempotency",
        "run_attempts",
        "run_transitions",
        "runs",
    ] {
        assert!(
            tables.iter().any(|t| t == expected),
            "{expected} missing from {tables:?}"
        );
    }
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_name = 'runs'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(columns.iter().any(|c| c == "record_version"));
    assert!(columns.iter().any(|c| c == "last_transition_seq"));
    db.drop_db().await;
}

/// The state history migration, applied again by the test below to rows
/// written in the shape it rewrites.
const STATE_HISTORY_MIGRATION: &str =
    include_str!("../migrations/20261202000011_state_history.sql");

/// A state in the shape before `20261202000011_state_history`: every
/// output, and signals with their payloads.
fn old_state(run_id: &str, outputs: serde_json::Value, signals: serde_json::Value) -> String {
    serde_json::json!({
        "run_id": run_id, "tenant": "t", "pool": "default", "workflow": "wf",
        "workflow_version": 1, "status": "succeeded", "step_index": 1, "attempt": 1,
        "input": {"x": 1}, "outputs": outputs, "outstanding": null, "pending_retry": null,
        "attempts": [], "signals": signals, "correlation_id": null, "error": null,
        "record_version": 1, "last_transition_seq": 4,
        "created_at": "2026-12-01T00:00:00Z", "updated_at": "2026-12-01T00:00:00Z",
    })
    .to_string()
}

async fn insert_old_run(
    db: &TestDb,
    run_id: &str,
    state: &str,
    transitions: &[(&str, &str, i32, &str)],
) {
    sqlx::query(
        "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, status, \
             last_transition_seq, state, created_at, updated_at, finished_at) \
         VALUES ($1, 't', 'default', 'wf', 1, 'succeeded', $2, $3::jsonb, now(), now(), now())",
    )
    .bind(run_id)
    .bind(transitions.len() as i64)
    .bind(state)
    .execute(&db.pool)
    .await
    .expect("inserting run");
    for (seq, (input_ref, kind, step_index, detail)) in transitions.iter().enumerate() {
        sqlx::query(
            "INSERT INTO run_transitions (run_id, seq, input_ref, kind, to_status, step_index, \
                 detail, created_at) \
             VALUES ($1, $2, $3, $4, 'running', $5, $6::jsonb, now())",
        )
        .bind(run_id)
        .bind(seq as i64 + 1)
        .bind(input_ref)
        .bind(kind)
        .bind(step_index)
        .bind(detail)
        .execute(&db.pool)
        .await
        .expect("inserting transition");
    }
}

async fn details(db: &TestDb, run_id: &str) -> Vec<serde_json::Value> {
    sqlx::query_scalar("SELECT detail FROM run_transitions WHERE run_id = $1 ORDER BY seq")
        .bind(run_id)
        .fetch_all(&db.pool)
        .await
        .expect("reading the history")
}

/// Runs stored when the state kept every output and signal payload lose
/// none of them: the migration moves each into the detail of the
/// transition that brought it, and leaves states the fold can read.
#[tokio::test]
async fn the_state_history_migration_moves_outputs_and_payloads_into_the_history() {
    use serde_json::json;
    let db = TestDb::migrated().await;
    let signal = json!([{"signal_id": "s1", "name": "poke", "payload": {"n": 7},
                         "received_at": "2026-12-01T00:00:00Z"}]);
    let outputs = json!([{"of": 0}, {"of": 1}]);
    insert_old_run(
        &db,
        "r-old",
        &old_state("r-old", outputs, signal),
        &[
            ("start", "run.started", 0, r#"{"stamp": "a"}"#),
            (
                "signal:s1",
                "run.signalled",
                0,
                r#"{"signal_id": "s1", "name": "poke"}"#,
            ),
            (
                "result:a",
                "step.succeeded",
                1,
                r#"{"stamp": "a", "completed_step": 0}"#,
            ),
            (
                "result:b",
                "run.succeeded",
                1,
                r#"{"stamp": "b", "completed_step": 1}"#,
            ),
        ],
    )
    .await;
    insert_old_run(
        &db,
        "r-none",
        &old_state("r-none", json!([]), json!([])),
        &[("start", "run.started", 0, r#"{"stamp": "c"}"#)],
    )
    .await;
    // Applied twice: the second time finds nothing left to move. As the
    // owner: it turns the history's trigger off and on.
    for _ in 0..2 {
        sqlx::raw_sql(STATE_HISTORY_MIGRATION)
            .execute(&db.owner)
            .await
            .expect("the migration applies");
    }
    let history = details(&db, "r-old").await;
    assert_eq!(
        history[1],
        json!({"signal_id": "s1", "name": "poke", "payload": {"n": 7}})
    );
    assert_eq!(history[2]["output"], json!({"of": 0}));
    assert_eq!(history[3]["output"], json!({"of": 1}));
    assert!(history[0].get("output").is_none());
    let state = |run_id: &'static str| {
        sqlx::query_scalar::<_, serde_json::Value>("SELECT state FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&db.pool)
    };
    let old = state("r-old").await.unwrap();
    assert!(old.get("outputs").is_none(), "{old}");
    assert_eq!(old["output"], json!({"of": 1}));
    assert_eq!(
        old["signals"],
        json!([{"signal_id": "s1", "name": "poke", "received_at": "2026-12-01T00:00:00Z"}])
    );
    let read: ductor::coordinator::RunState =
        serde_json::from_value(old).expect("the fold reads the new shape");
    assert_eq!(read.signals.len(), 1);
    let none = state("r-none").await.unwrap();
    assert_eq!(none["output"], serde_json::Value::Null);
    assert!(none.get("outputs").is_none(), "{none}");
    // The history is append-only again: its trigger is back on, and
    // refuses even the owner (serve's role may not update it at all).
    let err = sqlx::query("UPDATE run_transitions SET kind = 'x' WHERE run_id = 'r-old'")
        .execute(&db.owner)
        .await
        .expect_err("transitions cannot be updated");
    assert_eq!(sql_state(&err).as_deref(), Some("23001"), "{err}");
    db.drop_db().await;
}

async fn insert_run(db: &TestDb, run_id: &str) {
    sqlx::query(
        "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, status, \
             last_transition_seq, state, created_at, updated_at) \
         VALUES ($1, 't', 'default', 'wf', 1, 'running', 0, '{}'::jsonb, now(), now())",
    )
    .bind(run_id)
    .execute(&db.pool)
    .await
    .expect("inserting run");
}

fn sql_state(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

#[tokio::test]
async fn constraints_reject_a_duplicate_stamp() {
    let db = TestDb::migrated().await;
    insert_run(&db, "r1").await;
    let stamp = uuid::Uuid::new_v4();
    let insert = |attempt: i32| {
        sqlx::query(
            "INSERT INTO run_attempts (stamp, run_id, step_index, attempt, status, dispatched_at, deadline) \
             VALUES ($1, 'r1', 0, $2, 'dispatched', now(), now())",
        )
        .bind(stamp)
        .bind(attempt)
        .execute(&db.pool)
    };
    insert(1).await.expect("first stamp");
    let err = insert(2).await.expect_err("a duplicate stamp is rejected");
    assert_eq!(sql_state(&err).as_deref(), Some("23505"), "{err}");
    db.drop_db().await;
}

#[tokio::test]
async fn constraints_reject_a_duplicate_transition_seq() {
    let db = TestDb::migrated().await;
    insert_run(&db, "r1").await;
    let insert = |input_ref: &'static str| {
        sqlx::query(
            "INSERT INTO run_transitions (run_id, seq, input_ref, kind, to_status, step_index, created_at) \
             VALUES ('r1', 1, $1, 'run.started', 'running', 0, now())",
        )
        .bind(input_ref)
        .execute(&db.pool)
    };
    insert("start").await.expect("first transition");
    let err = insert("signal:x")
        .await
        .expect_err("a duplicate seq is rejected");
    assert_eq!(sql_state(&err).as_deref(), Some("23505"), "{err}");
    // The history is append-only: its trigger refuses an UPDATE even from
    // the owner (serve's role has no UPDATE on it to begin with).
    let err = sqlx::query("UPDATE run_transitions SET kind = 'x' WHERE run_id = 'r1'")
        .execute(&db.owner)
        .await
        .expect_err("transitions cannot be updated");
    assert_eq!(sql_state(&err).as_deref(), Some("23001"), "{err}");
    db.drop_db().await;
}

#[tokio::test]
async fn constraints_reject_a_duplicate_routing_key() {
    let db = TestDb::migrated().await;
    let insert = |tenant: &'static str| {
        sqlx::query(
            "INSERT INTO eec_routing_idempotency (tenant_scope, pool_id, idempotency_key, status, \
                 request_fingerprint, reserved_at, pending_expires_at, updated_at) \
             VALUES ($1, 'default', 'key-1', 'pending', 'fp', now(), now(), now())",
        )
        .bind(tenant)
        .execute(&db.pool)
    };
    insert("tenant-a").await.expect("first reservation");
    let err = insert("tenant-a")
        .await
        .expect_err("a duplicate (tenant, pool, key) is rejected");
    assert_eq!(sql_state(&err).as_deref(), Some("23505"), "{err}");
    insert("tenant-b")
        .await
        .expect("the same key under another tenant is a different row");
    // Status values are checked.
    let err = sqlx::query(
        "UPDATE eec_routing_idempotency SET status = 'done' WHERE tenant_scope = 'tenant-a'",
    )
    .execute(&db.pool)
    .await
    .expect_err("an unknown status is rejected");
    assert_eq!(sql_state(&err).as_deref(), Some("23514"), "{err}");
    db.drop_db().await;
}

/// `serve`'s role, the application role that `ductor migrate` grants
/// rights to, can change no part of the schema: every DDL statement is
/// refused as `insufficient_privilege`. What serve does in SQL works (and
/// every other integration test runs serve as this role).
#[tokio::test]
async fn the_application_role_cannot_change_the_schema() {
    let db = TestDb::migrated().await;
    for ddl in [
        "CREATE TABLE intruder (n int)",
        "CREATE TABLE runs_copy AS SELECT * FROM runs",
        "CREATE INDEX intruder ON runs (status)",
        "CREATE SCHEMA intruder",
        "CREATE FUNCTION intruder() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "CREATE OR REPLACE FUNCTION ductor_write_guard(expected bigint[], written bigint[]) \
         RETURNS boolean LANGUAGE sql AS 'SELECT true'",
        "CREATE VIEW intruder AS SELECT 1",
        "ALTER TABLE runs ADD COLUMN intruder int",
        "ALTER TABLE eec_effect_intent DROP CONSTRAINT eec_effect_intent_key_unique",
        "ALTER TABLE run_transitions DISABLE TRIGGER run_transitions_no_update",
        "DROP TABLE run_transitions",
        "DROP FUNCTION ductor_write_guard(bigint[], bigint[])",
        "TRUNCATE runs",
        "DELETE FROM _sqlx_migrations",
    ] {
        let err = sqlx::raw_sql(ddl).execute(&db.pool).await.expect_err(ddl);
        assert_eq!(sql_state(&err).as_deref(), Some("42501"), "{ddl}: {err}");
    }
    // Serve's own statements: rows, the intents' identity sequence, the
    // write guard, NOTIFY, the schema check.
    insert_run(&db, "r1").await;
    let intent: i64 = sqlx::query_scalar(
        "INSERT INTO eec_effect_intent (run_id, seq, effect_index, idempotency_key, \
             tenant_scope, topic, message_key, headers, payload, ce_type, not_before) \
         VALUES ('r1', 1, 0, 'r1/1/0', 't', 'ductor.events', '', '{}', '', 'x', now()) \
         RETURNING intent_id",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the application role inserts an intent");
    assert!(intent >= 1);
    sqlx::query("SELECT ductor_write_guard(ARRAY[1]::bigint[], ARRAY[1]::bigint[]), pg_notify('ductor_effect_intent', '')")
        .execute(&db.pool)
        .await
        .expect("the write guard and NOTIFY");
    ductor::infra::db::check_migrated(&db.pool)
        .await
        .expect("the application role reads the applied migrations");
    // A table a later migration makes is not the application role's until
    // `ductor migrate` grants it (no default privileges; tests/roles.rs
    // holds the rest of what the role may not do), and never its to change.
    sqlx::raw_sql("CREATE TABLE later_migration (n int)")
        .execute(&db.owner)
        .await
        .unwrap();
    let err = sqlx::query("INSERT INTO later_migration VALUES (1)")
        .execute(&db.pool)
        .await
        .expect_err("a later table gets no rows by default");
    assert_eq!(sql_state(&err).as_deref(), Some("42501"), "{err}");
    let err = sqlx::raw_sql("DROP TABLE later_migration")
        .execute(&db.pool)
        .await
        .expect_err("a later table is not the application role's");
    assert_eq!(sql_state(&err).as_deref(), Some("42501"), "{err}");
    db.drop_db().await;
}

/// A `serve` that does not migrate (the default) refuses a schema that
/// lacks one of its migrations, naming it and the command that fixes it.
#[tokio::test]
async fn serve_refuses_a_schema_without_all_its_migrations() {
    let db = TestDb::migrated().await;
    let last = ductor::infra::db::MIGRATOR
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(last)
        .execute(&db.owner)
        .await
        .unwrap();
    let config = test_config(&db);
    assert!(
        !config.database.migrate_on_start,
        "serve does not migrate by default"
    );
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let listeners = ductor::cli::serve::Listeners::bind(&config.server)
        .await
        .unwrap();
    let serve = ductor::cli::serve::run_on(config, listeners, CancellationToken::new());
    let refused = tokio::time::timeout(Duration::from_secs(60), serve)
        .await
        .expect("serve stops at once")
        .expect_err("serve refuses the schema");
    let message = format!("{refused:#}");
    assert!(
        message.contains(&last.to_string()) && message.contains("ductor migrate"),
        "{message}"
    );
    db.drop_db().await;
}

/// `serve` refuses to start when a topic it produces to takes smaller
/// records than its producers may send, naming the topic and its limit.
#[tokio::test]
async fn serve_refuses_a_topic_that_takes_smaller_records_than_the_producers_send() {
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    assert!(
        ductor::infra::kafka::topics_below_limit(&config.kafka, &config.all_topics())
            .await
            .unwrap()
            .is_empty(),
        "the broker's default takes the default limit"
    );
    let events = config.topic_names().events();
    set_topic_limit(&config.kafka, &events, 65_536).await;
    let listeners = ductor::cli::serve::Listeners::bind(&config.server)
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let serve = ductor::cli::serve::run_on(config.clone(), listeners, shutdown.clone());
    let refused = tokio::time::timeout(Duration::from_secs(60), serve)
        .await
        .expect("serve stops at once")
        .expect_err("serve refuses the configuration");
    let message = format!("{refused:#}");
    assert!(
        message.contains(&format!("{events} takes 65536")),
        "{message}"
    );
    db.drop_db().await;
}

/// A configuration whose largest input could not be published inside an
/// effect is refused, with the reason.
#[test]
fn an_input_limit_that_leaves_no_room_for_the_envelope_is_refused() {
    let refused = ductor::config::Config::load_from(
        None,
        vec![(
            "DUCTOR__COORDINATOR__MAX_INPUT_BYTES".to_string(),
            "1048576".to_string(),
        )],
    )
    .expect_err("no room for the envelope");
    let message = refused.to_string();
    assert!(
        message.contains("coordinator.max_input_bytes")
            && message.contains("kafka.message_max_bytes"),
        "{message}"
    );
}

/// `serve` answers on two listeners: the public one carries the API, the
/// liveness and a readiness that is a bare verdict; the admin one carries
/// the metrics and the readiness with every check's result. Neither
/// answers the other's endpoints.
#[tokio::test]
async fn serve_keeps_metrics_and_readiness_detail_on_the_admin_listener() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    config.drainer.enabled = false;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    // Returns once serve's verdict is ready: the one both /readyz answer.
    let serve = Running::start(&config).await;
    let (public, admin) = (serve.addr, serve.admin);
    assert_ne!(public, admin);
    let wait = Duration::from_secs(60);
    let (status, public_ready) = http(public, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&public_ready));
    let public_ready: serde_json::Value = serde_json::from_slice(&public_ready).unwrap();
    assert_eq!(
        public_ready,
        serde_json::json!({"status": "ready"}),
        "the verdict alone"
    );
    assert_eq!(http(public, "GET", "/healthz", &[], b"").await.0, 200);
    assert_eq!(http(public, "GET", "/metrics", &[], b"").await.0, 404);

    let (status, detailed) = http(admin, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&detailed));
    let detailed: serde_json::Value = serde_json::from_slice(&detailed).unwrap();
    assert_eq!(detailed["status"], "ready");
    for check in ["postgres", "kafka", "ingress"] {
        assert_eq!(detailed[check]["ok"], true, "{check}: {detailed}");
    }
    assert_eq!(http(admin, "GET", "/healthz", &[], b"").await.0, 200);
    let metrics = eventually("the admin /metrics has the ingress gauge", wait, || async {
        let (status, body) = http(admin, "GET", "/metrics", &[], b"").await;
        let text = String::from_utf8_lossy(&body).into_owned();
        (status == 200 && text.contains("ductor_ingress_stalled_lanes")).then_some(text)
    })
    .await;
    assert!(
        metrics.lines().any(|l| l.starts_with("# TYPE ductor_")),
        "a Prometheus text exposition: {metrics}"
    );
    // The API's starts are on the public listener only: the admin one
    // serves the operator's views of /v1/runs, never a start.
    let (status, _) = http(
        admin,
        "POST",
        "/v1/runs",
        &[],
        b"{\"workflow\":\"example\"}",
    )
    .await;
    assert_eq!(status, 405, "the admin listener takes no start");

    serve.stop().await;
    db.drop_db().await;
}

/// With the database unreachable, the public readiness says not ready and
/// nothing else; the admin readiness names the failing check and its error.
#[tokio::test]
async fn public_readiness_tells_no_error_when_the_database_is_unreachable() {
    // Nothing listens on the port of a listener that was just dropped.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&format!("postgres://ductor:hunter2@{closed}/nowhere"))
        .unwrap();
    let kafka_probe: rdkafka::consumer::BaseConsumer =
        ductor::infra::kafka::consumer_config(&kafka_config(), &unique("probe-"), "probe")
            .create()
            .unwrap();
    let probes = ductor::infra::health::Probes {
        pool,
        kafka_probe: std::sync::Arc::new(kafka_probe),
        timeout: Duration::from_secs(2),
        ingress: None,
        ingress_hold: Default::default(),
    };
    let verdict = ductor::infra::health::Verdict::new();
    verdict.publish(ductor::infra::health::check_readiness(&probes).await);
    let state = ductor::infra::health::HttpState {
        verdict,
        warnings: std::sync::Arc::new([]),
    };
    let shutdown = CancellationToken::new();
    let public = serve_router(
        ductor::infra::health::public_router(state.clone()),
        &shutdown,
    )
    .await;
    let admin = serve_router(ductor::infra::health::admin_router(state, None), &shutdown).await;

    let (status, body) = http(public, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 503);
    let text = String::from_utf8_lossy(&body);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        serde_json::json!({"status": "not_ready"}),
        "no check and no error on the public listener: {text}"
    );

    let (status, body) = http(admin, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 503);
    let detailed: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(detailed["status"], "not_ready");
    assert_eq!(detailed["postgres"]["ok"], false, "{detailed}");
    assert!(
        detailed["postgres"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "the admin readiness says why: {detailed}"
    );
    assert_eq!(detailed["kafka"]["ok"], true, "{detailed}");
    shutdown.cancel();
}

/// Serves `router` on a fresh loopback port until `shutdown`.
async fn serve_router(router: axum::Router, shutdown: &CancellationToken) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    });
    addr
}
