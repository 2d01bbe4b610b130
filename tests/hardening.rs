//! What an attacker who can reach the listeners, but holds no key, can do
//! to a running serve: flood `/readyz`, hold connections open, guess keys,
//! reach the admin listener. Against the real Postgres and Kafka; each
//! test would pass on a serve without the bound it checks only if that
//! bound were not needed.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::time::{Duration, Instant};

use common::Serve as Env;
use common::*;
use ductor::auth::Scope;
use ductor::config::AdminAuth;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(60);

impl Env {
    /// Puts `n` starts of the example workflow on the requests topic and
    /// waits until the ingress has made a run of each; how long that took.
    async fn load(&self, n: usize, tag: &str) -> Duration {
        let producer = producer();
        let began = Instant::now();
        let before = self.db.count("runs").await;
        for i in 0..n {
            let run_id = format!("{tag}-{i}");
            let start = json!({
                "type": "run.start", "schema_version": 1, "run_id": run_id,
                "tenant": "acme", "workflow": "example", "input": {"n": i},
            });
            produce(
                &producer,
                &self.config.topic_names().requests(),
                &run_id,
                start.to_string().as_bytes(),
                &[],
            )
            .await;
        }
        let target = before + n as i64;
        eventually("the ingress applies every start", WAIT, || async {
            (self.db.count("runs").await >= target).then_some(())
        })
        .await;
        began.elapsed()
    }
}

/// A connection that sends nothing: whether the server has closed it
/// within `within`.
async fn closed_by_server(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(within, stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Several hundred clients asking `/readyz` as fast as they can, and more
/// holding connections open, while a load goes through the ingress: the
/// load is applied whole, readiness is checked by its one task only (not
/// once per request), and the listener never holds more connections than
/// `server.max_connections`, closing the ones past it at once.
#[tokio::test]
async fn a_flood_of_readyz_and_idle_connections_costs_the_ingress_nothing() {
    const CLIENTS: usize = 300;
    const REQUESTS_EACH: usize = 10;
    const MAX_CONNECTIONS: usize = 400;
    const RUNS: usize = 400;
    let env = Env::start(|c| {
        c.server.readiness_interval_ms = 200;
        c.server.max_connections = MAX_CONNECTIONS;
        c.server.header_read_timeout_ms = 3_000;
    })
    .await;

    // The load alone, for the figures printed at the end.
    let alone = env.load(RUNS, "alone").await;

    let checks = "ductor_readiness_checks_total";
    let checks_before = metric(env.admin, &[], checks, "").await;
    let flood_began = Instant::now();
    let flood: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let addr = env.addr;
            tokio::spawn(async move {
                let mut answered = 0;
                for _ in 0..REQUESTS_EACH {
                    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
                        continue;
                    };
                    let request = "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
                    if stream.write_all(request.as_bytes()).await.is_err() {
                        continue;
                    }
                    let mut answer = Vec::new();
                    if stream.read_to_end(&mut answer).await.is_ok()
                        && answer.starts_with(b"HTTP/1.1 200")
                    {
                        answered += 1;
                    }
                }
                answered
            })
        })
        .collect();
    let flooded = env.load(RUNS, "flooded").await;
    let mut answered = 0;
    for client in flood {
        answered += client.await.unwrap();
    }
    let flood_took = flood_began.elapsed();
    let checks_after = metric(env.admin, &[], checks, "").await;
    let ran = checks_after - checks_before;
    // One check per interval, plus the rounds at either end.
    let allowed = (flood_took.as_millis() / 200) as f64 + 3.0;
    assert!(
        ran <= allowed,
        "{ran} readiness checks ran for {answered} answered requests in {flood_took:?}; \
         at most {allowed} should have"
    );
    assert!(
        answered > CLIENTS,
        "the flood was answered ({answered} of {})",
        CLIENTS * REQUESTS_EACH
    );

    // Idle connections up to the bound are held (until the head's timeout);
    // past it, each is closed as soon as it is accepted.
    let open = "ductor_http_open_connections";
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        held.push(tokio::net::TcpStream::connect(env.addr).await.unwrap());
    }
    eventually("the listener holds every idle connection", WAIT, || async {
        let n = metric(env.admin, &[], open, "listener=\"public\"").await;
        (n >= MAX_CONNECTIONS as f64).then_some(())
    })
    .await;
    let refused = "ductor_http_connections_refused_total";
    let refused_before = metric(env.admin, &[], refused, "listener=\"public\"").await;
    let mut extra = Vec::new();
    for _ in 0..50 {
        extra.push(tokio::net::TcpStream::connect(env.addr).await.unwrap());
    }
    for stream in &mut extra {
        assert!(
            closed_by_server(stream, Duration::from_secs(2)).await,
            "a connection past the bound is closed at once"
        );
    }
    let refused_after = metric(env.admin, &[], refused, "listener=\"public\"").await;
    assert!(refused_after - refused_before >= 50.0, "each counted");
    assert!(metric(env.admin, &[], open, "listener=\"public\"").await <= MAX_CONNECTIONS as f64);
    // The admin listener has its own bound: the operator still gets in.
    assert_eq!(http(env.admin, "GET", "/readyz", &[], b"").await.0, 200);
    // The held ones send no head, so the head's timeout closes them and
    // the listener takes new clients again.
    for stream in &mut held {
        assert!(closed_by_server(stream, WAIT).await);
    }
    eventually("the public listener answers again", WAIT, || async {
        (http(env.addr, "GET", "/readyz", &[], b"").await.0 == 200).then_some(())
    })
    .await;

    println!(
        "load of {RUNS} starts: {alone:?} alone, {flooded:?} under a flood of {CLIENTS} clients \
         ({answered} /readyz answered in {flood_took:?}, {ran} readiness checks); ratio {:.2}",
        flooded.as_secs_f64() / alone.as_secs_f64()
    );
    env.stop().await;
}

