//! The whole promise of a step key, end to end: the example worker charges
//! each run through a local payments service that honours idempotency keys,
//! passing the dispatch's `step_key`. Worker processes are killed after the
//! service took a charge and before it answered, and other calls outlast
//! their attempt's deadline; the step runs again, and every run is still
//! charged exactly once.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use common::{TestDb, eventually, example_worker, produce, producer, test_config};
use ductor::config::Config;
use serde_json::{Value, json};
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const RUNS: usize = 24;
/// Long enough for a healthy call, short enough that a hung one times out
/// the attempt within the test.
const STEP_TIMEOUT_MS: u64 = 3_000;
const DONE: Duration = Duration::from_secs(180);

/// What the service does after it took a run's first charge.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    Answer,
    /// Never answers: the call outlasts the attempt.
    Hang,
    /// Tells the test to kill the worker making the call, then never answers.
    KillWorker,
}

fn fate(run: usize) -> Fate {
    match run {
        3 | 14 => Fate::KillWorker,
        r if r % 4 == 1 => Fate::Hang,
        _ => Fate::Answer,
    }
}

/// The payments service's books.
#[derive(Default)]
struct Ledger {
    /// The answer given for each idempotency key.
    by_key: HashMap<String, Value>,
    /// Charges made, by run.
    charges: HashMap<String, Vec<String>>,
    /// Requests received, by run.
    requests: HashMap<String, u32>,
}

#[derive(Clone)]
struct Payments {
    ledger: Arc<Mutex<Ledger>>,
    fates: Arc<HashMap<String, Fate>>,
    kill: mpsc::UnboundedSender<String>,
}

/// `POST /charges` with `Idempotency-Key`: a new key makes a charge, a known
/// one gets the answer the charge made, whatever the body says.
async fn charges(
    State(p): State<Payments>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Json<Value>, StatusCode> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .ok_or(StatusCode::BAD_REQUEST)?
        .to_owned();
    let run_id = body["run_id"]
        .as_str()
        .ok_or(StatusCode::BAD_REQUEST)?
        .to_owned();
    let (answer, first) = {
        let mut ledger = p.ledger.lock().unwrap();
        *ledger.requests.entry(run_id.clone()).or_default() += 1;
        if let Some(known) = ledger.by_key.get(&key) {
            return Ok(Json(known.clone()));
        }
        let id = format!("ch_{}", uuid::Uuid::new_v4().simple());
        let answer = json!({"charge_id": id, "amount": body["amount"]});
        ledger.by_key.insert(key, answer.clone());
        let run = ledger.charges.entry(run_id.clone()).or_default();
        run.push(id);
        (answer, run.len() == 1)
    };
    // Only a run's first charge meets its fate: a worker that charges again
    // (a step key that changed between attempts) is answered, and the
    // second charge shows in the books.
    let fate = p.fates.get(&run_id).copied().unwrap_or(Fate::Answer);
    match if first { fate } else { Fate::Answer } {
        Fate::Answer => Ok(Json(answer)),
        Fate::Hang => std::future::pending().await,
        Fate::KillWorker => {
            let _ = p.kill.send(run_id);
            std::future::pending().await
        }
    }
}

