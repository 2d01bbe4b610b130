//! The web console in a real browser (headless Chromium through WebDriver)
//! against a real `serve` with its drainer, Kafka and Postgres: an operator
//! pastes a key with the `admin` scope, sees every tenant's runs with live
//! counts, filters them by status, opens a run and sees a bar for each of
//! its attempts and the backoff between two, cancels a running run with the
//! button and sees it end as cancelled, retries a failed run with its
//! button and sees it succeed, and reads the overview's charts of
//! the metrics; on the dead letters' page, finds a refused start under its
//! class, reads its payload, replays it and follows the outcome to the run
//! it started, and discards another letter with a reason. A screenshot of
//! each page is saved under `artifacts/screenshots/` (ignored by git).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;
mod webdriver;

use std::path::PathBuf;
use std::time::Duration;

use common::Serve as Env;
use common::*;
use ductor::auth::Scope;
use ductor::config::SigningKey;
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use webdriver::{Browser, Driver};

const WAIT: Duration = Duration::from_secs(30);

/// Where the screenshots go: a folder git ignores.
fn screenshots() -> PathBuf {
    workspace_dir().join("artifacts").join("screenshots")
}

/// The runs the console is shown, made through the public API as a
/// tenant's client and its workers would.
struct Seeded {
    env: Env,
    producer: FutureProducer,
}

impl Seeded {
    async fn start(&self, token: &str, workflow: &str, correlation_id: &str) -> String {
        let body = json!({"workflow": workflow, "correlation_id": correlation_id,
                          "input": {"order": correlation_id}});
        self.env.start_run_with(token, &body).await
    }

    /// Answers attempt `attempt` of `run_id`'s step `step`, once it is
    /// dispatched, with `outcome`, as a worker would.
    async fn answer(&self, run_id: &str, tenant: &str, step: i32, attempt: i32, outcome: Value) {
        let (run, attempt) = ((run_id, tenant), (step, Some(attempt)));
        self.env.answer(&self.producer, run, attempt, outcome).await;
    }

    async fn settle(&self, run_id: &str, status: &str) {
        self.env.settle(run_id, status).await;
    }
}

/// The console as an operator uses it: what a page shows and what its
/// buttons do, one method per thing a person does.
struct Console {
    browser: Browser,
    /// `http://<admin listener>`.
    origin: String,
}

impl Console {
    /// Opens `/ui`, pastes `key` into its form, and waits for the runs.
    async fn sign_in(&self, key: &str) {
        self.browser.goto(&format!("{}/ui", self.origin)).await;
        self.browser.wait_for("#key-input", WAIT).await;
        self.shot("key").await;
        self.browser.type_into("#key-input", key, WAIT).await;
        self.browser.click("#key-submit", WAIT).await;
        self.runs_loaded().await;
    }

    /// Waits until the runs table has been read.
    async fn runs_loaded(&self) {
        self.browser
            .until(
                "the runs table",
                "const t = document.getElementById('runs-table'); return !!t && t.dataset.loaded === 'true';",
                WAIT,
            )
            .await;
    }

    /// The page's hash route.
    async fn go(&self, hash: &str) {
        self.browser
            .script(&format!("location.hash = {}; return true;", json!(hash)))
            .await;
    }

    /// The run ids and statuses of the table's rows.
    async fn rows(&self) -> Vec<(String, String)> {
        let rows = self
            .browser
            .script(
                "return [...document.querySelectorAll('#runs-body tr[data-run-id]')]\
                 .map(r => [r.dataset.runId, r.dataset.status]);",
            )
            .await;
        serde_json::from_value(rows).expect("pairs of strings")
    }

    /// Waits until the count of `status` (`total` for all) reads `n`.
    async fn count_reads(&self, status: &str, n: u64) {
        let js = format!(
            "const e = document.querySelector('#count-{status} .n'); return !!e && e.textContent === '{n}';"
        );
        self.browser
            .until(&format!("the {status} count to read {n}"), &js, WAIT)
            .await;
    }

