//! The public listener against the real Postgres and Kafka: tenants are who
//! their keys prove them to be (`server.auth = "required"`, the default),
//! and no caller can take more than the listener's bounds give it.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::Serve as Env;
use common::*;
use ductor::auth::Scope;
use ductor::config::AuthMode;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const BOTH: [Scope; 2] = [Scope::RunsWrite, Scope::RunsRead];

impl Env {
    /// A request with `token` (none: no `Authorization` header) and any
    /// further headers; the status and the body as JSON.
    async fn call(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        body: Value,
    ) -> (u16, Value) {
        let auth = token.map(bearer);
        let mut headers: Vec<(&str, &str)> = extra.to_vec();
        headers.extend(auth.as_ref().map(|(k, v)| (*k, v.as_str())));
        let bytes = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let (status, raw) = http(self.addr, method, path, &headers, &bytes).await;
        (status, serde_json::from_slice(&raw).unwrap_or(Value::Null))
    }

    /// Starts a run of the example workflow as `token`'s tenant.
    async fn start_run(&self, token: &str) -> String {
        self.start_run_with(token, &json!({"workflow": "example"}))
            .await
    }

    async fn transitions(&self, run_id: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT kind FROM run_transitions WHERE run_id = $1 ORDER BY seq")
            .bind(run_id)
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    async fn status(&self, run_id: &str) -> String {
        sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }
}

fn code(answer: &Value) -> &str {
    answer["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn a_key_of_one_tenant_cannot_create_read_signal_or_cancel_anything_of_another() {
    let env = Env::start(|_| {}).await;
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let globex = api_key(&env.db, "globex", &BOTH).await;
    let theirs = env.start_run(&globex).await;
    let before = env.transitions(&theirs).await;
    assert_eq!(env.status(&theirs).await, "running");
    let run = format!("/v1/runs/{theirs}");
    let as_globex = [("X-Ductor-Tenant", "globex")];

    // Create: a body naming another tenant is refused, and creates nothing.
    let (status, answer) = env
        .call(
            Some(&acme),
            "POST",
            "/v1/runs",
            &[],
            json!({"workflow": "example", "tenant": "globex"}),
        )
        .await;
    assert_eq!((status, code(&answer)), (403, "tenant_mismatch"));
    assert_eq!(env.db.count("runs").await, 1);

    // Read: another tenant's run is a missing one; naming its tenant is 403.
    let (status, answer) = env.call(Some(&acme), "GET", &run, &[], Value::Null).await;
    assert_eq!((status, code(&answer)), (404, "not_found"));
    let (status, answer) = env
        .call(Some(&acme), "GET", &run, &as_globex, Value::Null)
        .await;
    assert_eq!((status, code(&answer)), (403, "tenant_mismatch"));

    // Signal and cancel: the same, and nothing reaches the run.
    let signals = format!("{run}/signals");
    let cancel = format!("{run}/cancel");
    let poke = json!({"name": "poke", "payload": {"n": 1}});
    let (status, answer) = env
        .call(Some(&acme), "POST", &signals, &[], poke.clone())
        .await;
    assert_eq!((status, code(&answer)), (404, "not_found"));
    let (status, answer) = env
        .call(
            Some(&acme),
            "POST",
            &signals,
            &[],
            json!({"name": "poke", "tenant": "globex"}),
        )
        .await;
    assert_eq!((status, code(&answer)), (403, "tenant_mismatch"));
    let (status, answer) = env
        .call(Some(&acme), "POST", &cancel, &[], Value::Null)
        .await;
    assert_eq!((status, code(&answer)), (404, "not_found"));
    let (status, answer) = env
        .call(Some(&acme), "POST", &cancel, &as_globex, Value::Null)
        .await;
    assert_eq!((status, code(&answer)), (403, "tenant_mismatch"));

    // The same calls work for the run's own tenant: the refusals above
    // were about the tenant, not the calls.
    let (status, answer) = env.call(Some(&globex), "GET", &run, &[], Value::Null).await;
    assert_eq!((status, answer["tenant"].as_str()), (200, Some("globex")));
    let ours = env.start_run(&acme).await;
    let mine = format!("/v1/runs/{ours}");
    let (status, answer) = env
        .call(Some(&acme), "POST", &format!("{mine}/signals"), &[], poke)
        .await;
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = env
        .call(
            Some(&acme),
            "POST",
            &format!("{mine}/cancel"),
            &[],
            json!({"reason": "done"}),
        )
        .await;
    assert_eq!(status, 202, "{answer}");
    eventually("acme's own run is cancelled", WAIT, || async {
        (env.status(&ours).await == "cancelled").then_some(())
    })
    .await;
    let kinds = env.transitions(&ours).await;
    assert!(kinds.iter().any(|k| k == "run.signalled"), "{kinds:?}");
    assert!(kinds.iter().any(|k| k == "run.cancelled"), "{kinds:?}");
    // acme's inputs went through the ingress after everything it tried on
    // globex's run: that run is as it was.
    assert_eq!(env.transitions(&theirs).await, before);
    assert_eq!(env.status(&theirs).await, "running");
    env.stop().await;
}

#[tokio::test]
async fn a_revoked_key_is_refused_at_once_and_every_refusal_looks_the_same() {
    let env = Env::start(|_| {}).await;
    let created = ductor_cli(
        &env,
        &[
            "keys",
            "create",
            "--tenant",
            "acme",
            "--scopes",
            "runs:write,runs:read",
            "--label",
            "ci",
        ],
    );
    let key = created["key"]
        .as_str()
        .expect("the key is printed")
        .to_string();
    let key_id = created["key_id"].as_str().unwrap().to_string();
    let run = env.start_run(&key).await;
    let path = format!("/v1/runs/{run}");
    assert_eq!(
        env.call(Some(&key), "GET", &path, &[], Value::Null).await.0,
        200
    );

    let revoked = ductor_cli(&env, &["keys", "revoke", &key_id]);
    assert_eq!(revoked["revoked"], true);
    let (status, refusal) = env.call(Some(&key), "GET", &path, &[], Value::Null).await;
    assert_eq!((status, code(&refusal)), (401, "unauthenticated"));

    // Missing, malformed, unknown, wrong secret, expired: the same answer.
    let other = api_key(&env.db, "acme", &BOTH).await;
    let wrong_secret = format!("{}{}", &key[..20], &other[20..]);
    let unknown = format!("dk_{}{}", "f".repeat(16), &other[19..]);
    let expired = api_key(&env.db, "acme", &BOTH).await;
    sqlx::query("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE key_id = $1")
        .bind(&expired[3..19])
        .execute(&env.db.owner)
        .await
        .unwrap();
    let refused: [Option<&str>; 5] = [
        None,
        Some("not-a-key"),
        Some(&unknown),
        Some(&wrong_secret),
        Some(&expired),
    ];
    for token in refused {
        let answer = env.call(token, "GET", &path, &[], Value::Null).await;
        assert_eq!(answer, (status, refusal.clone()), "{token:?}");
    }
    let metrics = ductor::infra::telemetry::metrics_handle().render();
    for reason in [
        "missing",
        "malformed",
        "unknown",
        "wrong_secret",
        "expired",
        "revoked",
    ] {
        let series = format!("ductor_api_auth_failures_total{{reason=\"{reason}\"}}");
        assert!(metrics.contains(&series), "{series} missing");
    }

    // A key is never shown again, and does only what its scopes say.
    let listed = ductor_cli_lines(&env, &["keys", "list", "--tenant", "acme"]);
    assert_eq!(listed.len(), 3);
    for k in &listed {
        assert!(
            k.get("key").is_none() && !k.to_string().contains(&key[20..]),
            "{k}"
        );
    }
    assert!(
        listed
            .iter()
            .any(|k| k["key_id"] == key_id.as_str() && !k["revoked_at"].is_null())
    );
    let reader = api_key(&env.db, "acme", &[Scope::RunsRead]).await;
    assert_eq!(
        env.call(Some(&reader), "GET", &path, &[], Value::Null)
            .await
            .0,
        200
    );
    let (status, answer) = env
        .call(
            Some(&reader),
            "POST",
            "/v1/runs",
            &[],
            json!({"workflow": "example"}),
        )
        .await;
    assert_eq!((status, code(&answer)), (403, "insufficient_scope"));
    env.stop().await;
}

#[tokio::test]
async fn with_authentication_disabled_a_request_names_its_tenant() {
    let env = Env::start(|c| c.server.auth = AuthMode::Disabled).await;
    let (status, answer) = env
        .call(
            None,
            "POST",
            "/v1/runs",
            &[],
            json!({"workflow": "example", "tenant": "initech"}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let path = format!("/v1/runs/{}", answer["run_id"].as_str().unwrap());
    let (status, run) = env
        .call(
            None,
            "GET",
            &path,
            &[("X-Ductor-Tenant", "initech")],
            Value::Null,
        )
        .await;
    assert_eq!((status, run["tenant"].as_str()), (200, Some("initech")));
    let (status, answer) = env.call(None, "GET", &path, &[], Value::Null).await;
    assert_eq!((status, code(&answer)), (400, "missing_tenant"));
    env.stop().await;
}

#[tokio::test]
async fn a_body_must_say_it_is_json_and_arrive_in_time() {
    let env = Env::start(|c| c.server.body_read_timeout_ms = 300).await;
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let auth = bearer(&acme);
    let body = json!({"workflow": "example"}).to_string();
    let (status, answer) = http(
        env.addr,
        "POST",
        "/v1/runs",
        &[(auth.0, &auth.1), ("Content-Type", "text/plain")],
        body.as_bytes(),
    )
    .await;
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!((status, code(&answer)), (415, "unsupported_media_type"));

    // Headers in, the body promised but never sent: answered once the
    // body's time is up, and nothing was decided.
    let mut slow = SlowRequest::open(env.addr, &acme).await;
    let (status, head, answer) = slow.answer().await;
    assert_eq!((status, code(&answer)), (408, "body_timeout"), "{head}");
    assert_eq!(env.db.count("runs").await, 0);
    env.stop().await;
}

#[tokio::test]
async fn requests_past_the_concurrency_bound_are_shed_and_a_key_past_its_rate_waits() {
    let env = Env::start(|c| {
        c.server.max_concurrent_requests = 1;
        c.server.request_burst = 2;
    })
    .await;
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let run = env.start_run(&acme).await;
    let path = format!("/v1/runs/{run}");

    // One request holds the only slot while its body does not come.
    let slow = SlowRequest::open(env.addr, &acme).await;
    let (_, head, answer) = eventually("a request is shed", WAIT, || async {
        let shed = raw_get(env.addr, &path, &acme).await;
        (shed.0 == 503).then_some(shed)
    })
    .await;
    assert_eq!(code(&answer), "overloaded");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    drop(slow);
    eventually("the slot is free again", WAIT, || async {
        (raw_get(env.addr, &path, &acme).await.0 == 200).then_some(())
    })
    .await;

    // A key of one request a second, in a burst of two: five requests at
    // once cannot all pass, and the refusal says when to come back. Another
    // key, at the default rate, is not held back by it.
    let slow_key = ductor::auth::key::generate().unwrap();
    let request = ductor::auth::store::KeyRequest {
        tenant: "acme".into(),
        scopes: BOTH.to_vec(),
        label: None,
        requests_per_second: Some(1),
        expires_at: None,
    };
    ductor::auth::store::insert(&env.db.keys, &slow_key, &request)
        .await
        .unwrap();
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(raw_get(env.addr, &path, &slow_key.token).await);
    }
    let limited: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert!(
        !limited.is_empty(),
        "{:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    assert_eq!(code(&limited[0].2), "rate_limited");
    assert!(
        limited[0].1.to_ascii_lowercase().contains("retry-after: "),
        "{}",
        limited[0].1
    );
    assert_eq!(raw_get(env.addr, &path, &acme).await.0, 200);
    env.stop().await;
}

#[tokio::test]
async fn the_api_has_a_bounded_database_pool_of_its_own() {
    let env = Env::start(|c| c.database.api_max_connections = 2).await;
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let starts = (0..40).map(|_| env.start_run(&acme));
    futures::future::join_all(starts).await;
    let by_name: Vec<(String, i64)> = sqlx::query_as(
        "SELECT application_name, count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name LIKE 'ductor%' \
         GROUP BY application_name ORDER BY 1",
    )
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    let api = by_name.iter().find(|(name, _)| name == "ductor-api");
    assert!(matches!(api, Some((_, 1..=2))), "{by_name:?}");
    assert!(
        by_name.iter().any(|(name, _)| name == "ductor"),
        "{by_name:?}"
    );
    assert_eq!(env.db.count("runs").await, 40);
    env.stop().await;
}

#[tokio::test]
async fn where_signatures_are_required_unsigned_or_mis_signed_inputs_are_dead_lettered() {
    const KEY: &str = "acme-signing-key-0123456789";
    let env = Env::start(|c| {
        c.signatures.all_inputs = true;
        c.signatures.timer_key = Some(ductor::config::SigningKey(
            "serve-timer-key-0123456789".into(),
        ));
        c.signatures
            .tenant_keys
            .insert("acme".into(), ductor::config::SigningKey(KEY.into()));
    })
    .await;
    let names = env.config.topic_names();
    let dlq = reader(&[&names.dead_letters()]);
    let producer = producer();
    let requests = names.requests();
    let start = |run_id: &str| {
        json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
               "tenant": "acme", "workflow": "example"})
        .to_string()
    };
    let now_ms = || chrono::Utc::now().timestamp_millis();
    let sign = |payload: &str, at_ms: i64| {
        ductor::contract::signature::sign(KEY.as_bytes(), payload.as_bytes(), at_ms)
    };
    let header = ductor::contract::signature::SIGNATURE;
    let signed = start("signed-1");
    let signature = sign(&signed, now_ms());
    produce(
        &producer,
        &requests,
        "signed-1",
        signed.as_bytes(),
        &[(header, &signature)],
    )
    .await;
    let unsigned = start("unsigned-1");
    produce(&producer, &requests, "unsigned-1", unsigned.as_bytes(), &[]).await;
    let forged = start("forged-1");
    let wrong = ductor::contract::signature::sign(
        b"not-acme-s-key-0123456789",
        forged.as_bytes(),
        now_ms(),
    );
    produce(
        &producer,
        &requests,
        "forged-1",
        forged.as_bytes(),
        &[(header, &wrong)],
    )
    .await;
    // Signed for another input: a signature covers its own value only.
    let replayed = start("replayed-1");
    produce(
        &producer,
        &requests,
        "replayed-1",
        replayed.as_bytes(),
        &[(header, &signature)],
    )
    .await;
    // Signed ten minutes ago: outside signatures.max_age_ms (5 minutes), so
    // a copy kept from then cannot be replayed now.
    let stale = start("stale-1");
    let old = sign(&stale, now_ms() - 600_000);
    produce(
        &producer,
        &requests,
        "stale-1",
        stale.as_bytes(),
        &[(header, &old)],
    )
    .await;
    // A signed start that names neither its run nor a key would be keyed
    // by its offset: each copy of it another run.
    let unkeyed = json!({"type": "run.start", "schema_version": 1, "tenant": "acme",
        "workflow": "example", "correlation_id": "unkeyed-1"})
    .to_string();
    let unkeyed_signature = sign(&unkeyed, now_ms());
    produce(
        &producer,
        &requests,
        "unkeyed-1",
        unkeyed.as_bytes(),
        &[(header, &unkeyed_signature)],
    )
    .await;

    let dead = read_n(&dlq, 5, WAIT).await;
    let mut refused: Vec<(String, String)> = dead
        .iter()
        .map(|m| {
            let value = String::from_utf8_lossy(rdkafka::Message::payload(m).unwrap()).to_string();
            let input: Value = serde_json::from_str(&value).unwrap();
            let name = input["run_id"]
                .as_str()
                .or(input["correlation_id"].as_str())
                .unwrap()
                .to_string();
            (name, dlq_class(m))
        })
        .collect();
    refused.sort();
    let expected = [
        "forged-1",
        "replayed-1",
        "stale-1",
        "unkeyed-1",
        "unsigned-1",
    ]
    .map(|r| (r.to_string(), "unauthenticated".to_string()));
    assert_eq!(refused, expected);
    for letter in &dead {
        use rdkafka::message::{Headers, Message};
        let headers = letter.headers().expect("a dead letter has headers");
        assert!(
            headers.iter().all(|h| h.key != header),
            "a dead letter carries no signature to replay"
        );
    }
    eventually("the signed start is applied", WAIT, || async {
        (env.db.count("runs").await == 1).then_some(())
    })
    .await;
    assert_eq!(env.status("signed-1").await, "running");

    // The HTTP API signs what it puts on Kafka for the tenant; an unsigned
    // signal on Kafka is refused.
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let (status, _) = env
        .call(
            Some(&acme),
            "POST",
            "/v1/runs/signed-1/signals",
            &[],
            json!({"name": "poke"}),
        )
        .await;
    assert_eq!(status, 202);
    let wakeups = names.wakeups();
    let signal = json!({"type": "wakeup.signal", "schema_version": 1, "run_id": "signed-1",
        "tenant": "acme", "signal_id": "unsigned-signal", "name": "poke", "payload": null})
    .to_string();
    produce(&producer, &wakeups, "signed-1", signal.as_bytes(), &[]).await;
    let dead = read_n(&dlq, 1, WAIT).await;
    assert_eq!(dlq_class(&dead[0]), "unauthenticated");
    eventually("the API's signal is applied", WAIT, || async {
        let kinds = env.transitions("signed-1").await;
        (kinds.iter().filter(|k| *k == "run.signalled").count() == 1).then_some(())
    })
    .await;

    // A tenant without a signing key cannot have its inputs signed: the API
    // says so, instead of answering 202 for an input the ingress refuses.
    let globex = api_key(&env.db, "globex", &BOTH).await;
    let theirs = env.start_run(&globex).await;
    for action in ["signals", "cancel"] {
        let (status, answer) = env
            .call(
                Some(&globex),
                "POST",
                &format!("/v1/runs/{theirs}/{action}"),
                &[],
                if action == "signals" {
                    json!({"name": "poke"})
                } else {
                    Value::Null
                },
            )
            .await;
        assert_eq!(
            (status, code(&answer)),
            (403, "signing_key_missing"),
            "{action}: {answer}"
        );
    }
    env.stop().await;
}

fn dlq_class(m: &rdkafka::message::OwnedMessage) -> String {
    use rdkafka::message::{Headers, Message};
    let headers = m.headers().expect("a dead letter has headers");
    headers
        .iter()
        .find(|h| h.key == "ductor-dlq-error-class")
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("a dead letter names its class")
}

/// A `POST /v1/runs` whose headers promise a body that never comes.
struct SlowRequest(tokio::net::TcpStream);

impl SlowRequest {
    async fn open(addr: SocketAddr, token: &str) -> SlowRequest {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/runs HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        SlowRequest(stream)
    }

    async fn answer(&mut self) -> (u16, String, Value) {
        read_answer(&mut self.0).await
    }
}

/// `GET path` with `token`; the status, the header block and the body.
async fn raw_get(addr: SocketAddr, path: &str, token: &str) -> (u16, String, Value) {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    read_answer(&mut stream).await
}

async fn read_answer(stream: &mut tokio::net::TcpStream) -> (u16, String, Value) {
    use tokio::io::AsyncReadExt;
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    // Until the header block and the length it announces are in (the
    // server may keep the connection open).
    loop {
        let n = stream.read(&mut buf).await.unwrap();
        response.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&response).into_owned();
        if let Some(split) = text.find("\r\n\r\n") {
            let head = text[..split].to_string();
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if n == 0 || response.len() >= split + 4 + length {
                let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                let body = serde_json::from_slice(&response[split + 4..]).unwrap_or(Value::Null);
                return (status, head, body);
            }
        }
        assert!(n > 0, "the connection closed without an answer");
    }
}

/// Runs the `ductor` binary against the test's database; its stdout as JSON.
fn ductor_cli(env: &Env, args: &[&str]) -> Value {
    let lines = ductor_cli_lines(env, args);
    assert_eq!(lines.len(), 1, "{lines:?}");
    lines.into_iter().next().unwrap()
}

fn ductor_cli_lines(env: &Env, args: &[&str]) -> Vec<Value> {
    let out = std::process::Command::new(ductor_bin())
        .args(args)
        .env("DATABASE_URL", env.config.database.url.expose())
        .env("DATABASE_KEYS_URL", env.config.database.keys_url().expose())
        .output()
        .expect("running ductor");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[tokio::test]
async fn a_signal_id_or_run_id_reused_with_another_meaning_is_refused_on_every_path() {
    const MISMATCHES: &str = "ductor_routing_idempotency_mismatches_total";
    let env = Env::start(|_| {}).await;
    let acme = api_key(&env.db, "acme", &BOTH).await;
    let names = env.config.topic_names();
    let dlq = reader(&[&names.dead_letters()]);
    let producer = producer();
    let before_signal = metric(env.admin, &[], MISMATCHES, "path=\"signal\"").await;
    let before_start = metric(env.admin, &[], MISMATCHES, "path=\"client_start\"").await;

    // Over HTTP: a new signal_id is accepted, the same signal again is a
    // duplicate, another name or payload under it is refused.
    let run = env.start_run(&acme).await;
    let signals = format!("/v1/runs/{run}/signals");
    let poke = json!({"name": "poke", "payload": {"n": 1}, "signal_id": "s-1"});
    let (status, answer) = env
        .call(Some(&acme), "POST", &signals, &[], poke.clone())
        .await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (202, Some("accepted")),
        "{answer}"
    );
    eventually("the run records s-1", WAIT, || async {
        let recorded: bool = sqlx::query_scalar(
            "SELECT state->'signals' @> '[{\"signal_id\": \"s-1\"}]' FROM runs WHERE run_id = $1",
        )
        .bind(&run)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        recorded.then_some(())
    })
    .await;
    let (status, answer) = env.call(Some(&acme), "POST", &signals, &[], poke).await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("duplicate")),
        "{answer}"
    );
    for other in [
        json!({"name": "poke", "payload": {"n": 2}, "signal_id": "s-1"}),
        json!({"name": "prod", "payload": {"n": 1}, "signal_id": "s-1"}),
    ] {
        let (status, answer) = env.call(Some(&acme), "POST", &signals, &[], other).await;
        assert_eq!(
            (status, code(&answer)),
            (422, "idempotency_mismatch"),
            "{answer}"
        );
    }

    // Over Kafka: the same refusals go to the dead-letter topic.
    let other_signal = json!({"type": "wakeup.signal", "schema_version": 1, "run_id": run,
        "tenant": "acme", "signal_id": "s-1", "name": "poke", "payload": {"n": 3}});
    let wakeups = names.wakeups();
    produce(
        &producer,
        &wakeups,
        &run,
        other_signal.to_string().as_bytes(),
        &[],
    )
    .await;
    let start = |n: u32| {
        json!({"type": "run.start", "schema_version": 1, "run_id": "client-1",
               "tenant": "acme", "workflow": "example", "input": {"n": n}})
        .to_string()
    };
    let requests = names.requests();
    produce(&producer, &requests, "client-1", start(1).as_bytes(), &[]).await;
    // The same start again is a duplicate, ahead of the other one in the
    // partition: were it dead-lettered, it would come first.
    produce(&producer, &requests, "client-1", start(1).as_bytes(), &[]).await;
    produce(&producer, &requests, "client-1", start(2).as_bytes(), &[]).await;
    let dead = read_n(&dlq, 2, WAIT).await;
    let mut refused: Vec<(String, String)> = dead
        .iter()
        .map(|m| {
            let value: Value =
                serde_json::from_slice(rdkafka::Message::payload(m).unwrap()).unwrap();
            (value["run_id"].as_str().unwrap().to_string(), dlq_class(m))
        })
        .collect();
    refused.sort();
    let mut expected = vec![
        ("client-1".to_string(), "idempotency_mismatch".to_string()),
        (run.clone(), "idempotency_mismatch".to_string()),
    ];
    expected.sort();
    assert_eq!(refused, expected);
    let input: Value =
        sqlx::query_scalar("SELECT state->'input' FROM runs WHERE run_id = 'client-1'")
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(input, json!({"n": 1}), "the first start is the run");

    // The HTTP refusals and the Kafka one count as signals, the start as
    // a client-chosen start.
    assert!(metric(env.admin, &[], MISMATCHES, "path=\"signal\"").await >= before_signal + 3.0);
    assert!(
        metric(env.admin, &[], MISMATCHES, "path=\"client_start\"").await >= before_start + 1.0
    );
    env.stop().await;
}
