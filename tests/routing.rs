//! The routing plane: one decision per (tenant, pool, idempotency key),
//! over HTTP and over Kafka, through crashes, sweeps, TTLs and retention.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use ductor::apply::Applier;
use ductor::auth::Scope;
use ductor::config::{Config, DuplicatePolicy, PoolRouting};
use ductor::contract::headers::{DLQ_CLASS, DLQ_OFFSET};
use ductor::infra::crash::CrashPoint;
use ductor::ingress::IngressContext;
use ductor::routing::{Reservation, RouteOutcome};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

struct Env {
    db: TestDb,
    config: Config,
}

struct Server {
    addr: SocketAddr,
    /// The API as tenant `acme`.
    api: Api,
    /// The admin listener: metrics and the detailed readiness.
    admin: SocketAddr,
    running: Running,
}

impl Server {
    async fn stop(self) {
        self.running.stop().await;
    }
}

impl Env {
    async fn new(tweak: impl FnOnce(&mut Config)) -> Env {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        // These tests look at routing only; the drainer stays out of the way.
        config.drainer.enabled = false;
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        Env { db, config }
    }

    async fn serve(&self) -> Server {
        let running = Running::start(&self.config).await;
        Server {
            addr: running.addr,
            api: Api {
                addr: running.addr,
                token: leak(api_key(&self.db, "acme", &ALL_SCOPES).await),
            },
            admin: running.admin,
            running,
        }
    }

    fn applier(&self) -> Applier {
        let workflows = ductor::infra::workflows::load_dir(&self.config.coordinator.workflows_dir)
            .expect("loading workflows");
        Applier::new(&self.config, self.db.pool.clone(), workflows)
    }

    async fn runs(&self) -> i64 {
        self.db.count("runs").await
    }
}

const ALL_SCOPES: [Scope; 2] = [Scope::RunsWrite, Scope::RunsRead];

/// The public API as one tenant: its address and that tenant's key.
#[derive(Clone, Copy)]
struct Api {
    addr: SocketAddr,
    token: &'static str,
}

impl Api {
    /// The same server as another tenant, with a key of its own.
    async fn as_tenant(self, env: &Env, tenant: &str) -> Api {
        Api {
            token: leak(api_key(&env.db, tenant, &ALL_SCOPES).await),
            ..self
        }
    }

    /// `GET path` with this tenant's key.
    async fn get(self, path: &str) -> (u16, Vec<u8>) {
        let auth = bearer(self.token);
        http(self.addr, "GET", path, &[(auth.0, &auth.1)], b"").await
    }
}

/// Keeps a test's key for the rest of the test process, so that [`Api`]
/// stays `Copy` across the concurrent requests of a test.
fn leak(token: String) -> &'static str {
    Box::leak(token.into_boxed_str())
}

fn body(input: Value, tenant: &str) -> Vec<u8> {
    json!({"workflow": "example", "tenant": tenant, "input": input})
        .to_string()
        .into_bytes()
}

async fn post(api: Api, key: Option<&str>, body: &[u8]) -> (u16, Value, Vec<u8>) {
    let auth = bearer(api.token);
    let mut headers: Vec<(&str, &str)> = vec![(auth.0, &auth.1)];
    headers.extend(key.map(|k| ("Idempotency-Key", k)));
    let (status, raw) = http(api.addr, "POST", "/v1/runs", &headers, body).await;
    let value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    (status, value, raw)
}

