//! The stack and the schema: a Kafka round trip, migrations on a fresh
//! database, and the constraints that make duplicates impossible.

mod common;

use std::time::Duration;

use common::*;
use rdkafka::message::{Headers, Message};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn kafka_round_trip_through_a_random_topic() {
    let topic = unique("roundtrip-");
    let outcomes = ductor::kafka::ensure_topics(&kafka_config(), std::slice::from_ref(&topic), 1)
        .await
        .expect("creating topic");
    assert_eq!(outcomes.len(), 1);
    assert!(outcomes[0].created, "a random topic is new");
    // Creating it again is not an error: `topics create` is idempotent.
    let again = ductor::kafka::ensure_topics(&kafka_config(), std::slice::from_ref(&topic), 1)
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

#[tokio::test]
async fn migrations_apply_to_a_fresh_database_and_are_idempotent() {
    let db = TestDb::empty().await;
    ductor::db::migrate(&db.pool)
        .await
        .expect("first migration");
    ductor::db::migrate(&db.pool)
        .await
        .expect("second migration is a no-op");
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
    // The history is append-only.
    let err = sqlx::query("UPDATE run_transitions SET kind = 'x' WHERE run_id = 'r1'")
        .execute(&db.pool)
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

/// `serve` refuses to start when a topic it produces to takes smaller
/// records than its producers may send, naming the topic and its limit.
#[tokio::test]
async fn serve_refuses_a_topic_that_takes_smaller_records_than_the_producers_send() {
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    ductor::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    assert!(
        ductor::kafka::topics_below_limit(&config.kafka, &config.all_topics())
            .await
            .unwrap()
            .is_empty(),
        "the broker's default takes the default limit"
    );
    let events = config.events_topic();
    set_topic_limit(&config.kafka, &events, 65_536).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shutdown = CancellationToken::new();
    let serve = ductor::serve::run_on(config.clone(), listener, shutdown.clone());
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