    /// Picks `status` in the filter and applies it.
    async fn filter_by_status(&self, status: &str) {
        self.browser.choose("#f-status", status, WAIT).await;
        self.browser.click("#apply-filters", WAIT).await;
        let js = format!(
            "return location.hash.includes('status={status}') && \
             document.getElementById('runs-table')?.dataset.loaded === 'true' && \
             [...document.querySelectorAll('#runs-body tr[data-run-id]')].every(r => r.dataset.status === '{status}');"
        );
        self.browser
            .until(&format!("runs filtered by {status}"), &js, WAIT)
            .await;
    }

    /// Opens a run's page from its row in the table.
    async fn open_run_from_table(&self, run_id: &str) {
        let link = format!("#runs-body tr[data-run-id='{run_id}'] a.run-link");
        self.browser.click(&link, WAIT).await;
        self.run_page(run_id).await;
    }

    /// Opens a run's page by its address.
    async fn open_run(&self, run_id: &str) {
        self.go(&format!("#/runs/{run_id}")).await;
        self.run_page(run_id).await;
    }

    async fn run_page(&self, run_id: &str) {
        let js = format!(
            "return document.getElementById('run-id')?.textContent === {} && !!document.getElementById('timeline');",
            json!(run_id)
        );
        self.browser
            .until(&format!("the page of {run_id}"), &js, WAIT)
            .await;
    }

    /// The timeline's bars: `(step, attempt, status)` of each.
    async fn bars(&self) -> Vec<(u32, u32, String)> {
        let bars = self
            .browser
            .script(
                "return [...document.querySelectorAll('#timeline rect.bar')]\
                 .map(b => [Number(b.dataset.step), Number(b.dataset.attempt), b.dataset.status]);",
            )
            .await;
        serde_json::from_value(bars).expect("triples")
    }

    /// Presses the run page's button of `action` (`cancel`, `retry`) and
    /// confirms it, then waits for the run page to show `status`.
    async fn act_on_run(&self, action: &str, status: &str) {
        self.browser.click(&format!("#{action}-run"), WAIT).await;
        self.browser
            .click(&format!("#confirm-{action}"), WAIT)
            .await;
        self.run_status_reads(status).await;
    }

    /// Waits until the run page's status badge reads `status`.
    async fn run_status_reads(&self, status: &str) {
        let js =
            format!("return document.getElementById('run-status')?.textContent === '{status}';");
        self.browser
            .until(&format!("the run's status to read {status}"), &js, WAIT)
            .await;
    }

    /// Opens the page that the navigation names `page`.
    async fn open_page(&self, page: &str) {
        self.browser.click(&format!("#nav-{page}"), WAIT).await;
    }

    /// Waits until the dead letters' table has been read and shows the
    /// letters of `ids`, in that order.
    async fn letters_read(&self, ids: &[i64]) {
        let js = format!(
            "const t = document.getElementById('letters-table'); \
             return !!t && t.dataset.loaded === 'true' && \
             JSON.stringify([...document.querySelectorAll('#letters-body tr[data-letter-id]')]\
             .map(r => Number(r.dataset.letterId))) === {};",
            json!(json!(ids).to_string())
        );
        self.browser
            .until(&format!("the letters {ids:?}"), &js, WAIT)
            .await;
    }

    /// Waits until the chip of `class` (`None`: all classes) reads `n`.
    async fn class_count_reads(&self, class: Option<&str>, n: u64) {
        let chip = match class {
            Some(class) => format!("#letter-classes a[data-class='{class}'] .n"),
            None => "#class-all .n".to_owned(),
        };
        let js = format!(
            "const e = document.querySelector({}); return !!e && e.textContent === '{n}';",
            json!(chip)
        );
        self.browser
            .until(&format!("the {class:?} chip to read {n}"), &js, WAIT)
            .await;
    }