/// A guesser of keys is held back after `server.auth_failure_burst`
/// failures, before its guesses cost a query; a caller with a working key
/// from the same address is not.
#[tokio::test]
async fn failed_authentications_are_limited_per_client_address() {
    let env = Env::start(|c| {
        c.server.auth_failure_burst = 5;
        c.server.auth_failures_per_second = 1;
    })
    .await;
    let good = api_key(&env.db, "acme", &[Scope::RunsRead]).await;
    // A working key before any failure: the limiter knows it from now on.
    let path = "/v1/runs/none";
    let (status, _) = http(env.addr, "GET", path, &[as_header(&bearer(&good))], b"").await;
    assert_eq!(status, 404);

    let guess = |i: usize| format!("dk_{:016x}_{}", i, "0".repeat(64));
    let mut statuses = Vec::new();
    for i in 0..12 {
        let token = guess(i);
        let (status, body) = http(env.addr, "GET", path, &[as_header(&bearer(&token))], b"").await;
        let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        statuses.push((
            status,
            answer["error"]["code"].as_str().unwrap_or("").to_owned(),
        ));
    }
    let unauthenticated = statuses.iter().filter(|(s, _)| *s == 401).count();
    let limited = statuses
        .iter()
        .filter(|(s, c)| *s == 429 && c == "rate_limited")
        .count();
    assert!(
        (5..=6).contains(&unauthenticated) && unauthenticated + limited == 12,
        "the burst of failures is answered, the rest held back: {statuses:?}"
    );
    // The same address with a key that works is not held back.
    let (status, _) = http(env.addr, "GET", path, &[as_header(&bearer(&good))], b"").await;
    assert_eq!(
        status, 404,
        "a working key passes while its address is held back"
    );
    env.stop().await;
}

/// Revocation is the database's word: a key whose `revoked_at` lies ahead
/// of serve's clock (the database's clock ahead of serve's) is refused.
#[tokio::test]
async fn revocation_is_decided_by_the_database_not_by_serve_s_clock() {
    let env = Env::start(|_| {}).await;
    let key = api_key(&env.db, "acme", &[Scope::RunsRead]).await;
    let path = "/v1/runs/none";
    let (status, _) = http(env.addr, "GET", path, &[as_header(&bearer(&key))], b"").await;
    assert_eq!(status, 404);
    // As the keys role, the one that revokes.
    sqlx::query("UPDATE api_keys SET revoked_at = now() + interval '1 hour' WHERE key_id = $1")
        .bind(&key[3..19])
        .execute(&env.db.keys)
        .await
        .unwrap();
    let (status, _) = http(env.addr, "GET", path, &[as_header(&bearer(&key))], b"").await;
    assert_eq!(status, 401, "revoked whatever the time it names");
    env.stop().await;
}

/// With `server.admin_auth = "key"`, the admin listener's metrics and
/// readiness take a key of the admin scope; liveness stays open.
#[tokio::test]
async fn an_admin_listener_with_keys_refuses_callers_without_the_admin_scope() {
    let env = Env::start(|c| c.server.admin_auth = AdminAuth::Key).await;
    let admin_key = api_key(&env.db, "ops", &[Scope::Admin]).await;
    let runs_key = api_key(&env.db, "acme", &[Scope::RunsRead, Scope::RunsWrite]).await;
    assert_eq!(http(env.admin, "GET", "/healthz", &[], b"").await.0, 200);
    for path in ["/metrics", "/readyz"] {
        let (status, _) = http(env.admin, "GET", path, &[], b"").await;
        assert_eq!(status, 401, "{path} without a key");
        let (status, _) = http(
            env.admin,
            "GET",
            path,
            &[as_header(&bearer(&runs_key))],
            b"",
        )
        .await;
        assert_eq!(status, 403, "{path} with a key of the runs scopes");
        let (status, _) = http(
            env.admin,
            "GET",
            path,
            &[as_header(&bearer(&admin_key))],
            b"",
        )
        .await;
        assert_eq!(status, 200, "{path} with an admin key");
    }
    env.stop().await;
}