#[tokio::test]
async fn a_hundred_concurrent_requests_with_one_key_make_one_run_and_identical_answers() {
    let env = Env::new(|_| {}).await;
    let server = env.serve().await;
    let addr = server.api;
    let request = body(json!({"order": 1}), "acme");
    let answers = futures::future::join_all((0..100).map(|_| {
        let request = request.clone();
        async move { post(addr, Some("order-1"), &request).await }
    }))
    .await;
    let created = answers.iter().filter(|a| a.0 == 201).count();
    let duplicates = answers.iter().filter(|a| a.0 == 200).count();
    assert_eq!(
        (created, duplicates),
        (1, 99),
        "statuses: {:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    let first = &answers[0].2;
    assert!(
        answers.iter().all(|a| &a.2 == first),
        "every caller gets the same bytes"
    );
    assert_eq!(env.runs().await, 1, "one decision");
    let run_id = answers[0].1["run_id"].as_str().unwrap().to_string();
    let status: String = sqlx::query_scalar(
        "SELECT status FROM eec_routing_idempotency WHERE idempotency_key = 'order-1'",
    )
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(status, "completed");
    let (code, run) = {
        let (code, raw) = addr.get(&format!("/v1/runs/{run_id}")).await;
        (code, serde_json::from_slice::<Value>(&raw).unwrap())
    };
    assert_eq!(code, 200);
    assert_eq!(run["run_id"], run_id.as_str());
    assert_eq!(run["workflow"], "example");
    server.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn the_same_keyed_request_through_kafka_redelivered_after_a_crash_makes_one_run() {
    let env = Env::new(|_| {}).await;
    let workflows =
        ductor::infra::workflows::load_dir(&env.config.coordinator.workflows_dir).unwrap();
    let mut crashing =
        IngressContext::new(&env.config, env.db.pool.clone(), workflows.clone()).unwrap();
    crashing.crash.arm(CrashPoint::IngressAfterCommit);
    ductor::ingress::subscribe(&crashing).unwrap();
    let producer = producer();
    let requests = env.config.topic_names().requests();
    let key = unique("k-");
    // Both requests share a Kafka key, so they land on one partition in order.
    let keyed = json!({"type": "run.start", "schema_version": 1, "tenant": "acme",
                       "workflow": "example", "idempotency_key": "kafka-key-1",
                       "correlation_id": "corr-1", "input": {"n": 1}});
    let unkeyed = json!({"type": "run.start", "schema_version": 1, "tenant": "acme",
                         "workflow": "example", "correlation_id": "corr-2", "input": {"n": 2}});
    produce(
        &producer,
        &requests,
        &key,
        keyed.to_string().as_bytes(),
        &[],
    )
    .await;
    let (partition, last) = produce(
        &producer,
        &requests,
        &key,
        unkeyed.to_string().as_bytes(),
        &[],
    )
    .await;
    // The hook stops the ingress after its first commit.
    let shutdown = CancellationToken::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the requests were not read within {WAIT:?}"
        );
        match ductor::ingress::step(&crashing, INGRESS_STEP_WAIT, &shutdown).await {
            Ok(None) => {}
            Ok(Some(report)) => panic!("the hook lets no batch through: {report:?}"),
            Err(_) => break,
        }
    }
    // Leaves the group as the loop does when it fails.
    ductor::ingress::close(&crashing);
    drop(crashing);
    // The first commit may have held one or both requests; a second pass
    // decides both, the redelivered ones included, before comparing.
    let restarted = IngressContext::new(&env.config, env.db.pool.clone(), workflows).unwrap();
    ductor::ingress::subscribe(&restarted).unwrap();
    step_through(&restarted, &requests, &[(partition, last)], WAIT).await;
    ductor::ingress::close(&restarted);
    let group = &env.config.kafka.group_id;
    assert!(
        committed(group, &requests, partition).await > last,
        "offsets committed past the requests"
    );
    assert_eq!(
        env.runs().await,
        2,
        "one run per request, redelivery or not"
    );
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT idempotency_key FROM eec_routing_idempotency WHERE status = 'completed' ORDER BY 1",
    )
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys.contains(&"kafka-key-1".to_string()));
    assert!(
        keys.iter().any(|k| k.starts_with("kafka:")),
        "a request without a key is keyed by its position: {keys:?}"
    );
    // Each caller learns its decision from a run.accepted event with its
    // correlation id.
    let accepted: Vec<Value> = sqlx::query_scalar(
        "SELECT convert_from(payload, 'UTF8')::jsonb FROM eec_effect_intent \
         WHERE ce_type = 'ductor.run.accepted' ORDER BY intent_id",
    )
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(accepted.len(), 2);
    let correlations: Vec<&str> = accepted
        .iter()
        .map(|a| a["correlation_id"].as_str().unwrap())
        .collect();
    assert!(correlations.contains(&"corr-1") && correlations.contains(&"corr-2"));
    env.db.drop_db().await;
}