    /// Opens a letter's page from its row in the table.
    async fn open_letter_from_table(&self, id: i64) {
        let link = format!("#letters-body tr[data-letter-id='{id}'] a.letter-link");
        self.browser.click(&link, WAIT).await;
        let js = format!(
            "return document.getElementById('letter-id')?.textContent === '{id}' && \
             !!document.getElementById('letter-value');"
        );
        self.browser
            .until(&format!("the page of letter {id}"), &js, WAIT)
            .await;
    }

    /// Waits until the letter page's state reads `status`.
    async fn letter_status_reads(&self, status: &str) {
        let js =
            format!("return document.getElementById('letter-status')?.textContent === '{status}';");
        self.browser
            .until(&format!("the letter's state to read {status}"), &js, WAIT)
            .await;
    }

    /// The text of the element `css`, once it is there.
    async fn text_of(&self, css: &str) -> String {
        let js = format!(
            "const e = document.querySelector({}); return e ? e.textContent : null;",
            json!(css)
        );
        let text = self.browser.until(css, &js, WAIT).await;
        text.as_str().unwrap_or_default().to_owned()
    }

    /// Whether the page has met a Content-Security-Policy violation.
    async fn policy_violations(&self) -> Value {
        self.browser
            .script("return document.body.dataset.policyViolations || null;")
            .await
    }

    async fn shot(&self, name: &str) {
        self.browser
            .screenshot(&screenshots().join(format!("console-{name}.png")))
            .await;
    }
}