/// The admin `/readyz` says what the configuration leaves open: with keys
/// required and Kafka inputs unsigned (the defaults), any writer of the
/// input topics can act as any tenant.
#[tokio::test]
async fn the_admin_readiness_warns_that_unsigned_inputs_trust_every_kafka_writer() {
    let env = Env::start(|_| {}).await;
    let (status, body) = http(env.admin, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200);
    let detail: Value = serde_json::from_slice(&body).unwrap();
    let warnings = detail["warnings"].as_array().cloned().unwrap_or_default();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().is_some_and(|w| w.contains("any tenant"))),
        "{detail}"
    );
    // The public one tells nothing of it.
    let (_, body) = http(env.addr, "GET", "/readyz", &[], b"").await;
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap(),
        json!({"status": "ready"})
    );
    env.stop().await;
}

/// With `signatures.timer_key`, serve signs the timers it publishes and
/// the ingress takes no other: a writer of the wakeups topic (who may
/// hold a tenant's key, and may know a stamp) cannot fire one, and the
/// dead letter of its attempt carries no signature to replay.
#[tokio::test]
async fn only_serve_can_write_a_timer_once_it_has_a_timer_key() {
    const TENANT_KEY: &str = "acme-signing-key-0123456789";
    const TIMER_KEY: &str = "serve-timer-key-0123456789";
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("nap.toml"),
        "name = \"nap\"\nversion = 1\n\n\
         [[steps]]\nname = \"nap\"\nkind = \"sleep\"\nduration_ms = 200\n\n\
         [[steps]]\nname = \"approved\"\nkind = \"await_signal\"\nsignal = \"approval\"\n\
         timeout_ms = 600000\non_timeout = \"fail\"\n",
    )
    .unwrap();
    let workflows = dir.path().to_path_buf();
    let env = Env::start(move |c| {
        c.drainer.enabled = true;
        c.coordinator.workflows_dir = workflows;
        c.signatures.all_inputs = true;
        c.signatures.timer_key = Some(ductor::config::SigningKey(TIMER_KEY.into()));
        c.signatures
            .tenant_keys
            .insert("acme".into(), ductor::config::SigningKey(TENANT_KEY.into()));
    })
    .await;
    let names = env.config.topic_names();
    let wakeups = reader(&[&names.wakeups()]);
    let dlq = reader(&[&names.dead_letters()]);
    let producer = producer();
    let header = ductor::contract::signature::SIGNATURE;
    let start = json!({"type": "run.start", "schema_version": 1, "run_id": "nap-1",
        "tenant": "acme", "workflow": "nap"})
    .to_string();
    let signature = ductor::contract::signature::sign(
        TENANT_KEY.as_bytes(),
        start.as_bytes(),
        chrono::Utc::now().timestamp_millis(),
    );
    produce(
        &producer,
        &names.requests(),
        "nap-1",
        start.as_bytes(),
        &[(header, &signature)],
    )
    .await;

    // The sleep's wake timer, as serve published it: signed with its key,
    // and taken by the ingress (the run goes on to wait for approval).
    let fired = read_n(&wakeups, 1, WAIT).await;
    let timer = rdkafka::Message::payload(&fired[0]).unwrap().to_vec();
    let timer_signature = {
        use rdkafka::message::{Headers, Message};
        fired[0]
            .headers()
            .and_then(|hs| hs.iter().find(|h| h.key == header))
            .and_then(|h| h.value)
            .map(<[u8]>::to_vec)
            .expect("serve signs its timers")
    };
    assert!(ductor::contract::signature::verify_timer(
        TIMER_KEY.as_bytes(),
        &timer,
        &timer_signature
    ));
    eventually(
        "the run waits for approval after its sleep",
        WAIT,
        || async {
            let transitions: i64 =
                sqlx::query_scalar("SELECT count(*) FROM run_transitions WHERE run_id = 'nap-1'")
                    .fetch_one(&env.db.pool)
                    .await
                    .unwrap();
            // Nothing but the wake timer can make a second transition here.
            let refused = tokio::time::timeout(Duration::from_millis(1), dlq.recv()).await;
            assert!(
                !matches!(refused, Ok(Ok(_))),
                "serve's own timer was dead-lettered"
            );
            (transitions >= 2).then_some(())
        },
    )
    .await;

    // The same timer from anyone else: unsigned, or signed with a tenant's
    // key. Both are refused.
    let tenant_signed = ductor::contract::signature::sign(
        TENANT_KEY.as_bytes(),
        &timer,
        chrono::Utc::now().timestamp_millis(),
    );
    let topic = names.wakeups();
    produce(&producer, &topic, "nap-1", &timer, &[]).await;
    produce(
        &producer,
        &topic,
        "nap-1",
        &timer,
        &[(header, &tenant_signed)],
    )
    .await;
    let dead = read_n(&dlq, 2, WAIT).await;
    for letter in &dead {
        use rdkafka::message::{Headers, Message};
        let headers = letter.headers().unwrap();
        let class = headers
            .iter()
            .find(|h| h.key == "ductor-dlq-error-class")
            .and_then(|h| h.value)
            .unwrap();
        assert_eq!(class, b"unauthenticated");
        assert!(headers.iter().all(|h| h.key != header), "no signature kept");
    }
    env.stop().await;
}

fn as_header<'a>(pair: &'a (&'static str, String)) -> (&'static str, &'a str) {
    (pair.0, pair.1.as_str())
}