async fn serve_payments(payments: Payments) -> SocketAddr {
    let app = Router::new()
        .route("/charges", post(charges))
        .with_state(payments);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn workflow_toml() -> String {
    format!(
        "name = \"pay\"\nversion = 1\n\n[[steps]]\nname = \"charge\"\npool = \"p\"\n\
         timeout_ms = {STEP_TIMEOUT_MS}\n\n[steps.retry]\nmax_attempts = 10\n\
         initial_backoff_ms = 100\nmax_backoff_ms = 500\n"
    )
}

/// An example worker process of pool `p` charging through `payments`.
fn spawn_worker(config: &Config, payments: SocketAddr) -> Child {
    example_worker(config)
        .args(["--pool", "p", "--fail-rate", "0", "--work-ms", "0"])
        .arg("--payments-url")
        .arg(format!("http://{payments}"))
        .env(
            "DUCTOR__KAFKA__SESSION_TIMEOUT_MS",
            config.kafka.session_timeout_ms.to_string(),
        )
        .spawn()
        .expect("starting the example worker")
}

async fn run_rows(db: &TestDb) -> Vec<(String, String, Value)> {
    sqlx::query_as("SELECT run_id, status, state->'output' FROM runs ORDER BY run_id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn every_run_is_charged_exactly_once_through_worker_kills_and_timeouts() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pay.toml"), workflow_toml()).unwrap();
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    // A killed worker's partitions move to the next one after this long.
    config.kafka.session_timeout_ms = 6_000;
    config.drainer.poll_interval_ms = 200;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");

    let run_ids: Vec<String> = (0..RUNS)
        .map(|i| format!("pay-{i:02}-{}", common::unique("r")))
        .collect();
    let fates: HashMap<String, Fate> = run_ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.clone(), fate(i)))
        .collect();
    let (kill, mut kills) = mpsc::unbounded_channel();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let payments = serve_payments(Payments {
        ledger: ledger.clone(),
        fates: Arc::new(fates.clone()),
        kill,
    })
    .await;

    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let mut worker = spawn_worker(&config, payments);
    let producer = producer();
    for (i, run_id) in run_ids.iter().enumerate() {
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": "pay", "pool": "p", "input": {"amount": 100 + i},
        });
        produce(
            &producer,
            &config.topic_names().requests(),
            run_id,
            start.to_string().as_bytes(),
            &[],
        )
        .await;
    }

    // Each charge that asks for it kills the worker in the middle of its
    // call; a fresh worker takes over.
    let mut killed = Vec::new();
    let all_done = eventually_with_kills(&db, &mut kills, &mut worker, &mut killed, || {
        spawn_worker(&config, payments)
    });
    let rows = all_done.await;
    let _ = worker.kill().await;
    shutdown.cancel();
    serve.await.unwrap().expect("serve stops cleanly");

    let expected_kills = fates.values().filter(|f| **f == Fate::KillWorker).count();
    assert_eq!(
        killed.len(),
        expected_kills,
        "workers killed mid-call: {killed:?}"
    );
    let (charged, requested) = {
        let books = ledger.lock().unwrap();
        (books.charges.clone(), books.requests.clone())
    };
    for (run_id, status, output) in &rows {
        assert_eq!(status, "succeeded", "{run_id}: {output}");
        let charges = charged.get(run_id).cloned().unwrap_or_default();
        assert_eq!(charges.len(), 1, "{run_id} was charged {charges:?}");
        assert_eq!(
            output["charge"]["charge"]["charge_id"], charges[0],
            "{run_id}: the run's output names its one charge: {output}"
        );
        let requests = requested[run_id];
        if fates[run_id] != Fate::Answer {
            assert!(
                requests >= 2,
                "{run_id} ({:?}) was called {requests} time(s): its step never ran again",
                fates[run_id]
            );
        }
    }
    assert_eq!(rows.len(), RUNS);
    let total: usize = charged.values().map(Vec::len).sum();
    assert_eq!(total, RUNS, "charges in all: {charged:?}");
    db.drop_db().await;
}

/// Waits for every run to succeed, killing the current worker each time
/// the payments service asks for it and starting another in its place.
async fn eventually_with_kills(
    db: &TestDb,
    kills: &mut mpsc::UnboundedReceiver<String>,
    worker: &mut Child,
    killed: &mut Vec<String>,
    spawn: impl Fn() -> Child,
) -> Vec<(String, String, Value)> {
    let deadline = tokio::time::Instant::now() + DONE;
    loop {
        tokio::select! {
            Some(run_id) = kills.recv() => {
                worker.kill().await.expect("killing the worker");
                killed.push(run_id);
                *worker = spawn();
            }
            rows = settled(db) => return rows,
            () = tokio::time::sleep_until(deadline) => {
                panic!("runs not all succeeded after {DONE:?}: {:?}", run_rows(db).await)
            }
        }
    }
}

/// The runs, once all of them have succeeded.
async fn settled(db: &TestDb) -> Vec<(String, String, Value)> {
    eventually("every run succeeded", DONE, || async {
        let rows = run_rows(db).await;
        (rows.len() == RUNS && rows.iter().all(|(_, s, _)| s == "succeeded")).then_some(rows)
    })
    .await
}
