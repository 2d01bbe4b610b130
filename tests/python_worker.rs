//! The contract kept by a client in another language: the Python examples
//! (`examples/python/`) against a real serve. `runs.py` starts several
//! hundred runs of a workflow with a signal wait over HTTP with an API key
//! and signals each; `worker.py` answers their steps, charging each run once
//! through a ledger keyed by the step key and signing its results (every
//! input must be signed here); `consumer.py` applies each run's output to
//! its own table once. The worker is SIGKILLed right after a charge and
//! before its result, the consumer right after a commit and before its
//! offsets; both are started again. Every run succeeds, is charged once and
//! applied once, a replay of the outputs applies nothing, and every record
//! on the way is on the contract: checked by the Python side as it reads
//! and writes (`--strict`), and here against the committed schemas, the
//! signatures and the partitioning rule.
//!
//! Needs the examples' interpreter: `DUCTOR_TEST_PYTHON` (what
//! `scripts/python-env` exports, and `scripts/test` sets), else the one
//! `scripts/python-env` makes; skipped only when neither can be had.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{Serve, api_key, committed_past, migrate_url, read_n, reader, unique, workspace_dir};
use ductor::auth::Scope;
use ductor::config::{Config, SigningKey};
use ductor_testkit::scratch::ScratchDatabase;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const RUNS: usize = 300;
/// The worker kills itself right after this many charges of its own.
const KILL_AT_CHARGE: i64 = 150;
/// The consumer kills itself once it has applied this many outputs.
const KILL_AT_APPLIED: i64 = 100;
const DONE: Duration = Duration::from_secs(120);
const TENANT: &str = "acme";
const TENANT_KEY: &str = "acme-signing-key-0123456789";
const SIGNAL: &str = "approved";
const POOL: &str = "py";

/// The examples' interpreter, or `None` (with the reason printed) when
/// there is none to be had.
fn python() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("DUCTOR_TEST_PYTHON") {
        return Some(PathBuf::from(path));
    }
    let script = workspace_dir().join("scripts/python-env");
    let out = std::process::Command::new(&script)
        .arg("--path")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
        Some(2) => {
            eprintln!(
                "SKIPPED python_worker: DUCTOR_TEST_PYTHON is unset and scripts/python-env \
                 found no Python to make the examples' environment with: {}",
                stderr.trim()
            );
            None
        }
        _ => panic!("scripts/python-env failed ({}): {stderr}", out.status),
    }
}

fn workflow_toml(outputs: &str) -> String {
    format!(
        r#"name = "py_order"
version = 1
output_topic = "{outputs}"

[[steps]]
name = "reserve"
pool = "{POOL}"
timeout_ms = 10_000
[steps.retry]
max_attempts = 5
initial_backoff_ms = 100
max_backoff_ms = 1_000

[[steps]]
name = "approval"
kind = "await_signal"
signal = "{SIGNAL}"
timeout_ms = 60_000

[[steps]]
name = "charge"
pool = "{POOL}"
timeout_ms = 10_000
[steps.retry]
max_attempts = 5
initial_backoff_ms = 100
max_backoff_ms = 1_000
"#
    )
}

/// The examples' processes, on the serve's broker and topics and their own
/// database.
struct Examples {
    python: PathBuf,
    dir: PathBuf,
    config: Config,
    database_url: String,
}