#[tokio::test]
async fn an_operator_finds_inspects_cancels_and_retries_runs_in_the_console() {
    let env = Env::start(|c| c.drainer.enabled = true).await;
    let seeded = Seeded {
        env,
        producer: producer(),
    };
    let acme = api_key(&seeded.env.db, "acme", &[Scope::RunsWrite]).await;
    let globex = api_key(&seeded.env.db, "globex", &[Scope::RunsWrite]).await;
    let ops = api_key(&seeded.env.db, "ops", &[Scope::Admin]).await;

    // A run that failed once and was retried before it succeeded, one that
    // failed, and two of two tenants left waiting for a signal (an `order`
    // run, whose first step is answered).
    let retried = seeded.start(&acme, "example", "order-1").await;
    let broken = seeded.start(&acme, "example", "order-2").await;
    let running = seeded.start(&acme, "order", "order-3").await;
    let theirs = seeded.start(&globex, "order", "order-1").await;
    let flaky =
        json!({"outcome": "failed", "error": {"message": "gateway timeout", "retryable": true}});
    seeded.answer(&retried, "acme", 0, 1, flaky).await;
    for (step, attempt) in [(0, 2), (1, 1), (2, 1)] {
        let ok = json!({"outcome": "succeeded", "output": {"step": step}});
        seeded.answer(&retried, "acme", step, attempt, ok).await;
    }
    let declined =
        json!({"outcome": "failed", "error": {"message": "card declined", "retryable": false}});
    seeded.answer(&broken, "acme", 0, 1, declined).await;
    let reserved = json!({"outcome": "succeeded", "output": {"reserved": true}});
    seeded
        .answer(&running, "acme", 0, 1, reserved.clone())
        .await;
    seeded.answer(&theirs, "globex", 0, 1, reserved).await;
    seeded.settle(&retried, "succeeded").await;
    seeded.settle(&broken, "failed").await;

    // The pages carry no data and take no key; the data takes the admin
    // scope on the admin listener, even under `admin_auth = "loopback"`.
    let admin = seeded.env.admin;
    let (status, _) = http(admin, "GET", "/ui", &[], b"").await;
    assert_eq!(status, 200);
    let (status, _) = http(admin, "GET", "/v1/runs", &[], b"").await;
    assert_eq!(status, 401, "the operator's views take a key");
    let tenant_key = api_key(&seeded.env.db, "acme", &[Scope::RunsRead]).await;
    let auth = bearer(&tenant_key);
    let (status, _) = http(admin, "GET", "/v1/runs", &[(auth.0, &auth.1)], b"").await;
    assert_eq!(status, 403, "a tenant's reader is no operator");

    let driver = Driver::start().await;
    let console = Console {
        browser: driver.browser(1400, 1000).await,
        origin: format!("http://{admin}"),
    };

    // A key, once; then every tenant's runs, newest first, with counts.
    console.sign_in(&ops).await;
    console.count_reads("total", 4).await;
    console.count_reads("running", 2).await;
    console.count_reads("failed", 1).await;
    let rows = console.rows().await;
    let ids: Vec<&str> = rows.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            theirs.as_str(),
            running.as_str(),
            broken.as_str(),
            retried.as_str()
        ]
    );
    console.shot("runs").await;

    console.filter_by_status("failed").await;
    let rows = console.rows().await;
    assert_eq!(rows, [(broken.clone(), "failed".to_owned())]);
    console.shot("runs-failed").await;

    // A run's timeline: a bar per attempt, the backoff between the two of
    // its first step.
    console.go("#/runs").await;
    console.runs_loaded().await;
    console.open_run_from_table(&retried).await;
    console.run_status_reads("succeeded").await;
    let bars = console.bars().await;
    assert_eq!(
        bars,
        [
            (0, 1, "failed".to_owned()),
            (0, 2, "succeeded".to_owned()),
            (1, 1, "succeeded".to_owned()),
            (2, 1, "succeeded".to_owned()),
        ]
    );
    console
        .browser
        .until(
            "the backoff between the first step's attempts",
            "return document.querySelectorAll('#timeline line.backoff').length === 1;",
            WAIT,
        )
        .await;
    console
        .browser
        .click("#timeline rect.bar.att-failed", WAIT)
        .await;
    console
        .browser
        .until(
            "the failed attempt's error, one click away",
            "return (document.getElementById('attempt-detail')?.textContent || '').includes('gateway timeout');",
            WAIT,
        )
        .await;
    assert!(
        console.browser.find("#cancel-run").await.is_none(),
        "a finished run offers no cancel"
    );
    console.shot("run-retried").await;

    // A run waiting for a signal, cancelled with its button, ends as
    // cancelled.
    console.open_run(&running).await;
    console.run_status_reads("running").await;
    let bars = console.bars().await;
    assert_eq!(bars, [(0, 1, "succeeded".to_owned())]);
    console
        .browser
        .until(
            "the wait for the signal on the timeline",
            "return [...document.querySelectorAll('#timeline .wait-label')]\
             .some(l => l.textContent.includes('payment_confirmed'));",
            WAIT,
        )
        .await;
    console.shot("run-waiting").await;
    console.act_on_run("cancel", "cancelled").await;
    seeded.settle(&running, "cancelled").await;
    console
        .browser
        .until(
            "the run's end on the timeline",
            "return !!document.querySelector('#timeline line.end-cancelled');",
            WAIT,
        )
        .await;
    console.shot("run-cancelled").await;

    // The failed run, retried with its button from the step it failed in:
    // a fresh attempt, answered, and the run succeeds.
    console.open_run(&broken).await;
    console.run_status_reads("failed").await;
    assert!(
        console.browser.find("#cancel-run").await.is_none(),
        "a failed run is retried, not cancelled, from the console"
    );
    console.act_on_run("retry", "running").await;
    for (step, attempt) in [(0, 2), (1, 1), (2, 1)] {
        let ok = json!({"outcome": "succeeded", "output": {"step": step}});
        seeded.answer(&broken, "acme", step, attempt, ok).await;
    }
    seeded.settle(&broken, "succeeded").await;
    console.run_status_reads("succeeded").await;
    assert_eq!(
        console.bars().await,
        [
            (0, 1, "failed".to_owned()),
            (0, 2, "succeeded".to_owned()),
            (1, 1, "succeeded".to_owned()),
            (2, 1, "succeeded".to_owned()),
        ]
    );
    console
        .browser
        .until(
            "the operator's retry on the timeline",
            "return document.querySelectorAll('#timeline line.retried').length === 1 \
             && document.querySelectorAll('#timeline line.failed-gap').length === 1;",
            WAIT,
        )
        .await;
    assert!(
        console.browser.find("#retry-run").await.is_none(),
        "a run that succeeded offers no retry"
    );
    console.shot("run-retry-succeeded").await;

    // The overview: the metrics, sampled while the console is open.
    console.open_page("overview").await;
    console
        .browser
        .until(
            "the throughput and the backlog charted from three samples or more",
            "const n = (id) => Number(document.getElementById(id)?.dataset.points || 0); \
             return n('spark-throughput') >= 2 && n('spark-backlog') >= 3;",
            WAIT,
        )
        .await;
    console.shot("overview").await;

    assert_eq!(
        console.policy_violations().await,
        Value::Null,
        "the pages keep to their Content-Security-Policy"
    );
    console.browser.quit().await;
    drop(driver);
    seeded.env.stop().await;
}

