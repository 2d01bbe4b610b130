//! An operator's actions on a run, against a real `serve`, Kafka and
//! Postgres: a failed run retried over HTTP starts again from the step it
//! failed in and succeeds, the same retry sent again answers 200 and
//! retries nothing, and a run that is not failed is refused; an operator's
//! key retries any tenant's run on the admin listener; a cancel names its
//! action in the run's history; a cancelled failed run is never retried;
//! a run whose compensation failed is retried from that compensation, and
//! a compensated one is not; and `ductor runs retry` does the same from a
//! terminal.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;
use common::Serve as Env;
use common::*;
use ductor::auth::Scope;
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};

struct World {
    env: Env,
    producer: FutureProducer,
}

impl World {
    async fn start(&self, token: &str) -> String {
        let body = json!({"workflow": "example", "input": {"order": 1}});
        self.env.start_run_with(token, &body).await
    }

    /// Answers attempt `attempt` of the run's step `step`, once it is
    /// dispatched, with `outcome`, as a worker would.
    async fn answer(&self, run_id: &str, tenant: &str, step: i32, attempt: i32, outcome: Value) {
        let (run, attempt) = ((run_id, tenant), (step, Some(attempt)));
        self.env.answer(&self.producer, run, attempt, outcome).await;
    }

    async fn decline(&self, run_id: &str, tenant: &str, attempt: i32) {
        let declined =
            json!({"outcome": "failed", "error": {"message": "card declined", "retryable": false}});
        self.answer(run_id, tenant, 0, attempt, declined).await;
        self.settle(run_id, "failed").await;
    }

    async fn settle(&self, run_id: &str, status: &str) {
        self.env.settle(run_id, status).await;
    }

    /// `POST path` on `addr` with `token`: the status and the JSON body.
    async fn post(
        &self,
        addr: std::net::SocketAddr,
        token: &str,
        path: &str,
        body: Value,
    ) -> (u16, Value) {
        let auth = bearer(token);
        let (status, raw) = http(
            addr,
            "POST",
            path,
            &[(auth.0, &auth.1)],
            body.to_string().as_bytes(),
        )
        .await;
        let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        (status, body)
    }

    /// The run's transitions: (kind, from, to, detail), oldest first.
    async fn history(&self, run_id: &str) -> Vec<(String, Option<String>, String, Value)> {
        sqlx::query_as(
            "SELECT kind, from_status, to_status, detail FROM run_transitions \
             WHERE run_id = $1 ORDER BY seq",
        )
        .bind(run_id)
        .fetch_all(&self.env.db.pool)
        .await
        .unwrap()
    }
}

fn ok(step: i32) -> Value {
    json!({"outcome": "succeeded", "output": {"step": step}})
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn a_failed_run_is_retried_once_from_its_failed_step_and_succeeds() {
    let w = World {
        env: Env::start(|_| {}).await,
        producer: producer(),
    };
    let acme = api_key(&w.env.db, "acme", &[Scope::RunsWrite, Scope::RunsRead]).await;
    let globex = api_key(&w.env.db, "globex", &[Scope::RunsWrite]).await;
    let run = w.start(&acme).await;
    let retry_path = format!("/v1/runs/{run}/retry");

    // Running: nothing to retry.
    let (status, body) = w.post(w.env.addr, &acme, &retry_path, json!({})).await;
    assert_eq!((status, code(&body)), (409, "run_not_failed"), "{body}");

    // Its first step is declined: the run fails, and is retried once.
    w.decline(&run, "acme", 1).await;
    let (status, body) = w.post(w.env.addr, &globex, &retry_path, json!({})).await;
    assert_eq!(
        (status, code(&body)),
        (404, "not_found"),
        "another tenant's run: {body}"
    );
    let fix = json!({"action_id": "fix-1", "reason": "the card was replaced"});
    let (status, body) = w.post(w.env.addr, &acme, &retry_path, fix.clone()).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        (body["action_id"].as_str(), body["status"].as_str()),
        (Some("fix-1"), Some("accepted"))
    );
    w.settle(&run, "running").await;
    // Attempt 2 of step 0 is dispatched; it and the rest succeed.
    w.answer(&run, "acme", 0, 2, ok(0)).await;
    w.answer(&run, "acme", 1, 1, ok(1)).await;
    w.answer(&run, "acme", 2, 1, ok(2)).await;
    w.settle(&run, "succeeded").await;

    // The same retry again answers that it was applied, and sends nothing;
    // another is refused, the run is no longer failed.
    let (status, body) = w.post(w.env.addr, &acme, &retry_path, fix).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    let (status, body) = w
        .post(
            w.env.addr,
            &acme,
            &retry_path,
            json!({"action_id": "fix-2"}),
        )
        .await;
    assert_eq!((status, code(&body)), (409, "run_not_failed"), "{body}");

    let history = w.history(&run).await;
    let kinds: Vec<&str> = history.iter().map(|(k, ..)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "run.started",
            "run.failed",
            "run.retried",
            "step.succeeded",
            "step.succeeded",
            "run.succeeded"
        ]
    );
    let (_, from, to, detail) = &history[2];
    assert_eq!((from.as_deref(), to.as_str()), (Some("failed"), "running"));
    assert_eq!(detail["action_id"], json!("fix-1"));
    assert_eq!(detail["failed_seq"], json!(2));
    assert_eq!(detail["reason"], json!("the card was replaced"));
    let attempts: Vec<(i32, i32, String)> = sqlx::query_as(
        "SELECT step_index, attempt, status FROM run_attempts WHERE run_id = $1 \
         ORDER BY step_index, attempt",
    )
    .bind(&run)
    .fetch_all(&w.env.db.pool)
    .await
    .unwrap();
    assert_eq!(
        attempts[..2],
        [(0, 1, "failed".to_owned()), (0, 2, "succeeded".to_owned())]
    );
    let counts: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, sum(n)::bigint FROM run_counts GROUP BY status HAVING sum(n) <> 0 ORDER BY 1",
    )
    .fetch_all(&w.env.db.pool)
    .await
    .unwrap();
    assert_eq!(
        counts,
        [("succeeded".to_owned(), 1)],
        "the counts moved with the run"
    );
    w.env.stop().await;
}