impl Examples {
    fn command(&self, script: &str) -> Command {
        let mut command = Command::new(&self.python);
        command
            .arg(self.dir.join(script))
            .current_dir(&self.dir)
            .env(
                "KAFKA_BOOTSTRAP_SERVERS",
                &self.config.kafka.bootstrap_servers,
            )
            .env(
                "DUCTOR__KAFKA__TOPIC_PREFIX",
                &self.config.kafka.topic_prefix,
            )
            .env("DUCTOR__KAFKA__GROUP_ID", &self.config.kafka.group_id)
            .env(
                format!("DUCTOR__SIGNATURES__TENANT_KEYS__{}", TENANT.to_uppercase()),
                TENANT_KEY,
            )
            .env("DUCTOR_SCHEMAS_DIR", workspace_dir().join("schemas"))
            .env("EXAMPLE_DATABASE_URL", &self.database_url)
            .env("LOG_LEVEL", "WARNING")
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    fn worker(&self, crash_after_charges: Option<i64>) -> Child {
        let mut command = self.command("worker.py");
        command.args([
            "--pool",
            POOL,
            "--instance-id",
            "py-worker-1",
            "--session-timeout-ms",
            "6000",
            "--strict",
        ]);
        if let Some(n) = crash_after_charges {
            command.args(["--crash-after-charges", &n.to_string()]);
        }
        command.spawn().expect("starting worker.py")
    }

    fn consumer(&self, group: &str, crash_after_applied: Option<i64>, replay: bool) -> Child {
        let mut command = self.command("consumer.py");
        command
            .args(["--topic", &outputs_topic(&self.config), "--group", group])
            .args(["--session-timeout-ms", "6000", "--strict"])
            .stdout(Stdio::piped());
        if replay {
            command.arg("--stop-at-end");
        } else {
            command.args(["--instance-id", "shipping-1"]);
        }
        if let Some(n) = crash_after_applied {
            command.args(["--crash-after-applied", &n.to_string()]);
        }
        command.spawn().expect("starting consumer.py")
    }
}

fn outputs_topic(config: &Config) -> String {
    format!("{}outputs", config.kafka.topic_prefix)
}

/// The consumer's closing line: what it applied and found applied already.
async fn summary(child: &mut Child) -> Value {
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("the consumer's stdout is piped")
        .read_to_string(&mut out)
        .await
        .expect("reading the consumer's output");
    let status = child.wait().await.expect("waiting for the consumer");
    assert!(status.success(), "consumer.py ended {status}: {out}");
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("consumer.py's summary {last:?}: {e}"))
}

/// SIGKILL's number on Linux.
const SIGKILL: i32 = 9;

fn killed(status: ExitStatus) -> bool {
    status.signal() == Some(SIGKILL)
}

async fn sigterm(child: &Child) {
    let pid = child.id().expect("the process runs").to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("running kill");
    assert!(status.success(), "kill -TERM {pid}");
}

/// Kafka's murmur2 of a key, its sign bit cleared, modulo `partitions`:
/// where the Java client and librdkafka's `murmur2_random` put a keyed
/// record.
fn murmur2_partition(key: &[u8], partitions: i32) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ key.len() as u32;
    let mut chunks = key.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if let Some(&first) = tail.first() {
        h ^= u32::from(first);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    ((h & 0x7fff_ffff) % partitions as u32) as i32
}

#[test]
fn murmur2_agrees_with_kafkas_own_test_vectors() {
    // Kafka's UtilsTest: murmur2 of each key, as a signed 32-bit number.
    for (key, hash) in [
        ("21", -973_932_308_i32),
        ("foobar", -790_332_482),
        ("a-little-bit-long-string", -985_981_536),
        ("a-little-bit-longer-string", -1_486_304_829),
        (
            "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58_897_971,
        ),
        ("abc", 479_470_107),
    ] {
        assert_eq!(
            murmur2_partition(key.as_bytes(), i32::MAX),
            (hash & 0x7fff_ffff) % i32::MAX,
            "{key}"
        );
    }
}

/// Each partition's (low, high) watermarks on `topic`.
async fn watermarks(config: &Config, topic: &str) -> Vec<(i64, i64)> {
    let (kafka, name) = (config.kafka.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let probe: BaseConsumer =
            ductor_testkit::kafka::reader_config(&kafka, &unique("probe-"), "probe")
                .create()
                .expect("creating a watermark probe");
        let metadata = probe
            .fetch_metadata(Some(&name), Duration::from_secs(10))
            .expect("reading the topic's metadata");
        let partitions = metadata.topics()[0].partitions().len() as i32;
        (0..partitions)
            .map(|p| {
                probe
                    .fetch_watermarks(&name, p, Duration::from_secs(10))
                    .expect("reading watermarks")
            })
            .collect()
    })
    .await
    .expect("the probe panicked")
}

