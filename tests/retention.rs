//! Retention of finished runs against the real stack: `serve`'s maintenance
//! loop deletes the runs that ended before `runs.retention_ms`, with their
//! transitions and attempts, in batches, and leaves a tombstone; a late
//! input for a purged run changes nothing (a start with another request is
//! refused as before), `inspect run` and `GET /v1/runs/{id}` say the run
//! was purged, and tombstones expire in turn.

mod common;

use std::time::Duration;

use common::*;
use ductor::auth::Scope;
use ductor::config::Config;
use rdkafka::Message;
use rdkafka::message::Headers;
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const RETENTION_MS: u64 = 60_000;

fn start(run_id: &str, input: Value) -> Vec<u8> {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
        "workflow": "example", "input": input,
    })
    .to_string()
    .into_bytes()
}

fn cancel(run_id: &str) -> Vec<u8> {
    json!({"type": "wakeup.cancel", "schema_version": 1, "run_id": run_id, "tenant": "acme"})
        .to_string()
        .into_bytes()
}

fn signal(run_id: &str) -> Vec<u8> {
    json!({
        "type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": "acme",
        "signal_id": "late", "name": "poke",
    })
    .to_string()
    .into_bytes()
}

async fn rows(db: &TestDb, table: &str, ids: &[String]) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE run_id = ANY($1)"
    ))
    .bind(ids)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Produces `value` and waits until the coordinator has committed past it.