/// `undo`: `charge`, undone by `refund` (one attempt), then `ship`, whose
/// failure compensates the run.
const UNDO: &str = r#"
name = "undo"
version = 1

[[steps]]
name = "charge"
pool = "p"
timeout_ms = 60000
compensate = { name = "refund", pool = "p", timeout_ms = 60000, retry = { max_attempts = 1 } }

[[steps]]
name = "ship"
pool = "p"
timeout_ms = 60000
catch = { compensate = true }
"#;

#[tokio::test]
async fn a_run_whose_compensation_failed_is_retried_from_it_and_a_compensated_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("undo.toml"), UNDO).unwrap();
    let w = World {
        env: Env::start(|c| {
            c.coordinator.workflows_dir = dir.path().to_path_buf();
            c.kafka.step_pools = vec!["p".into()];
        })
        .await,
        producer: producer(),
    };
    let acme = api_key(&w.env.db, "acme", &[Scope::RunsWrite, Scope::RunsRead]).await;
    let body = json!({"workflow": "undo", "input": {"order": 5}});
    let run = w.env.start_run_with(&acme, &body).await;
    let retry_path = format!("/v1/runs/{run}/retry");
    let declined =
        |why: &str| json!({"outcome": "failed", "error": {"message": why, "retryable": false}});
    // charge 0, ship 1, refund 2.
    w.answer(
        &run,
        "acme",
        0,
        1,
        json!({"outcome": "succeeded", "output": {"charge": "ch_9"}}),
    )
    .await;
    w.answer(&run, "acme", 1, 1, declined("no courier")).await;
    w.answer(&run, "acme", 2, 1, declined("refunds down")).await;
    w.settle(&run, "failed").await;
    let history = w.history(&run).await;
    let (kind, _, _, detail) = history.last().unwrap();
    assert_eq!(kind, "run.failed");
    assert_eq!(
        (&detail["cause"], &detail["compensation_cause"]),
        (&json!("compensation_failed"), &json!("not_retryable")),
        "{detail}"
    );

    // A retry goes on from the refund, which then succeeds: the run
    // fails compensated, with the error it failed with first.
    let (status, body) = w.post(w.env.addr, &acme, &retry_path, json!({})).await;
    assert_eq!(status, 202, "{body}");
    w.settle(&run, "running").await;
    w.answer(&run, "acme", 2, 2, ok(2)).await;
    w.settle(&run, "failed").await;
    let history = w.history(&run).await;
    let kinds: Vec<&str> = history.iter().map(|(k, ..)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "run.started",
            "step.succeeded",
            "run.compensating",
            "run.failed",
            "run.retried",
            "run.failed"
        ]
    );
    let (_, _, _, detail) = history.last().unwrap();
    assert_eq!(
        (&detail["cause"], &detail["compensated_cause"]),
        (&json!("compensated"), &json!("not_retryable")),
        "{detail}"
    );
    let error: String = sqlx::query_scalar("SELECT state->>'error' FROM runs WHERE run_id = $1")
        .bind(&run)
        .fetch_one(&w.env.db.pool)
        .await
        .unwrap();
    assert!(error.ends_with("no courier"), "{error}");
    // Both refund attempts carried the charge's key and output.
    let refunds: Vec<(String, Value)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8')::jsonb->>'step_key', \
                convert_from(payload, 'UTF8')::jsonb->'input' \
         FROM eec_effect_intent WHERE run_id = $1 AND ce_type = 'ductor.step.dispatch' \
         AND convert_from(payload, 'UTF8')::jsonb->>'step' = 'refund' ORDER BY seq",
    )
    .bind(&run)
    .fetch_all(&w.env.db.pool)
    .await
    .unwrap();
    let charged = (
        format!("{run}/step/0/compensate"),
        json!({"charge": "ch_9"}),
    );
    assert_eq!(refunds, [charged.clone(), charged]);

    // What it did is undone: nothing to retry.
    let (status, body) = w.post(w.env.addr, &acme, &retry_path, json!({})).await;
    assert_eq!((status, code(&body)), (409, "run_compensated"), "{body}");
    w.env.stop().await;
}