/// Every record on `topic`, read to the ends it has now, each checked
/// against the contract by [`common::on_contract`]; and its partition count.
async fn read_topic(config: &Config, topic: &str) -> (i32, Vec<OwnedMessage>) {
    let marks = watermarks(config, topic).await;
    let partitions = marks.len() as i32;
    let total: i64 = marks.iter().map(|(low, high)| high - low).sum();
    assert!(partitions > 0, "{topic} has no partitions");
    let records = if total == 0 {
        Vec::new()
    } else {
        read_n(&reader(&[topic]), total as usize, Duration::from_secs(60)).await
    };
    (partitions, records)
}

fn headers_of(m: &OwnedMessage) -> Vec<(String, Vec<u8>)> {
    m.headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default()
}

/// An input some producer wrote (a result of the Python worker, a signal
/// or a timer): on its schema, with the headers inputs take.
/// The value of header `name`, as text.
fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    headers_of(m)
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| String::from_utf8_lossy(&v).into_owned())
}

/// The trace id of the record's `traceparent`, when it has a valid one.
fn trace_of(m: &OwnedMessage) -> Option<String> {
    let value = header(m, ductor::contract::headers::TRACEPARENT)?;
    let trace =
        ductor::contract::TraceContext::from_values([value.as_bytes()], std::iter::empty())?;
    Some(trace.trace_id_hex())
}