async fn applied(p: &FutureProducer, config: &Config, topic: &str, key: &str, value: &[u8]) {
    let (partition, offset) = produce(p, topic, key, value, &[]).await;
    let group = &config.kafka.group_id;
    committed_past(
        "the coordinator passed the input",
        group,
        topic,
        partition,
        offset,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn finished_runs_are_purged_in_batches_and_stay_purged() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    config.runs.retention_ms = RETENTION_MS;
    config.runs.tombstone_retention_ms = 2 * RETENTION_MS;
    config.runs.purge_interval_ms = 100;
    config.runs.purge_batch = 2;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let serve = Running::start(&config).await;
    let (addr, admin) = (serve.addr, serve.admin);
    let purged_before = metric(admin, &[], "ductor_runs_purged_total", "").await;

    // Seven runs: five cancelled long ago, one cancelled just now, one
    // still running (no worker answers its step).
    let p = producer();
    let ids: Vec<String> = (0..7).map(|i| format!("ret-{i}-{}", unique("r"))).collect();
    let (old, young, running) = (&ids[..5], &ids[5], &ids[6]);
    let names = config.topic_names();
    let (requests, wakeups) = (names.requests(), names.wakeups());
    for (i, id) in ids.iter().enumerate() {
        produce(&p, &requests, id, &start(id, json!({"n": i})), &[]).await;
    }
    // A cancel that overtook its start would name no run yet.
    eventually("seven runs started", WAIT, || async {
        (rows(&db, "runs", &ids).await == 7).then_some(())
    })
    .await;
    for id in &ids[..6] {
        produce(&p, &wakeups, id, &cancel(id), &[]).await;
    }
    eventually("six runs cancelled", WAIT, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM runs WHERE run_id = ANY($1) AND status = 'cancelled'",
        )
        .bind(&ids)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (n == 6).then_some(())
    })
    .await;
    let old_ids = old.to_vec();
    assert_eq!(rows(&db, "run_transitions", &old_ids).await, 10);
    assert_eq!(rows(&db, "run_attempts", &old_ids).await, 5);
    sqlx::query(
        "UPDATE runs SET finished_at = finished_at - interval '2 minutes' WHERE run_id = ANY($1)",
    )
    .bind(&old_ids)
    .execute(&db.pool)
    .await
    .unwrap();

    // Three statements of at most two runs each delete the five; the young
    // and the running one stay.
    eventually("the old runs purged", WAIT, || async {
        (rows(&db, "runs", &old_ids).await == 0).then_some(())
    })
    .await;
    assert_eq!(rows(&db, "run_transitions", &old_ids).await, 0);
    assert_eq!(rows(&db, "run_attempts", &old_ids).await, 0);
    assert_eq!(rows(&db, "run_tombstones", &old_ids).await, 5);
    assert_eq!(
        rows(&db, "runs", &[young.clone(), running.clone()]).await,
        2
    );
    let purged = metric(admin, &[], "ductor_runs_purged_total", "").await - purged_before;
    assert_eq!(purged, 5.0, "ductor_runs_purged_total moved by {purged}");
    // The kept counts of runs by status lost the purged ones too.
    let kept: i64 = sqlx::query_scalar("SELECT COALESCE(sum(n), 0)::int8 FROM run_counts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kept, 2, "run_counts after the purge");

    // Late inputs for a purged run: the same start, a signal, a cancel
    // change nothing; a start with another request is dead-lettered as
    // before the purge.
    let dlq = reader(&[&names.dead_letters()]);
    let gone = &old[0];
    // The outbox's own retention deletes drained intents sooner than runs
    // are purged (`drainer.retention_ms`, 1 day): nothing of the run is
    // left but its tombstone.
    sqlx::query("DELETE FROM eec_effect_intent WHERE run_id = $1")
        .bind(gone)
        .execute(&db.pool)
        .await
        .unwrap();
    applied(&p, &config, &requests, gone, &start(gone, json!({"n": 0}))).await;
    applied(&p, &config, &wakeups, gone, &signal(gone)).await;
    applied(&p, &config, &wakeups, gone, &cancel(gone)).await;
    applied(
        &p,
        &config,
        &requests,
        gone,
        &start(gone, json!({"n": "else"})),
    )
    .await;
    let letters = read_n(&dlq, 1, WAIT).await;
    let class = letters[0]
        .headers()
        .and_then(|h| {
            (0..h.count())
                .map(|i| h.get(i))
                .find(|h| h.key == "ductor-dlq-error-class")
        })
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned());
    assert_eq!(class.as_deref(), Some("idempotency_mismatch"));
    assert_eq!(letters[0].key(), Some(gone.as_bytes()));
    assert_eq!(rows(&db, "runs", std::slice::from_ref(gone)).await, 0);
    assert_eq!(
        rows(&db, "run_transitions", std::slice::from_ref(gone)).await,
        0
    );

    // Both views say the run was purged.
    let inspected = ductor::cli::inspect::run(&db.pool, gone)
        .await
        .unwrap()
        .expect("a purged run is still known");
    assert_eq!(inspected["purged"], true, "{inspected}");
    assert_eq!(inspected["status"], "cancelled");
    assert_eq!(inspected["last_transition_seq"], 2);
    let token = api_key(&db, "acme", &[Scope::RunsRead]).await;
    let auth = bearer(&token);
    let path = format!("/v1/runs/{gone}");
    let (status, body) = http(addr, "GET", &path, &[(auth.0, &auth.1)], b"").await;
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 410, "{body}");
    assert_eq!(body["error"]["code"], "run_purged");
    let (status, _) = http(
        addr,
        "GET",
        "/v1/runs/no-such-run",
        &[(auth.0, &auth.1)],
        b"",
    )
    .await;
    assert_eq!(status, 404);
    // Another tenant learns nothing of it, not even that it was purged.
    let other = api_key(&db, "globex", &[Scope::RunsRead]).await;
    let other = bearer(&other);
    let (status, body) = http(addr, "GET", &path, &[(other.0, &other.1)], b"").await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));

    // Tombstones expire after their own retention (aged as the owner:
    // serve's role may only read them).
    sqlx::query(
        "UPDATE run_tombstones SET purged_at = purged_at - interval '3 minutes' \
         WHERE run_id = ANY($1)",
    )
    .bind(&old_ids[1..])
    .execute(&db.owner)
    .await
    .unwrap();
    eventually("the aged tombstones expired", WAIT, || async {
        (rows(&db, "run_tombstones", &old_ids).await == 1).then_some(())
    })
    .await;
    assert_eq!(
        rows(&db, "run_tombstones", std::slice::from_ref(gone)).await,
        1
    );

    serve.stop().await;
    db.drop_db().await;
}