#[tokio::test]
async fn operators_retry_and_cancel_any_tenants_run_with_named_actions() {
    let w = World {
        env: Env::start(|_| {}).await,
        producer: producer(),
    };
    let acme = api_key(&w.env.db, "acme", &[Scope::RunsWrite, Scope::RunsRead]).await;
    let ops = api_key(&w.env.db, "ops", &[Scope::Admin]).await;
    let retried = w.start(&acme).await;
    let dropped = w.start(&acme).await;
    w.decline(&retried, "acme", 1).await;
    w.decline(&dropped, "acme", 1).await;

    // On the admin listener: a tenant's key is no operator; an operator's
    // key retries the tenant's run, without naming the action.
    let path = format!("/v1/runs/{retried}/retry");
    let (status, body) = w.post(w.env.admin, &acme, &path, json!({})).await;
    assert_eq!((status, code(&body)), (403, "insufficient_scope"), "{body}");
    let (status, body) = w
        .post(w.env.admin, &ops, &path, json!({"tenant": "globex"}))
        .await;
    assert_eq!((status, code(&body)), (403, "tenant_mismatch"), "{body}");
    let (status, body) = w.post(w.env.admin, &ops, &path, json!({})).await;
    assert_eq!(status, 202, "{body}");
    let action = body["action_id"].as_str().unwrap().to_owned();
    assert!(!action.is_empty());
    w.settle(&retried, "running").await;
    let history = w.history(&retried).await;
    assert_eq!(history[2].3["action_id"], json!(action));

    // A retry naming a failure the run does not have is refused.
    let (status, body) = w
        .post(
            w.env.addr,
            &acme,
            &format!("/v1/runs/{dropped}/retry"),
            json!({"failed_seq": 1}),
        )
        .await;
    assert_eq!((status, code(&body)), (409, "run_not_failed"), "{body}");

    // A failed run cancelled, by name, is never retried.
    let cancel = format!("/v1/runs/{dropped}/cancel");
    let (status, body) = w
        .post(
            w.env.admin,
            &ops,
            &cancel,
            json!({"action_id": "give-up", "reason": "refunded"}),
        )
        .await;
    assert_eq!(
        (status, body["action_id"].as_str()),
        (202, Some("give-up")),
        "{body}"
    );
    w.settle(&dropped, "cancelled").await;
    let history = w.history(&dropped).await;
    let (kind, from, _, detail) = history.last().unwrap();
    assert_eq!(
        (kind.as_str(), from.as_deref()),
        ("run.cancelled", Some("failed"))
    );
    assert_eq!(
        (detail["action_id"].as_str(), detail["reason"].as_str()),
        (Some("give-up"), Some("refunded"))
    );
    let (status, body) = w
        .post(
            w.env.addr,
            &acme,
            &format!("/v1/runs/{dropped}/retry"),
            json!({}),
        )
        .await;
    assert_eq!((status, code(&body)), (409, "run_not_failed"), "{body}");

    // From a terminal: the retried run fails again and `ductor runs retry`
    // retries it; the same action again is applied, exit 0, and a bad one
    // exits 1.
    w.decline(&retried, "acme", 2).await;
    let cli = |args: Vec<String>| {
        let url = format!("http://{}", w.env.addr);
        let key = acme.clone();
        async move {
            let out = tokio::process::Command::new(ductor_bin())
                .args(&args)
                .env("DUCTOR_URL", url)
                .env("DUCTOR_API_KEY", key)
                .output()
                .await
                .expect("running ductor");
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let args = |extra: &[&str]| -> Vec<String> {
        ["runs", "retry", retried.as_str()]
            .iter()
            .chain(extra)
            .map(|s| (*s).to_owned())
            .collect()
    };
    let (status, out, err) = cli(args(&["--action-id", "from-cli", "--reason", "again"])).await;
    assert_eq!(status, 0, "{err}");
    let answer: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(answer["status"], json!("accepted"));
    w.settle(&retried, "running").await;
    let (status, out, err) = cli(args(&["--action-id", "from-cli"])).await;
    assert_eq!(status, 0, "{err}");
    assert!(out.contains("applied"), "{out}");
    let (status, _, err) = cli(args(&["--action-id", "not an id"])).await;
    assert_eq!(status, 1, "{err}");
    assert!(err.contains("invalid"), "{err}");
    w.env.stop().await;
}
