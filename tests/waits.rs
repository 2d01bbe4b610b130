//! Steps that wait, end to end on the real stack: `serve` folds the inputs,
//! the example worker runs the tasks, and the waits end by the durable wake
//! timers the outbox publishes. A signal that comes before its step waits is
//! kept and consumed when the step starts; one that comes while it waits
//! ends the wait; a wait that times out fails the run or goes on; a sleep
//! outlives a restart of `serve`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use common::{TestDb, eventually, example_worker, produce, producer, test_config};
use ductor::config::Config;
use ductor::contract::effects::rfc3339;
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;

const DONE: Duration = Duration::from_secs(120);
/// Long enough that a signal sent as soon as the run exists comes before
/// the await step that follows it.
const SETTLE_MS: u64 = 4_000;

/// `hold`: a sleep, an await of `approval` that fails the run after a
/// minute, then a task. `expire`: a task, an await of `nudge` that goes on
/// after a short wait, then a sleep until the time in the input.
fn workflows(dir: &std::path::Path) {
    let hold = format!(
        "name = \"hold\"\nversion = 1\n\n\
         [[steps]]\nname = \"settle\"\nkind = \"sleep\"\nduration_ms = {SETTLE_MS}\n\n\
         [[steps]]\nname = \"approved\"\nkind = \"await_signal\"\nsignal = \"approval\"\n\
         timeout_ms = 60000\non_timeout = \"fail\"\n\n\
         [[steps]]\nname = \"ship\"\npool = \"p\"\ntimeout_ms = 5000\n"
    );
    let expire = "name = \"expire\"\nversion = 1\n\n\
         [[steps]]\nname = \"prepare\"\npool = \"p\"\ntimeout_ms = 5000\n\n\
         [[steps]]\nname = \"nudged\"\nkind = \"await_signal\"\nsignal = \"nudge\"\n\
         timeout_ms = 1500\non_timeout = \"continue\"\n\n\
         [[steps]]\nname = \"until\"\nkind = \"sleep\"\nuntil = \"/ship_at\"\n";
    let strict = "name = \"strict\"\nversion = 1\n\n\
         [[steps]]\nname = \"approved\"\nkind = \"await_signal\"\nsignal = \"approval\"\n\
         timeout_ms = 1500\n\n\
         [[steps]]\nname = \"ship\"\npool = \"p\"\ntimeout_ms = 5000\n";
    std::fs::write(dir.join("hold.toml"), hold).unwrap();
    std::fs::write(dir.join("expire.toml"), expire).unwrap();
    std::fs::write(dir.join("strict.toml"), strict).unwrap();
}

fn spawn_worker(config: &Config) -> Child {
    example_worker(config)
        .args(["--pool", "p", "--fail-rate", "0", "--work-ms", "0"])
        .spawn()
        .expect("starting the example worker")
}

async fn start(p: &FutureProducer, config: &Config, run_id: &str, workflow: &str, input: Value) {
    let start = json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
        "workflow": workflow, "input": input,
    });
    let topic = config.topic_names().requests();
    produce(p, &topic, run_id, start.to_string().as_bytes(), &[]).await;
}

async fn signal(p: &FutureProducer, config: &Config, run_id: &str, id: &str, name: &str) {
    let signal = json!({
        "type": "wakeup.signal", "schema_version": 1, "run_id": run_id, "tenant": "acme",
        "signal_id": id, "name": name, "payload": {"by": id},
    });
    let topic = config.topic_names().wakeups();
    produce(p, &topic, run_id, signal.to_string().as_bytes(), &[]).await;
}

/// The run's status and state, once it exists and `ready` holds for them.
async fn run_when(
    db: &TestDb,
    run_id: &str,
    what: &str,
    ready: impl Fn(&str, &Value) -> bool,
) -> (String, Value) {
    eventually(what, DONE, || async {
        let row: Option<(String, Value)> =
            sqlx::query_as("SELECT status, state FROM runs WHERE run_id = $1")
                .bind(run_id)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        row.filter(|(status, state)| ready(status, state))
    })
    .await
}

async fn terminal(db: &TestDb, run_id: &str) -> (String, Value) {
    run_when(db, run_id, &format!("{run_id} ended"), |status, _| {
        status != "running"
    })
    .await
}