#[tokio::test]
async fn a_kafka_start_whose_key_an_http_caller_holds_is_parked_and_its_lane_goes_on() {
    let env = Env::new(|_| {}).await;
    let workflows =
        ductor::infra::workflows::load_dir(&env.config.coordinator.workflows_dir).unwrap();
    // An HTTP caller holds the key, still deciding, for longer than the
    // test waits: a lane that waits behind it never gets to the rest.
    let body = json!({"workflow": "example", "tenant": "acme", "input": {"n": 1}});
    let http_caller =
        ductor::api::start::route_request_from_body(body, Some("held-key".into())).unwrap();
    let epoch = ductor::routing::reserve(
        &env.db.pool,
        "acme",
        "default",
        "held-key",
        &http_caller.fingerprint,
        Duration::from_secs(600),
    )
    .await
    .unwrap()
    .expect("the HTTP caller takes the key");
    let shutdown = CancellationToken::new();
    let ctx = IngressContext::new(&env.config, env.db.pool.clone(), workflows.clone()).unwrap();
    let ingress = tokio::spawn(ductor::ingress::run(ctx, shutdown.clone()));
    // One Kafka key, so one partition and one lane: the same request with
    // the held key, twenty other starts, the held key again for another
    // request.
    let producer = producer();
    let names = env.config.topic_names();
    let requests = names.requests();
    let start = |key: Option<&str>, n: u64| {
        let mut start = json!({"type": "run.start", "schema_version": 1, "tenant": "acme",
                               "workflow": "example", "input": {"n": n}});
        if let Some(key) = key {
            start["idempotency_key"] = json!(key);
        }
        start.to_string().into_bytes()
    };
    let (partition, held_at) =
        produce(&producer, &requests, "k", &start(Some("held-key"), 1), &[]).await;
    for n in 0..20 {
        produce(&producer, &requests, "k", &start(None, 100 + n), &[]).await;
    }
    let (_, reused_at) = produce(&producer, &requests, "k", &start(Some("held-key"), 2), &[]).await;
    // A poll: the lanes going on beside a start parked for a key an HTTP
    // caller holds are the subject.
    eventually("the starts behind the held key applied", WAIT, || async {
        (env.runs().await == 20).then_some(())
    })
    .await;
    let status: String = sqlx::query_scalar(
        "SELECT status FROM eec_routing_idempotency WHERE idempotency_key = 'held-key'",
    )
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(status, "pending", "the HTTP caller still holds its key");
    // Stopping commits what the ingress stored: never past the parked start.
    shutdown.cancel();
    ingress.await.unwrap().unwrap();
    let group = &env.config.kafka.group_id;
    let committed = committed(group, &requests, partition).await;
    assert_eq!(
        committed, held_at,
        "the parked start is read again after a restart"
    );
    // The HTTP caller decides; a restarted ingress reads the parked start
    // again (and the twenty, which change nothing now).
    let mut decided = http_caller;
    decided.reservation = Reservation::Held { epoch };
    let report = env.applier().apply(&[], &[decided]).await.unwrap();
    let RouteOutcome::Decided { decision, .. } = &report.routed[0] else {
        panic!("the HTTP caller decides: {:?}", report.routed);
    };
    let shutdown = CancellationToken::new();
    let ctx = IngressContext::new(&env.config, env.db.pool.clone(), workflows).unwrap();
    let restarted = tokio::spawn(ductor::ingress::run(ctx, shutdown.clone()));
    let dlq = reader(&[&names.dead_letters()]);
    let letters = read_n(&dlq, 1, WAIT).await;
    let header = |name: &str| {
        use rdkafka::message::{Headers, Message};
        let headers = letters[0].headers()?;
        let value = headers.iter().find(|h| h.key == name)?.value?;
        Some(String::from_utf8(value.to_vec()).unwrap())
    };
    assert_eq!(
        (header(DLQ_OFFSET), header(DLQ_CLASS)),
        (
            Some(reused_at.to_string()),
            Some("idempotency_mismatch".to_string())
        ),
        "the key reused for another request is refused once its holder decides"
    );
    let passed = "the partition's offset passes every start";
    committed_past(passed, group, &requests, partition, reused_at).await;
    shutdown.cancel();
    restarted.await.unwrap().unwrap();
    assert_eq!(
        env.runs().await,
        21,
        "the twenty and the HTTP caller's run: the parked start is its duplicate"
    );
    let held_runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id = $1")
        .bind(&decision.run_id)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert_eq!(held_runs, 1, "the HTTP caller's decision stands");
    env.db.drop_db().await;
}