/// The id of the letter recorded for the input at `partition`/`offset` of
/// `topic`, once the ingress has refused it.
async fn letter_of(env: &Env, (topic, partition, offset): (&str, i32, i64)) -> i64 {
    eventually("the input is dead-lettered", WAIT, || async {
        sqlx::query_scalar(
            "SELECT id FROM dead_letters WHERE source_topic = $1 AND source_partition = $2 \
             AND source_offset = $3",
        )
        .bind(topic)
        .bind(partition)
        .bind(offset)
        .fetch_optional(&env.db.pool)
        .await
        .unwrap()
    })
    .await
}

#[tokio::test]
async fn an_operator_replays_and_discards_dead_letters_in_the_console() {
    // Starts of pool "signed" must carry acme's signature: an unsigned one
    // is dead-lettered, and its replay, which Ductor signs, starts the run.
    let env = Env::start(|c| {
        c.signatures.pools = vec!["signed".into()];
        c.signatures
            .tenant_keys
            .insert("acme".into(), SigningKey("acme-key-0123456789".into()));
    })
    .await;
    let ops = api_key(&env.db, "ops", &[Scope::Admin]).await;
    let producer = producer();
    let requests = env.config.topic_names().requests();
    let run_id = unique("replayed-");
    let start = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "pool": "signed",
        "input": {"order": "dl-1"}});
    let (start_partition, start_offset) = produce(
        &producer,
        &requests,
        &run_id,
        start.to_string().as_bytes(),
        &[("origin", "checkout")],
    )
    .await;
    let refused = letter_of(&env, (&requests, start_partition, start_offset)).await;
    let (partition, offset) =
        produce(&producer, &requests, "k-junk", b"{\"type\": oops", &[]).await;
    let malformed = letter_of(&env, (&requests, partition, offset)).await;
    assert!(malformed > refused, "ids grow with time");

    // The letters take the admin scope on the admin listener.
    let admin = env.admin;
    let (status, _) = http(admin, "GET", "/v1/dead-letters", &[], b"").await;
    assert_eq!(status, 401, "the dead letters take a key");
    let tenant_key = api_key(&env.db, "acme", &[Scope::RunsRead, Scope::RunsWrite]).await;
    let auth = bearer(&tenant_key);
    let (status, _) = http(admin, "GET", "/v1/dead-letters", &[(auth.0, &auth.1)], b"").await;
    assert_eq!(status, 403, "a tenant's key is no operator's");

    let driver = Driver::start().await;
    let console = Console {
        browser: driver.browser(1400, 1000).await,
        origin: format!("http://{admin}"),
    };
    console.sign_in(&ops).await;

    // Every letter, newest first, with a chip per class.
    console.open_page("letters").await;
    console.letters_read(&[malformed, refused]).await;
    console.class_count_reads(None, 2).await;
    console.class_count_reads(Some("unauthenticated"), 1).await;
    console.class_count_reads(Some("malformed"), 1).await;
    console.shot("dead-letters").await;

    // A click on a class shows its letters only.
    console
        .browser
        .click("#letter-classes a[data-class='unauthenticated']", WAIT)
        .await;
    console.letters_read(&[refused]).await;
    assert_eq!(
        console
            .text_of(&format!(
                "#letters-body tr[data-letter-id='{refused}'] td:nth-child(4)"
            ))
            .await,
        format!("{requests} / {start_partition} @ {start_offset}"),
    );
    console.shot("dead-letters-unauthenticated").await;

    // The letter: its error, its headers and its value as JSON.
    console.open_letter_from_table(refused).await;
    console.letter_status_reads("pending").await;
    let value: Value = serde_json::from_str(&console.text_of("#letter-value").await)
        .expect("the value shown as JSON");
    assert_eq!(value, start);
    assert!(
        console
            .text_of("#letter-value")
            .await
            .contains("\n  \"run_id\""),
        "pretty-printed"
    );
    assert!(
        console
            .text_of("#letter-headers")
            .await
            .contains("checkout")
    );
    assert!(!console.text_of("#letter-error").await.is_empty());
    console.shot("dead-letter").await;

    // Replayed with its button: the outcome names the run it started, and
    // leads to it.
    console.browser.click("#replay-letter", WAIT).await;
    console.browser.click("#confirm-replay", WAIT).await;
    console.letter_status_reads("replayed").await;
    assert_eq!(console.text_of("#outcome-run").await, run_id);
    console
        .browser
        .until(
            "the outcome to say the run started",
            "return document.getElementById('outcome-run-state')?.dataset.exists === 'true';",
            WAIT,
        )
        .await;
    assert!(
        console.browser.find("#replay-letter").await.is_none(),
        "a replayed letter offers no second replay"
    );
    console.shot("dead-letter-replayed").await;
    console.browser.click("#outcome-run", WAIT).await;
    console.run_page(&run_id).await;
    console.run_status_reads("running").await;
    console.shot("dead-letter-run").await;

    // The malformed one, shown as text, discarded with a reason.
    console.open_page("letters").await;
    console.letters_read(&[malformed, refused]).await;
    console.open_letter_from_table(malformed).await;
    assert_eq!(console.text_of("#letter-value").await, "{\"type\": oops");
    let shown_as = console
        .browser
        .script("return document.getElementById('letter-value').dataset.as;")
        .await;
    assert_eq!(shown_as, "text");
    assert!(
        console.browser.find("#replay-letter").await.is_some(),
        "a pending letter offers its replay"
    );
    console.browser.click("#discard-letter", WAIT).await;
    let reason = "garbage from a test client";
    console
        .browser
        .type_into("#discard-reason", reason, WAIT)
        .await;
    console.browser.click("#confirm-discard", WAIT).await;
    console.letter_status_reads("discarded").await;
    assert_eq!(console.text_of("#outcome-reason").await, reason);
    assert!(
        console.browser.find("#replay-letter").await.is_none(),
        "a discarded letter offers no replay"
    );
    let kept: Option<String> =
        sqlx::query_scalar("SELECT discard_reason FROM dead_letters WHERE id = $1")
            .bind(malformed)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(kept.as_deref(), Some(reason));
    console.shot("dead-letter-discarded").await;

    // Back on the list, each letter's state is what was done to it.
    console.browser.click("#back-to-letters", WAIT).await;
    console.letters_read(&[malformed, refused]).await;
    let states = console
        .browser
        .script(
            "return [...document.querySelectorAll('#letters-body tr[data-letter-id]')]\
             .map(r => r.dataset.status);",
        )
        .await;
    assert_eq!(states, json!(["discarded", "replayed"]));

    assert_eq!(
        console.policy_violations().await,
        Value::Null,
        "the pages keep to their Content-Security-Policy"
    );
    console.browser.quit().await;
    drop(driver);
    env.stop().await;
}