fn check_input(m: &OwnedMessage) -> Value {
    let where_ = format!("{} [{}] @{}", m.topic(), m.partition(), m.offset());
    let value: Value = serde_json::from_slice(m.payload().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{where_} is not JSON: {e}"));
    ductor_testkit::schemas::check_message(&value).unwrap_or_else(|e| panic!("{where_}: {e}"));
    ductor_testkit::schemas::check_headers("input", &headers_of(m))
        .unwrap_or_else(|e| panic!("{where_}: {e}"));
    value
}

async fn connect(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .expect("connecting to the examples' database")
}

/// The runs' states in Ductor's database: (succeeded, failed or cancelled).
async fn settled_runs(pool: &PgPool) -> (i64, Vec<(String, String)>) {
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT run_id, status FROM runs WHERE status <> 'running'")
            .fetch_all(pool)
            .await
            .expect("reading runs");
    let succeeded = rows.iter().filter(|(_, s)| s == "succeeded").count() as i64;
    let other = rows.into_iter().filter(|(_, s)| s != "succeeded").collect();
    (succeeded, other)
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn python_worker_and_consumer_keep_the_contract_through_kills() {
    let Some(python) = python() else { return };
    let began = Instant::now();
    let workflows = tempfile::tempdir().unwrap();
    let dir = workflows.path().to_path_buf();
    let serve = Serve::start(|c| {
        std::fs::write(dir.join("py_order.toml"), workflow_toml(&outputs_topic(c))).unwrap();
        c.coordinator.workflows_dir = dir.clone();
        c.kafka.step_pools = vec![POOL.into()];
        c.drainer.enabled = true;
        c.drainer.poll_interval_ms = 200;
        // Every input from outside must carry its tenant's signature: the
        // Python worker's results are refused unless it signs them right.
        c.signatures.all_inputs = true;
        c.signatures.timer_key = Some(SigningKey("timer-signing-key-0123456789".into()));
        c.signatures
            .tenant_keys
            .insert(TENANT.into(), SigningKey(TENANT_KEY.into()));
        c.server.requests_per_second = 10_000;
        c.server.request_burst = 10_000;
    })
    .await;
    let scratch = ScratchDatabase::create(&migrate_url(), "ductor_pyexample_")
        .await
        .expect("creating the examples' database");
    // The examples' own database, which they own: they create their tables.
    let examples_url = scratch.url_for(&migrate_url()).unwrap();
    let examples_db = connect(&examples_url).await;
    let examples = Examples {
        python,
        dir: workspace_dir().join("examples/python"),
        config: serve.config.clone(),
        database_url: examples_url,
    };
    let shipping_group = format!("{}-shipping", serve.config.kafka.group_id);
    serve
        .db
        .owns_topics([serve.config.topic_names().steps(POOL)]);

    let mut worker = examples.worker(Some(KILL_AT_CHARGE));
    let mut consumer = examples.consumer(&shipping_group, Some(KILL_AT_APPLIED), false);
    let token = api_key(&serve.db, TENANT, &[Scope::RunsWrite, Scope::RunsRead]).await;
    let mut runs = examples.command("runs.py");
    runs.args(["--api", &format!("http://{}", serve.addr)])
        .args(["start", "--workflow", "py_order", "--signal", SIGNAL])
        .args(["--count", &RUNS.to_string(), "--concurrency", "8"])
        .args(["--idempotency-prefix", &unique("order-")])
        .env("DUCTOR_API_KEY", &token)
        .stdout(Stdio::piped());
    let starter = runs.spawn().expect("starting runs.py");
    let mut starting = Box::pin(starter.wait_with_output());
    let mut started: Option<std::process::Output> = None;

    // Supervise: each example is started again once after its crash; done
    // when every run has succeeded and every output is applied.
    let (mut worker_kills, mut consumer_kills) = (Vec::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + DONE;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            status = worker.wait() => {
                let status = status.expect("waiting for worker.py");
                assert!(killed(status) && worker_kills.is_empty(), "worker.py ended {status}");
                worker_kills.push(status);
                worker = examples.worker(None);
            }
            status = consumer.wait() => {
                let status = status.expect("waiting for consumer.py");
                assert!(killed(status) && consumer_kills.is_empty(), "consumer.py ended {status}");
                consumer_kills.push(status);
                consumer = examples.consumer(&shipping_group, None, false);
            }
            output = &mut starting, if started.is_none() => {
                let output = output.expect("waiting for runs.py");
                assert!(output.status.success(), "runs.py ended {}", output.status);
                started = Some(output);
            }
            _ = tick.tick() => {
                let (succeeded, other) = settled_runs(&serve.db.pool).await;
                assert!(other.is_empty(), "runs that did not succeed: {other:?}");
                if started.is_some()
                    && worker_kills.len() == 1
                    && consumer_kills.len() == 1
                    && succeeded == RUNS as i64
                    && count(&examples_db, "SELECT count(*) FROM example_shipments").await
                        >= RUNS as i64
                {
                    break;
                }
            }
            () = tokio::time::sleep_until(deadline) => panic!(
                "not done after {DONE:?}: {:?} runs settled, {} outputs applied",
                settled_runs(&serve.db.pool).await,
                count(&examples_db, "SELECT count(*) FROM example_shipments").await,
            ),
        }
    }
    let settled_in = began.elapsed();
    assert_eq!(worker_kills.len(), 1, "worker.py was not killed mid-run");
    assert_eq!(
        consumer_kills.len(),
        1,
        "consumer.py was not killed mid-run"
    );

    // runs.py: one line per run, each started (201) and signalled (202).
    let started = started.unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&started.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("runs.py writes JSON lines"))
        .collect();
    // Each run was started in a trace of its own (runs.py's traceparent).
    let traces: BTreeMap<String, String> = lines
        .iter()
        .filter(|l| l.get("run_id").is_some())
        .map(|l| {
            assert_eq!(l["status"], 201, "{l}");
            assert_eq!(l["signal_status"], 202, "{l}");
            let trace = l["trace_id"].as_str().expect("runs.py names the trace");
            (l["run_id"].as_str().unwrap().to_owned(), trace.to_owned())
        })
        .collect();
    let run_ids: BTreeSet<String> = traces.keys().cloned().collect();
    assert_eq!(
        run_ids.len(),
        RUNS,
        "runs.py started {} runs",
        run_ids.len()
    );

    let outputs: BTreeMap<String, Value> = sqlx::query_as::<_, (String, String, Value)>(
        "SELECT run_id, status, state->'output' FROM runs",
    )
    .fetch_all(&serve.db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(run_id, status, output)| {
        assert_eq!(status, "succeeded", "{run_id}");
        (run_id, output)
    })
    .collect();
    assert_eq!(
        outputs.keys().cloned().collect::<BTreeSet<_>>(),
        run_ids,
        "the runs in Ductor are runs.py's"
    );

    // Charged once each, by the step key, whatever ran twice; the output
    // names the one charge.
    let charges: Vec<(String, String, String, i64, i32)> = sqlx::query_as(
        "SELECT idempotency_key, run_id, charge_id, amount, worker_pid FROM example_payments",
    )
    .fetch_all(&examples_db)
    .await
    .unwrap();
    assert_eq!(charges.len(), RUNS, "charges: {}", charges.len());
    let mut by_run = HashMap::new();
    for (key, run_id, charge_id, amount, _) in &charges {
        assert_eq!(key, &format!("{run_id}/step/2"), "the charge step's key");
        let output = &outputs[run_id];
        assert_eq!(
            output["charge"]["charge"]["charge_id"], *charge_id,
            "{run_id}: {output}"
        );
        let order = output["order"]
            .as_i64()
            .expect("the run's input is in its output");
        assert_eq!(*amount, 100 + order, "{run_id}: charged {amount}");
        assert!(
            by_run.insert(run_id.clone(), charge_id.clone()).is_none(),
            "{run_id}"
        );
        assert_eq!(
            output["approval"]["payload"]["index"], order,
            "{run_id}: its own signal"
        );
    }
    // The killed worker's last charge had no result: the step ran again,
    // in the next worker, and got the same charge back.
    let (crashed_pid, crashed_charges): (i32, i64) = sqlx::query_as(
        "SELECT worker_pid, count(*) FROM example_payments GROUP BY worker_pid \
         ORDER BY min(charged_at) LIMIT 1",
    )
    .fetch_one(&examples_db)
    .await
    .unwrap();
    assert_eq!(
        crashed_charges, KILL_AT_CHARGE,
        "charges of the first worker"
    );
    let last_key: String = sqlx::query_scalar(
        "SELECT idempotency_key FROM example_payments WHERE worker_pid = $1 \
         ORDER BY charged_at DESC LIMIT 1",
    )
    .bind(crashed_pid)
    .fetch_one(&examples_db)
    .await
    .unwrap();
    let callers: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT worker_pid) FROM example_payment_calls WHERE idempotency_key = $1",
    )
    .bind(&last_key)
    .fetch_one(&examples_db)
    .await
    .unwrap();
    assert!(
        callers >= 2,
        "{last_key}: the charge cut off by the kill was never asked for again"
    );

    // Applied once each, with the run's output, by the key of its effect;
    // the consumer started again after its kill found what it had applied
    // but not acknowledged, and applied none of it twice.
    let applied: Vec<(String, Value, String)> =
        sqlx::query_as("SELECT run_id, output, idempotency_key FROM example_shipments")
            .fetch_all(&examples_db)
            .await
            .unwrap();
    assert_eq!(applied.len(), RUNS, "outputs applied");
    let mut applied_runs = BTreeSet::new();
    for (run_id, output, key) in &applied {
        assert!(
            applied_runs.insert(run_id.clone()),
            "{run_id} applied twice"
        );
        assert_eq!(output, &outputs[run_id], "{run_id}: the applied output");
        assert!(
            key.starts_with(&format!("{run_id}/")),
            "{run_id}: key {key}"
        );
    }
    assert_eq!(applied_runs, run_ids);
    assert_eq!(
        count(
            &examples_db,
            "SELECT count(*) FROM ductor_dedup_seen WHERE consumer = 'shipping'"
        )
        .await,
        RUNS as i64
    );
    // Once the consumer started again has read all there is.
    let outputs_topic = outputs_topic(&serve.config);
    for (partition, (_, high)) in watermarks(&serve.config, &outputs_topic)
        .await
        .into_iter()
        .enumerate()
    {
        if high > 0 {
            committed_past(
                "the consumer's offsets",
                &shipping_group,
                &outputs_topic,
                partition as i32,
                high - 1,
            )
            .await;
        }
    }
    sigterm(&consumer).await;
    let second = summary(&mut consumer).await;
    assert!(
        second["duplicates"].as_i64().unwrap() >= 1,
        "the restarted consumer saw nothing its predecessor had applied: {second}"
    );
    // A replay of the whole topic in a new group applies nothing.
    let replayed = summary(&mut examples.consumer(&unique("replay-"), None, true)).await;
    let (_, output_records) = read_topic(&serve.config, &outputs_topic).await;
    assert_eq!(replayed["applied"], 0, "{replayed}");
    assert_eq!(
        replayed["duplicates"].as_u64().unwrap() as usize,
        output_records.len(),
        "{replayed}"
    );
    sigterm(&worker).await;
    let status = worker.wait().await.unwrap();
    assert!(status.success(), "worker.py stopped with {status}");

    // What crossed the broker, from outside the examples: every effect on
    // its schemas (read_topic checks), every input on its own, the worker's
    // results signed with the tenant's key at the time they reached Kafka
    // and on partition murmur2(run_id), and no dead letter.
    let names = serve.config.topic_names();
    for topic in [names.steps(POOL), names.events(), outputs_topic.clone()] {
        let (_, records) = read_topic(&serve.config, &topic).await;
        assert!(!records.is_empty(), "{topic} is empty");
        // Every effect is a hop of its run's trace.
        for m in &records {
            let run_id =
                header(m, ductor::contract::headers::RUN_ID).expect("an effect names its run");
            assert_eq!(
                trace_of(m).as_deref(),
                Some(traces[&run_id].as_str()),
                "{topic}: an effect of {run_id} is not in its run's trace"
            );
        }
    }
    let (partitions, results) = read_topic(&serve.config, &names.attempt_results()).await;
    assert!(results.len() >= 2 * RUNS, "{} results", results.len());
    let window_ms = serve.config.signatures.max_age_ms;
    for m in &results {
        let value = check_input(m);
        let key = m.key().expect("a result is keyed");
        assert_eq!(
            key,
            value["run_id"].as_str().unwrap().as_bytes(),
            "keyed by its run"
        );
        assert_eq!(
            m.partition(),
            murmur2_partition(key, partitions),
            "{value}: not on murmur2's partition"
        );
        // The worker continued the dispatch's trace: the run's.
        let run_id = value["run_id"].as_str().unwrap();
        assert_eq!(
            trace_of(m).as_deref(),
            Some(traces[run_id].as_str()),
            "{value}: the result is not in its run's trace"
        );
        let signature = headers_of(m)
            .into_iter()
            .find(|(k, _)| k == ductor::contract::signature::SIGNATURE)
            .expect("a result is signed")
            .1;
        let reached_ms = m.timestamp().to_millis().expect("a record time");
        ductor::contract::signature::verify(
            TENANT_KEY.as_bytes(),
            m.payload().unwrap(),
            &signature,
            reached_ms,
            window_ms,
        )
        .unwrap_or_else(|e| panic!("{value}: {}", e.message()));
    }
    let (_, wakeups) = read_topic(&serve.config, &names.wakeups()).await;
    let signals: BTreeSet<String> = wakeups
        .iter()
        .map(check_input)
        .filter(|v| v["type"] == "wakeup.signal")
        .map(|v| v["signal_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(signals.len(), RUNS, "signals on the wakeups topic");
    let (_, dead) = read_topic(&serve.config, &names.dead_letters()).await;
    assert!(
        dead.is_empty(),
        "dead letters: {:?}",
        dead.iter().map(headers_of).collect::<Vec<_>>()
    );

    eprintln!(
        "python_worker: {RUNS} runs settled and applied in {:.1} s ({:.1} s in all)",
        settled_in.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    examples_db.close().await;
    scratch
        .drop()
        .await
        .expect("dropping the examples' database");
    serve.stop().await;
    drop(workflows);
}