#[tokio::test]
async fn killed_after_reserve_the_row_is_swept_and_reclaimed_and_the_late_caller_cannot_complete() {
    let env = Env::new(|c| c.routing.pending_ttl_ms = 200).await;
    let applier = env.applier();
    let late = ductor::api::start::route_request_from_body(
        json!({"workflow": "example", "tenant": "acme", "input": {"x": 1}}),
        Some("swept-key".into()),
    )
    .unwrap();
    // The first caller reserves, then dies before deciding. Its
    // reservation's TTL is over at once, as a dead caller's is by the time
    // a sweep comes.
    let epoch = ductor::routing::reserve(
        &env.db.pool,
        "acme",
        "default",
        "swept-key",
        &late.fingerprint,
        Duration::ZERO,
    )
    .await
    .unwrap()
    .expect("the first caller wins the key");
    // The sweeper marks the expired reservation failed.
    let swept = ductor::routing::retention::sweep(&env.db.pool, 100)
        .await
        .unwrap();
    assert_eq!(swept, 1, "the pending row is swept");
    // The next caller reclaims the key and decides.
    let next = ductor::api::start::route_request_from_body(
        json!({"workflow": "example", "tenant": "acme", "input": {"x": 1}}),
        Some("swept-key".into()),
    )
    .unwrap();
    let submitted = ductor::api::start::submit(&applier, &env.config.routing, next)
        .await
        .expect("the next caller gets a decision");
    let ductor::api::start::Submitted::Created(decision) = submitted else {
        panic!("a reclaimed key is a new decision: {submitted:?}");
    };
    let new_epoch: i64 = sqlx::query_scalar(
        "SELECT claim_epoch FROM eec_routing_idempotency WHERE idempotency_key = 'swept-key'",
    )
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert!(new_epoch > epoch, "a reclaim bumps the claim epoch");
    // The late first caller comes back with its old epoch: it cannot complete.
    let mut late = late;
    late.reservation = Reservation::Held { epoch };
    let report = applier.apply(&[], &[late]).await.unwrap();
    assert_eq!(report.routed, vec![RouteOutcome::ClaimLost]);
    assert_eq!(env.runs().await, 1, "only the new owner's decision exists");
    let decided: String = sqlx::query_scalar(
        "SELECT decision_id FROM eec_routing_idempotency WHERE idempotency_key = 'swept-key'",
    )
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(decided, decision.run_id);
    env.db.drop_db().await;
}

