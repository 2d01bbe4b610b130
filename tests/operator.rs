//! The operator's views of runs against the real Postgres and Kafka: runs
//! listed, searched and paged newest first, counted by status without
//! reading them, and one run's history with its attempts and the effects
//! of each transition; a tenant's key sees its own runs only, an `admin`
//! key every tenant's.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::time::Duration;

use common::Serve as Env;
use common::*;
use ductor::auth::Scope;
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const BOTH: [Scope; 2] = [Scope::RunsWrite, Scope::RunsRead];

struct Views {
    env: Env,
    producer: FutureProducer,
}

impl Views {
    async fn get(&self, token: &str, path: &str) -> (u16, Value) {
        let auth = bearer(token);
        let headers = [(auth.0, auth.1.as_str())];
        let (status, raw) = http(self.env.addr, "GET", path, &headers, &[]).await;
        (status, serde_json::from_slice(&raw).unwrap_or(Value::Null))
    }

    async fn post(&self, token: &str, path: &str, body: &Value) -> (u16, Value) {
        let auth = bearer(token);
        let headers = [
            (auth.0, auth.1.as_str()),
            ("Content-Type", "application/json"),
        ];
        let bytes = body.to_string().into_bytes();
        let (status, raw) = http(self.env.addr, "POST", path, &headers, &bytes).await;
        (status, serde_json::from_slice(&raw).unwrap_or(Value::Null))
    }

    async fn start(&self, token: &str, correlation_id: &str) -> String {
        let body =
            json!({"workflow": "example", "correlation_id": correlation_id, "input": {"n": 1}});
        self.env.start_run_with(token, &body).await
    }

    /// Answers the dispatched attempt of `run_id`'s step `step` with
    /// `outcome` (the fields of an `attempt.result` after its stamp).
    async fn answer(&self, run_id: &str, tenant: &str, step: i32, outcome: Value) {
        let (run, attempt) = ((run_id, tenant), (step, None));
        self.env.answer(&self.producer, run, attempt, outcome).await;
    }

    async fn status_of(&self, run_id: &str) -> String {
        self.env.status_of(run_id).await
    }

    async fn settle(&self, run_id: &str, status: &str) {
        self.env.settle(run_id, status).await;
    }

    /// The kept counts, key by key, against a count of the runs.
    async fn counts_match_the_runs(&self) {
        let kept: Vec<(String, String, i32, String, i64)> = sqlx::query_as(
            "SELECT tenant_scope, workflow_name, workflow_version, status, n FROM run_counts \
             WHERE n <> 0 ORDER BY 1, 2, 3, 4",
        )
        .fetch_all(&self.env.db.pool)
        .await
        .unwrap();
        let counted: Vec<(String, String, i32, String, i64)> = sqlx::query_as(
            "SELECT tenant_scope, workflow_name, workflow_version, status, count(*) FROM runs \
             GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4",
        )
        .fetch_all(&self.env.db.pool)
        .await
        .unwrap();
        assert_eq!(kept, counted);
    }
}

fn ids(page: &Value) -> Vec<&str> {
    page["runs"]
        .as_array()
        .unwrap_or_else(|| panic!("a page: {page}"))
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect()
}