async fn transition_kinds(db: &TestDb, run_id: &str) -> Vec<(String, Value)> {
    sqlx::query_as("SELECT kind, detail FROM run_transitions WHERE run_id = $1 ORDER BY seq")
        .bind(run_id)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn waiting_steps_end_by_signal_timeout_and_time_through_a_restart() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    workflows(dir.path());
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    config.drainer.poll_interval_ms = 200;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let id = |name: &str| format!("{name}-{}", common::unique("r"));
    let (early, late, lapsed, strict) = (id("early"), id("late"), id("lapsed"), id("strict"));

    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let mut worker = spawn_worker(&config);
    let p = producer();
    let ship_at = rfc3339(Utc::now() + TimeDelta::seconds(8));
    start(&p, &config, &early, "hold", json!({"order": 1})).await;
    start(&p, &config, &late, "hold", json!({"order": 2})).await;
    start(&p, &config, &lapsed, "expire", json!({"ship_at": ship_at})).await;
    start(&p, &config, &strict, "strict", json!({"order": 4})).await;

    // `early` is signalled while it sleeps, twice under one id: the signal
    // is kept for the await step that follows, once.
    run_when(&db, &early, "early sleeps", |_, s| {
        s["waiting"]["step_index"] == 0
    })
    .await;
    signal(&p, &config, &early, "sig-early", "approval").await;
    signal(&p, &config, &early, "sig-early", "approval").await;
    let (_, kept) = run_when(&db, &early, "the early signal kept", |_, s| {
        s["signals"][0]["kept"] == true || s["step_index"].as_u64() > Some(0)
    })
    .await;
    assert_eq!(
        kept["waiting"]["step_index"], 0,
        "kept while asleep: {kept}"
    );

    // `serve` stops while `late` sleeps; the sleep ends after the restart,
    // by the wake timer committed before it.
    shutdown.cancel();
    serve.await.unwrap().expect("serve stops cleanly");
    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));

    // `late` is signalled once it waits for the signal: the wait ends.
    let (_, waiting) = run_when(&db, &late, "late awaits approval", |_, s| {
        s["waiting"]["signal"] == "approval"
    })
    .await;
    assert_eq!(waiting["waiting"]["step_index"], 1);
    signal(&p, &config, &late, "sig-late", "approval").await;

    for (run_id, signal_id) in [(&early, "sig-early"), (&late, "sig-late")] {
        let (status, state) = terminal(&db, run_id).await;
        assert_eq!(status, "succeeded", "{run_id}: {state}");
        let output = &state["output"];
        assert!(output["settle"]["until"].is_string(), "{run_id}: {output}");
        assert_eq!(output["approved"]["signal_id"], signal_id, "{output}");
        assert_eq!(output["approved"]["payload"], json!({"by": signal_id}));
        assert_eq!(output["ship"]["done"], true, "{output}");
        assert!(output["order"].as_u64().is_some(), "{output}");
        let consumed: Vec<&Value> = state["signals"].as_array().unwrap().iter().collect();
        assert_eq!(consumed.len(), 1, "{run_id}: one signal recorded: {state}");
        assert_eq!(consumed[0]["consumed_by"], 1);
        assert!(consumed[0].get("payload").is_none(), "{state}");
    }
    let kinds = transition_kinds(&db, &early).await;
    let signalled: Vec<_> = kinds.iter().filter(|(k, _)| k == "run.signalled").collect();
    assert_eq!(signalled.len(), 1, "the kept signal: {kinds:?}");

    // `lapsed` was never nudged: it went on after 1.5 s, then slept until
    // the time its input names.
    let (status, state) = terminal(&db, &lapsed).await;
    assert_eq!(status, "succeeded", "{state}");
    assert_eq!(state["output"]["nudged"], json!({"timed_out": true}));
    assert_eq!(state["output"]["until"]["until"], json!(ship_at));
    let ended: (chrono::DateTime<Utc>,) = sqlx::query_as(
        "SELECT created_at FROM run_transitions WHERE run_id = $1 ORDER BY seq DESC LIMIT 1",
    )
    .bind(&lapsed)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let ship_at = chrono::DateTime::parse_from_rfc3339(&ship_at).unwrap();
    assert!(ended.0 >= ship_at, "ended at {} before {ship_at}", ended.0);

    // `strict` was never approved: the run failed, naming the signal.
    let (status, state) = terminal(&db, &strict).await;
    assert_eq!(status, "failed", "{state}");
    let kinds = transition_kinds(&db, &strict).await;
    let (kind, detail) = kinds.last().unwrap();
    assert_eq!(kind, "run.failed");
    assert_eq!(detail["cause"], "signal_timeout", "{detail}");
    assert!(
        state["error"].as_str().unwrap().contains("approval"),
        "{state}"
    );
    let dispatched: (i64,) = sqlx::query_as("SELECT count(*) FROM run_attempts WHERE run_id = $1")
        .bind(&strict)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dispatched.0, 0, "nothing after the failed wait ran");

    let _ = worker.kill().await;
    shutdown.cancel();
    serve.await.unwrap().expect("serve stops cleanly");
    db.drop_db().await;
}