#[tokio::test]
async fn ttl_expiry_gives_a_new_decision_and_retention_never_deletes_pending_rows() {
    let env = Env::new(|c| c.routing.completed_ttl_ms = 300).await;
    let server = env.serve().await;
    let request = body(json!({"ttl": true}), "acme");
    let (code, first, _) = post(server.api, Some("ttl-key"), &request).await;
    assert_eq!(code, 201);
    let (code, again, _) = post(server.api, Some("ttl-key"), &request).await;
    assert_eq!((code, &again["run_id"]), (200, &first["run_id"]));
    // A poll: only Postgres's clock ends the decision's TTL.
    eventually("the decision expires", WAIT, || async {
        let expired: bool = sqlx::query_scalar(
            "SELECT expires_at <= now() FROM eec_routing_idempotency WHERE idempotency_key = 'ttl-key'",
        )
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        expired.then_some(())
    })
    .await;
    let (code, renewed, _) = post(server.api, Some("ttl-key"), &request).await;
    assert_eq!(code, 201, "an expired decision is replaced: {renewed}");
    assert_ne!(renewed["run_id"], first["run_id"]);
    server.stop().await;

    // Retention: long-dead rows go, pending rows stay however old they are.
    sqlx::query(
        "INSERT INTO eec_routing_idempotency (tenant_scope, pool_id, idempotency_key, status, \
             request_fingerprint, reserved_at, pending_expires_at, updated_at) VALUES \
         ('acme', 'default', 'old-pending', 'pending', 'fp', now() - interval '30 days', \
             now() - interval '30 days', now() - interval '30 days'), \
         ('acme', 'default', 'old-failed', 'failed_before_commit', 'fp', now() - interval '30 days', \
             now() - interval '30 days', now() - interval '30 days')",
    )
    .execute(&env.db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE eec_routing_idempotency SET expires_at = now() - interval '30 days' \
         WHERE idempotency_key = 'ttl-key'",
    )
    .execute(&env.db.pool)
    .await
    .unwrap();
    let purged =
        ductor::routing::retention::purge(&env.db.pool, Duration::from_secs(86_400), 1, 100)
            .await
            .unwrap();
    assert_eq!(
        purged, 2,
        "the failed row and the long-expired completed row"
    );
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT idempotency_key, status FROM eec_routing_idempotency ORDER BY 1")
            .fetch_all(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        vec![("old-pending".to_string(), "pending".to_string())]
    );
    env.db.drop_db().await;
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_rejected_empty_keys_opt_out_and_tenants_are_isolated()
{
    let env = Env::new(|_| {}).await;
    let server = env.serve().await;
    let addr = server.api;
    let (code, original, _) = post(
        addr,
        Some("shared"),
        &body(json!({"secret": "first-payload"}), "acme"),
    )
    .await;
    assert_eq!(code, 201);

    let (code, mismatch, raw) = post(
        addr,
        Some("shared"),
        &body(json!({"secret": "other"}), "acme"),
    )
    .await;
    assert_eq!(code, 422);
    assert_eq!(mismatch["error"]["code"], "idempotency_key_mismatch");
    assert!(
        !String::from_utf8_lossy(&raw).contains("first-payload"),
        "the earlier request is not echoed"
    );

    // An envelope field (the correlation id) is not part of the request.
    let with_correlation = json!({"workflow": "example", "tenant": "acme",
        "input": {"secret": "first-payload"}, "correlation_id": "another"})
    .to_string();
    let (code, same, _) = post(addr, Some("shared"), with_correlation.as_bytes()).await;
    assert_eq!((code, &same["run_id"]), (200, &original["run_id"]));

    // Empty key: a fresh run every time.
    let unkeyed = body(json!({"n": 1}), "acme");
    let (c1, a, _) = post(addr, Some(""), &unkeyed).await;
    let (c2, b, _) = post(addr, None, &unkeyed).await;
    assert_eq!((c1, c2), (201, 201));
    assert_ne!(a["run_id"], b["run_id"]);

    // Another tenant with the same key and body gets its own decision and
    // cannot see the first tenant's run.
    let globex = addr.as_tenant(&env, "globex").await;
    let (code, other, _) = post(
        globex,
        Some("shared"),
        &body(json!({"secret": "first-payload"}), "globex"),
    )
    .await;
    assert_eq!(code, 201);
    assert_ne!(other["run_id"], original["run_id"]);
    let path = format!("/v1/runs/{}", original["run_id"].as_str().unwrap());
    assert_eq!(globex.get(&path).await.0, 404);
    assert_eq!(addr.get(&path).await.0, 200);
    assert_eq!(http(addr.addr, "GET", &path, &[], b"").await.0, 401);
    assert_eq!(env.runs().await, 4, "acme keyed, two unkeyed, globex keyed");
    server.stop().await;
    env.db.drop_db().await;
}

#[tokio::test]
async fn the_reject_policy_answers_in_progress_and_bad_requests_get_json_errors() {
    let env = Env::new(|c| {
        c.routing.pools.insert(
            "strict".into(),
            PoolRouting {
                duplicate_policy: Some(DuplicatePolicy::Reject),
                wait_timeout_ms: None,
            },
        );
        c.routing.max_body_bytes = 2048;
    })
    .await;
    let server = env.serve().await;
    let addr = server.api;
    let request = json!({"workflow": "example", "tenant": "acme", "pool": "strict", "input": 1});
    let fingerprint =
        ductor::api::start::route_request_from_body(request.clone(), Some("busy".into()))
            .unwrap()
            .fingerprint;
    // Another caller holds the key and has not decided.
    ductor::routing::reserve(
        &env.db.pool,
        "acme",
        "strict",
        "busy",
        &fingerprint,
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .unwrap();
    let (code, answer, _) = post(addr, Some("busy"), request.to_string().as_bytes()).await;
    assert_eq!(code, 409);
    assert_eq!(answer["error"]["code"], "in_progress");

    let (code, answer, _) = post(addr, None, b"{not json").await;
    assert_eq!(
        (code, answer["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    let (code, answer, _) = post(addr, None, &vec![b' '; 4096]).await;
    assert_eq!(
        (code, answer["error"]["code"].as_str()),
        (413, Some("body_too_large"))
    );
    let (code, answer, _) = post(addr, None, br#"{"workflow": "nope", "tenant": "acme"}"#).await;
    assert_eq!(
        (code, answer["error"]["code"].as_str()),
        (422, Some("unknown_workflow"))
    );
    let (code, answer, _) = post(addr, None, br#"{"tenant": "acme"}"#).await;
    assert_eq!(
        (code, answer["error"]["code"].as_str()),
        (400, Some("invalid"))
    );
    assert_eq!(env.runs().await, 0);
    assert_eq!(
        env.db.count("eec_routing_idempotency").await,
        1,
        "rejected requests reserve nothing"
    );
    server.stop().await;
    env.db.drop_db().await;
}

/// Valid JSON that Postgres could not store, or that would not be kept as
/// sent, is refused with a 422 and the screen's class, before anything is
/// reserved; the server goes on answering good requests.
#[tokio::test]
async fn hostile_json_bodies_get_a_422_with_their_class_and_reserve_nothing() {
    let env = Env::new(|_| {}).await;
    let server = env.serve().await;
    let addr = server.api;
    let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
    let cases: Vec<(&str, String)> = vec![
        (
            "nul_character",
            r#"{"workflow": "example", "input": {"note": "a\u0000b"}}"#.to_string(),
        ),
        (
            "nul_character",
            r#"{"workflow": "example", "input": {"k\u0000": 1}}"#.to_string(),
        ),
        (
            "nul_character",
            r#"{"workflow": "example", "correlation_id": "\u0000"}"#.to_string(),
        ),
        (
            "unpaired_surrogate",
            r#"{"workflow": "example", "input": "\ud800"}"#.to_string(),
        ),
        (
            "inexact_number",
            r#"{"workflow": "example", "input": 1e400}"#.to_string(),
        ),
        (
            "inexact_number",
            r#"{"workflow": "example", "input": 123456789012345678901234567890}"#.to_string(),
        ),
        (
            "duplicate_key",
            r#"{"workflow": "example", "workflow": "other"}"#.to_string(),
        ),
        (
            "too_deep",
            format!(r#"{{"workflow": "example", "input": {deep}}}"#),
        ),
    ];
    for (class, request) in &cases {
        let (code, answer, _) = post(addr, Some("hostile"), request.as_bytes()).await;
        assert_eq!(
            (code, answer["error"]["code"].as_str()),
            (422, Some(*class)),
            "{}",
            &request[..request.len().min(80)]
        );
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            !message.is_empty() && !message.contains("example"),
            "{message}"
        );
    }
    assert_eq!(env.db.count("eec_routing_idempotency").await, 0);
    let (code, _, _) = post(addr, Some("hostile"), &body(json!({"fine": true}), "acme")).await;
    assert_eq!(code, 201, "the same key is still free for a good request");
    assert_eq!(env.runs().await, 1);
    server.stop().await;
    env.db.drop_db().await;
}

/// A lane that holds a batch it cannot commit (here: a lock on `runs`
/// held by someone else) stalls its partitions; readiness says so, naming
/// the lane, and recovers once the batch commits.
#[tokio::test]
async fn a_stalled_apply_lane_makes_readiness_fail_until_its_batch_commits() {
    let env = Env::new(|c| c.coordinator.stall_after_ms = 500).await;
    let server = env.serve().await;
    let (public, admin) = (server.addr, server.admin);
    let ready = || async {
        let (code, body) = http(admin, "GET", "/readyz", &[], b"").await;
        (
            code,
            serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null),
        )
    };
    // `Env::serve` returns once serve says it is ready.
    assert_eq!(ready().await.0, 200, "serve is ready");
    // As the owner: serve's role may not take such a lock.
    let mut lock = env.db.owner.begin().await.unwrap();
    sqlx::query("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let run_id = unique("stalled-");
    produce(
        &producer(),
        &env.config.topic_names().requests(),
        &run_id,
        json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
               "tenant": "acme", "workflow": "example"})
        .to_string()
        .as_bytes(),
        &[],
    )
    .await;
    // A poll: serve's lane holds the batch on its own loop until it counts
    // as stalled.
    let stalled = eventually("readiness reports the stalled lane", WAIT, || async {
        let (code, body) = ready().await;
        (code == 503 && body["ingress"]["ok"] == false).then_some(body)
    })
    .await;
    let error = stalled["ingress"]["error"].as_str().unwrap();
    assert!(error.contains("lane"), "{error}");
    assert_eq!(stalled["postgres"]["ok"], true);
    // The public listener tells the verdict, not the lane or the error.
    let (code, body) = http(public, "GET", "/readyz", &[], b"").await;
    assert_eq!(code, 503);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap(),
        json!({"status": "not_ready"}),
        "{}",
        String::from_utf8_lossy(&body)
    );
    lock.rollback().await.unwrap();
    // A poll: serve's lane commits the held batch on its own loop.
    eventually("readiness recovers", WAIT, || async {
        (ready().await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(env.runs().await, 1, "the held batch committed");
    server.stop().await;
    env.db.drop_db().await;
}