fn code(answer: &Value) -> &str {
    answer["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn runs_are_listed_searched_counted_and_traced_per_tenant() {
    let env = Env::start(|_| {}).await;
    let v = Views {
        env,
        producer: producer(),
    };
    let acme = api_key(&v.env.db, "acme", &BOTH).await;
    let globex = api_key(&v.env.db, "globex", &BOTH).await;
    let ops = api_key(&v.env.db, "ops", &[Scope::Admin]).await;

    // Three runs of acme's, ended three ways, and one of globex's left running.
    let done = v.start(&acme, "order-1").await;
    let broken = v.start(&acme, "order-2").await;
    let stopped = v.start(&acme, "order-3").await;
    let theirs = v.start(&globex, "order-1").await;
    for step in 0..3 {
        let ok = json!({"outcome": "succeeded", "output": {"step": step}});
        v.answer(done.as_str(), "acme", step, ok).await;
    }
    let no =
        json!({"outcome": "failed", "error": {"message": "card declined", "retryable": false}});
    v.answer(broken.as_str(), "acme", 0, no).await;
    let (status, answer) = v
        .post(
            &acme,
            &format!("/v1/runs/{stopped}/cancel"),
            &json!({"reason": "test"}),
        )
        .await;
    assert_eq!(status, 202, "{answer}");
    v.settle(done.as_str(), "succeeded").await;
    v.settle(broken.as_str(), "failed").await;
    v.settle(stopped.as_str(), "cancelled").await;
    assert_eq!(v.status_of(&theirs).await, "running");

    // acme's list: its own runs only, newest first, in pages.
    let (status, page) = v.get(&acme, "/v1/runs").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(
        ids(&page),
        [stopped.as_str(), broken.as_str(), done.as_str()]
    );
    assert!(page["next"].is_null());
    let first = page["runs"][2].clone();
    assert_eq!(
        (first["tenant"].as_str(), first["status"].as_str()),
        (Some("acme"), Some("succeeded"))
    );
    assert_eq!(
        (
            first["step_index"].as_i64(),
            first["correlation_id"].as_str()
        ),
        (Some(2), Some("order-1"))
    );
    let (_, one) = v.get(&acme, "/v1/runs?limit=2").await;
    assert_eq!(ids(&one), [stopped.as_str(), broken.as_str()]);
    let after = one["next"].as_str().expect("a next page");
    let (_, two) = v
        .get(&acme, &format!("/v1/runs?limit=2&after={after}"))
        .await;
    assert_eq!(ids(&two), [done.as_str()]);
    assert!(two["next"].is_null());

    // Searches.
    for (query, found) in [
        ("status=failed", vec![broken.as_str()]),
        ("correlation_id=order-1", vec![done.as_str()]),
        (
            "workflow=example&version=1&status=cancelled",
            vec![stopped.as_str()],
        ),
        ("status=running", Vec::<&str>::new()),
        ("step=2", vec![done.as_str()]),
        (
            "created_after=2000-01-01T00:00:00Z&created_before=2001-01-01T00:00:00Z",
            Vec::<&str>::new(),
        ),
        ("workflow=other", Vec::<&str>::new()),
    ] {
        let (status, page) = v.get(&acme, &format!("/v1/runs?{query}")).await;
        assert_eq!(status, 200, "{query}: {page}");
        assert_eq!(ids(&page), found, "{query}");
    }

    // A tenant's key cannot look at another tenant; an admin key sees all.
    let (status, answer) = v.get(&acme, "/v1/runs?tenant=globex").await;
    assert_eq!((status, code(&answer)), (403, "tenant_mismatch"));
    let (_, all) = v.get(&ops, "/v1/runs?correlation_id=order-1").await;
    assert_eq!(ids(&all), [theirs.as_str(), done.as_str()]);
    let (_, globex_only) = v.get(&ops, "/v1/runs?tenant=globex").await;
    assert_eq!(ids(&globex_only), [theirs.as_str()]);
    for query in ["status=finished", "limit=0", "colour=blue", "version=1"] {
        let (status, answer) = v.get(&ops, &format!("/v1/runs?{query}")).await;
        assert_eq!((status, code(&answer)), (400, "invalid_query"), "{query}");
    }

    // Counts: kept ones for tenant, workflow and status; counted ones
    // otherwise; the same numbers either way.
    let (status, kept) = v.get(&acme, "/v1/runs/counts").await;
    assert_eq!(status, 200, "{kept}");
    assert_eq!(
        kept,
        json!({"running": 0, "succeeded": 1, "failed": 1, "cancelled": 1, "total": 3, "exact": true})
    );
    let (_, counted) = v
        .get(&acme, "/v1/runs/counts?created_after=2000-01-01T00:00:00Z")
        .await;
    assert_eq!(counted, kept);
    let (_, everyone) = v.get(&ops, "/v1/runs/counts?workflow=example").await;
    assert_eq!(
        (everyone["running"].as_i64(), everyone["total"].as_i64()),
        (Some(1), Some(4))
    );
    let (_, failed) = v.get(&ops, "/v1/runs/counts?status=failed").await;
    assert_eq!(
        (failed["failed"].as_i64(), failed["total"].as_i64()),
        (Some(1), Some(1))
    );
    v.counts_match_the_runs().await;

    // One run's history: every attempt, every transition, each effect
    // where it is (no drainer runs here: every effect is due).
    let path = format!("/v1/runs/{done}/history");
    let (status, history) = v.get(&acme, &path).await;
    assert_eq!(status, 200, "{history}");
    assert_eq!(history["run"]["status"], "succeeded");
    assert_eq!(history["input"], json!({"n": 1}));
    assert_eq!(history["output"], json!({"step": 2}));
    let attempts = history["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3, "{history}");
    assert!(attempts.iter().all(|a| a["status"] == "succeeded"));
    let transitions = history["transitions"].as_array().unwrap();
    let seqs: Vec<i64> = transitions
        .iter()
        .map(|t| t["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert_eq!(transitions[0]["from_status"], Value::Null);
    assert_eq!(transitions.last().unwrap()["to_status"], "succeeded");
    let effects: Vec<&Value> = transitions
        .iter()
        .flat_map(|t| t["effects"].as_array().unwrap())
        .collect();
    let dispatches = effects
        .iter()
        .filter(|e| e["ce_type"] == "ductor.step.dispatch")
        .count();
    assert_eq!(dispatches, 3, "{history}");
    assert!(
        effects.iter().any(|e| e["ce_type"] == "ductor.run.output"),
        "{history}"
    );
    assert!(
        effects.iter().all(|e| e["publish_status"] == "due"),
        "{history}"
    );
    let (status, answer) = v.get(&globex, &path).await;
    assert_eq!((status, code(&answer)), (404, "not_found"));
    let (status, answer) = v.get(&ops, &path).await;
    assert_eq!(
        (status, answer["run"]["run_id"].as_str()),
        (200, Some(done.as_str()))
    );
    v.env.stop().await;
}

#[tokio::test]
async fn an_operator_sees_the_outbox_redrives_what_is_parked_and_sees_what_retention_deletes() {
    let env = Env::start(|_| {}).await;
    let v = Views {
        env,
        producer: producer(),
    };
    let acme = api_key(&v.env.db, "acme", &BOTH).await;
    let ops = api_key(&v.env.db, "ops", &[Scope::Admin]).await;
    let run = v.start(&acme, "order-9").await;

    // No drainer runs here: the start's effects wait, due. Park them, as
    // failed publishes would have.
    let (status, before) = v.get(&ops, "/v1/outbox").await;
    assert_eq!(status, 200, "{before}");
    let waiting = before["backlog"].as_i64().unwrap();
    assert!(waiting >= 2, "{before}");
    assert_eq!(before["parked"], 0);
    let parked = sqlx::query(
        "UPDATE eec_effect_intent SET status = 'parked', parked_at = now(), \
             publish_failures = 5, last_error = 'the topic is too small' \
         WHERE run_id = $1 AND not_before <= now()",
    )
    .bind(&run)
    .execute(&v.env.db.pool)
    .await
    .unwrap()
    .rows_affected();
    assert!(parked >= 2);
    let (_, picture) = v.get(&ops, "/v1/outbox").await;
    assert_eq!(picture["parked"].as_u64(), Some(parked), "{picture}");
    let listed = picture["parked_intents"].as_array().unwrap();
    assert_eq!(listed.len() as u64, parked);
    assert!(
        listed
            .iter()
            .all(|p| p["run_id"] == run.as_str() && p["last_error"] == "the topic is too small")
    );
    let by_topic: i64 = picture["topics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["parked"].as_i64().unwrap())
        .sum();
    assert_eq!(by_topic as u64, parked);

    // Only an operator sees it and redrives.
    let (status, answer) = v.get(&acme, "/v1/outbox").await;
    assert_eq!((status, code(&answer)), (403, "insufficient_scope"));
    let (status, answer) = v.post(&acme, "/v1/outbox/redrive", &json!({})).await;
    assert_eq!((status, code(&answer)), (403, "insufficient_scope"));
    let (_, none) = v
        .post(&ops, "/v1/outbox/redrive", &json!({"run_id": "another"}))
        .await;
    assert_eq!(none, json!({"redriven": 0}));
    let (status, redriven) = v
        .post(&ops, "/v1/outbox/redrive", &json!({"run_id": run}))
        .await;
    assert_eq!((status, redriven["redriven"].as_u64()), (200, Some(parked)));
    let (_, after) = v.get(&ops, "/v1/outbox").await;
    assert_eq!(
        (after["parked"].as_i64(), after["backlog"].as_i64()),
        (Some(0), Some(waiting))
    );
    assert!(after["oldest_due_age_s"].as_f64().is_some(), "{after}");

    // Retention: nothing is old enough yet, and the settings are shown.
    let (status, retention) = v.get(&ops, "/v1/retention").await;
    assert_eq!(status, 200, "{retention}");
    assert_eq!(
        (
            retention["runs_due"].as_i64(),
            retention["tombstones"].as_i64()
        ),
        (Some(0), Some(0))
    );
    assert_eq!(
        retention["runs_retention_ms"].as_u64(),
        Some(v.env.config.runs.retention_ms)
    );
    assert_eq!(retention["exact"], true);
    v.env.stop().await;
}

/// `ductor` with `args` against the API of `env` as `key`: its exit
/// status, stdout and stderr.
async fn cli(
    env: &Env,
    key: Option<&str>,
    url: Option<String>,
    args: &[&str],
) -> (i32, String, String) {
    let mut command = tokio::process::Command::new(ductor_bin());
    command
        .args(args)
        .env("DATABASE_URL", env.config.database.url.expose())
        .env(
            "DUCTOR_URL",
            url.unwrap_or_else(|| format!("http://{}", env.addr)),
        )
        .env_remove("DUCTOR_API_KEY");
    if let Some(key) = key {
        command.env("DUCTOR_API_KEY", key);
    }
    let out = command.output().await.expect("running ductor");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_lists_shows_counts_and_cancels_over_the_api_with_exit_statuses_scripts_can_use() {
    let env = Env::start(|_| {}).await;
    let v = Views {
        env,
        producer: producer(),
    };
    let acme = api_key(&v.env.db, "acme", &BOTH).await;
    let ops = api_key(&v.env.db, "ops", &[Scope::Admin]).await;
    let first = v.start(&acme, "cli-1").await;
    let second = v.start(&acme, "cli-2").await;

    // A table for people, JSON for scripts, pages followed with --all.
    let (status, table, err) = cli(&v.env, Some(&ops), None, &["runs", "list"]).await;
    assert_eq!(status, 0, "{err}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("RUN"), "{table}");
    assert!(
        lines[1].starts_with(second.as_str()) && lines[2].starts_with(first.as_str()),
        "{table}"
    );
    let (status, json, err) = cli(
        &v.env,
        Some(&ops),
        None,
        &[
            "runs", "list", "--limit", "1", "--all", "--output", "json", "--tenant", "acme",
        ],
    )
    .await;
    assert_eq!(status, 0, "{err}");
    let page: Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(ids(&page), [second.as_str(), first.as_str()]);
    let (_, counts, _) = cli(
        &v.env,
        Some(&acme),
        None,
        &["runs", "counts", "--output", "json"],
    )
    .await;
    let counts: Value = serde_json::from_str(&counts).unwrap();
    assert_eq!(
        (counts["running"].as_i64(), counts["total"].as_i64()),
        (Some(2), Some(2))
    );

    // Cancel, then see it in the run's history.
    let (status, _, err) = cli(
        &v.env,
        Some(&acme),
        None,
        &["runs", "cancel", &first, "--reason", "cli"],
    )
    .await;
    assert_eq!(status, 0, "{err}");
    v.settle(&first, "cancelled").await;
    let (status, shown, err) = cli(&v.env, Some(&acme), None, &["runs", "show", &first]).await;
    assert_eq!(status, 0, "{err}");
    assert!(shown.contains("status     cancelled"), "{shown}");
    assert!(shown.contains("run.cancelled"), "{shown}");
    let (status, outbox, err) = cli(&v.env, Some(&ops), None, &["outbox", "status"]).await;
    assert_eq!(status, 0, "{err}");
    assert!(outbox.contains("(all)"), "{outbox}");

    // Exit statuses: 1 refused (no such run, no key, no scope), 3 out of
    // reach.
    let (status, _, err) = cli(&v.env, Some(&acme), None, &["runs", "show", "nope"]).await;
    assert_eq!(status, 1, "{err}");
    assert!(err.contains("not_found (404)"), "{err}");
    let (status, _, err) = cli(&v.env, None, None, &["runs", "list"]).await;
    assert_eq!(status, 1, "{err}");
    assert!(err.contains("unauthenticated"), "{err}");
    let (status, _, err) = cli(&v.env, Some(&acme), None, &["outbox", "status"]).await;
    assert_eq!(status, 1, "{err}");
    assert!(err.contains("insufficient_scope"), "{err}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (status, _, err) = cli(
        &v.env,
        Some(&acme),
        Some(format!("http://{closed}")),
        &["runs", "list"],
    )
    .await;
    assert_eq!(status, 3, "{err}");
    v.env.stop().await;
}

#[tokio::test]
async fn dead_letters_are_listed_per_tenant_replayed_once_and_discarded_with_a_reason() {
    let env = Env::start(|_| {}).await;
    let v = Views {
        env,
        producer: producer(),
    };
    let acme = api_key(&v.env.db, "acme", &BOTH).await;
    let globex = api_key(&v.env.db, "globex", &BOTH).await;
    let ops = api_key(&v.env.db, "ops", &[Scope::Admin]).await;
    // A signal of acme's for a run that does not exist yet is refused.
    let signal = json!({"type": "wakeup.signal", "schema_version": 1, "run_id": "later-1",
        "tenant": "acme", "signal_id": "s-1", "name": "poke", "payload": {"n": 1}});
    let topic = v.env.config.topic_names().wakeups();
    produce(
        &v.producer,
        &topic,
        "later-1",
        signal.to_string().as_bytes(),
        &[],
    )
    .await;
    let pool = &v.env.db.pool;
    let id: i64 = eventually("the signal is dead-lettered", WAIT, || async {
        sqlx::query_scalar("SELECT id FROM dead_letters WHERE run_id = 'later-1'")
            .fetch_optional(pool)
            .await
            .unwrap()
    })
    .await;

    // acme and an operator see it; globex does not.
    let (status, page) = v.get(&acme, "/v1/dead-letters").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["letters"][0]["id"].as_i64(), Some(id), "{page}");
    let (_, theirs) = v.get(&globex, "/v1/dead-letters").await;
    assert_eq!(theirs["letters"], json!([]));
    let (status, answer) = v.get(&globex, &format!("/v1/dead-letters/{id}")).await;
    assert_eq!((status, code(&answer)), (404, "not_found"));
    let (status, letter) = v.get(&ops, &format!("/v1/dead-letters/{id}")).await;
    assert_eq!(status, 200, "{letter}");
    let value: Value = serde_json::from_str(letter["value"]["utf8"].as_str().unwrap()).unwrap();
    assert_eq!(value, signal, "the letter holds the input whole");
    let (_, counts) = v.get(&acme, "/v1/dead-letters/counts").await;
    let class = letter["class"].as_str().unwrap();
    assert_eq!(counts["counts"][0]["class"], class, "{counts}");

    // Replayed once, however often asked; then it cannot be discarded.
    let replay = format!("/v1/dead-letters/{id}/replay");
    let (status, first) = v.post(&acme, &replay, &json!({})).await;
    assert_eq!(
        (status, first["status"].as_str()),
        (200, Some("replayed")),
        "{first}"
    );
    let (_, again) = v.post(&acme, &replay, &json!({})).await;
    assert_eq!(again["status"], "already_replayed");
    assert_eq!(again["replay_id"], first["replay_id"]);
    assert_eq!(again["offset"], first["offset"]);
    let (status, answer) = v
        .post(
            &acme,
            &format!("/v1/dead-letters/{id}/discard"),
            &json!({"reason": "x"}),
        )
        .await;
    assert_eq!((status, code(&answer)), (409, "letter_settled"));

    // The replayed input is refused again (still no such run): a second
    // letter, which acme discards with a reason, and which then is never
    // replayed.
    let second: i64 = eventually("the replay is dead-lettered again", WAIT, || async {
        sqlx::query_scalar("SELECT id FROM dead_letters WHERE run_id = 'later-1' AND id <> $1")
            .bind(id)
            .fetch_optional(pool)
            .await
            .unwrap()
    })
    .await;
    // From the CLI: listed, then discarded with a reason.
    let (status, listed, err) = cli(
        &v.env,
        Some(&acme),
        None,
        &["dlq", "list", "--status", "pending", "--output", "json"],
    )
    .await;
    assert_eq!(status, 0, "{err}");
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(
        listed["letters"][0]["id"].as_i64(),
        Some(second),
        "{listed}"
    );
    let second_text = second.to_string();
    let (status, discarded, err) = cli(
        &v.env,
        Some(&acme),
        None,
        &["dlq", "discard", &second_text, "--reason", "no such run"],
    )
    .await;
    assert_eq!(status, 0, "{err}");
    assert!(discarded.contains("no such run"), "{discarded}");
    let (status, answer) = v
        .post(
            &ops,
            &format!("/v1/dead-letters/{second}/replay"),
            &json!({}),
        )
        .await;
    assert_eq!((status, code(&answer)), (409, "letter_settled"));
    let (_, batch) = v.post(&ops, "/v1/dead-letters/replay", &json!({})).await;
    assert_eq!(
        batch["replayed"],
        json!([]),
        "nothing is left to replay: {batch}"
    );
    v.env.stop().await;
}
