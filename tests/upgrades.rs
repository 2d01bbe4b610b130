//! Upgrades that keep runs, on the real stack.
//!
//! Every stored shape that has shipped (`tests/fixtures/stored/` and
//! `dead_letters/`, see their READMEs) is put into one database as the
//! binary of its time left it: at the schema of that time, the later
//! migrations running over it as they would on an upgrade. Today's `serve`
//! then finishes the runs the fixtures describe (results, signals, starts,
//! cancels and retries sent as their fixture says, stored dead letters
//! replayed through the operator API, timers firing by themselves): each
//! ends as its fixture expects, its history going on from its last seq,
//! every due effect published (the old ones still pending among them),
//! nothing dead-lettered. A fixture whose shape today's binary cannot load
//! leaves its run unfinished, and the test fails. The stored dead letters
//! are listed and read as they were recorded, and one replayed before the
//! upgrade is not produced again.
//!
//! A state of a newer version than this binary is set apart with its own
//! class and left as it is; the schema names the state version this
//! binary writes; a binary refuses a schema with a migration it does not
//! know, naming it.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{TestDb, eventually, produce, producer, test_config, workspace_dir};
use ductor::auth::Scope;
use ductor::config::Config;
use ductor::contract::headers::REPLAY_ID;
use ductor::ingress::dead_letters::Bytes;
use ductor_testkit::serve::Running;
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, Migrator};

const DONE: Duration = Duration::from_secs(120);
const TENANT: &str = "acme";

/// A fixture file: the rows a binary left and how their runs go on.
struct Fixture {
    name: String,
    doc: Value,
}

impl Fixture {
    fn schema(&self) -> i64 {
        self.doc["schema"]
            .as_i64()
            .expect("a fixture names its schema")
    }

    fn rows(&self, table: &str) -> &[Value] {
        self.doc["rows"][table]
            .as_array()
            .map_or(&[], Vec::as_slice)
    }

    /// The tables it has rows of: the runs before what refers to them,
    /// then any other in the file's order.
    fn tables(&self) -> Vec<String> {
        const FIRST: [&str; 4] = [
            "runs",
            "run_transitions",
            "run_attempts",
            "eec_effect_intent",
        ];
        let named = self.doc["rows"].as_object().expect("a fixture has rows");
        let rest = named.keys().filter(|t| !FIRST.contains(&t.as_str()));
        FIRST
            .iter()
            .map(|t| (*t).to_owned())
            .filter(|t| named.contains_key(t))
            .chain(rest.cloned())
            .collect()
    }

    fn finish(&self) -> &[Value] {
        self.doc["finish"].as_array().map_or(&[], Vec::as_slice)
    }
}

fn fixtures_dir() -> PathBuf {
    workspace_dir().join("tests/fixtures")
}

/// Every fixture of `tests/fixtures/stored/` and `dead_letters/`, in the
/// order of their schemas, then of their names.
fn fixtures() -> Vec<Fixture> {
    let mut fixtures: Vec<Fixture> = ["stored", "dead_letters"]
        .iter()
        .flat_map(|dir| {
            let dir = fixtures_dir().join(dir);
            std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect::<Vec<_>>()
        })
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).unwrap();
            let doc = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            Fixture { name, doc }
        })
        .collect();
    fixtures.sort_by(|a, b| (a.schema(), &a.name).cmp(&(b.schema(), &b.name)));
    fixtures
}

/// Ductor's migrations up to `version`, the schema a binary of that time
/// ran on.
#[derive(Debug)]
struct UpTo(i64);

impl MigrationSource<'static> for UpTo {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move {
            Ok(ductor::infra::db::MIGRATOR
                .iter()
                .filter(|m| m.version <= self.0)
                .cloned()
                .collect())
        })
    }
}

async fn migrate_to(db: &TestDb, version: i64) {
    let migrator = Migrator::new(UpTo(version)).await.unwrap();
    migrator
        .run(&db.owner)
        .await
        .unwrap_or_else(|e| panic!("migrating to {version}: {e}"));
}

/// The `bytea` columns of the fixtures' tables: an intent's key and
/// payload, a dead letter's key and value.
const BYTEA_COLUMNS: [&str; 4] = ["message_key", "payload", "record_key", "value"];

/// Inserts `rows` into `table` as they are, each with the columns it has:
/// `bytea` columns are written as their text (a key, a JSON payload; see
/// [`bytea_text`]), and the topic of an intent or of a dead letter takes
/// the test's prefix for `ductor.`.
async fn insert(db: &TestDb, table: &str, rows: &[Value], topic_prefix: &str) {
    if rows.is_empty() {
        return;
    }
    let topic_column = if table == "dead_letters" {
        "source_topic"
    } else {
        "topic"
    };
    let mut columns: Vec<String> = Vec::new();
    let rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            let mut row = row.as_object().expect("a row is an object").clone();
            for (name, value) in row.iter_mut() {
                if !columns.contains(name) {
                    columns.push(name.clone());
                }
                if BYTEA_COLUMNS.contains(&name.as_str()) && !value.is_null() {
                    let text = bytea_text(value);
                    *value = Value::String(format!("\\x{}", hex(text.as_bytes())));
                }
                if name == topic_column {
                    *value = prefixed(value, topic_prefix);
                }
            }
            Value::Object(row)
        })
        .collect();
    let list = columns
        .iter()
        .map(|c| format!("\"{c}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "INSERT INTO {table} ({list}) SELECT {list} FROM jsonb_populate_recordset(NULL::{table}, $1)"
    );
    sqlx::query(&sql)
        .bind(Value::Array(rows))
        .execute(&db.owner)
        .await
        .unwrap_or_else(|e| panic!("inserting the {table} rows: {e}"));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The text of a `bytea` cell of a fixture: a string, or, for a value too
/// long to keep in the file, `{"parts": [...]}`, its text in pieces, each a
/// string or `{"repeat": text, "times": n}`.
fn bytea_text(cell: &Value) -> String {
    if let Some(text) = cell.as_str() {
        return text.to_owned();
    }
    let parts = cell["parts"]
        .as_array()
        .unwrap_or_else(|| panic!("a bytea cell is a string or parts: {cell}"));
    parts
        .iter()
        .map(|part| match part.as_str() {
            Some(text) => text.to_owned(),
            None => {
                let times = part["times"].as_u64().expect("a repeat has its times");
                part["repeat"]
                    .as_str()
                    .expect("a repeat has its text")
                    .repeat(usize::try_from(times).unwrap())
            }
        })
        .collect()
}

/// `topic` with the test's prefix for `ductor.`.
fn prefixed(topic: &Value, prefix: &str) -> Value {
    match topic.as_str().and_then(|t| t.strip_prefix("ductor.")) {
        Some(rest) => Value::String(format!("{prefix}{rest}")),
        None => topic.clone(),
    }
}

/// Makes `db` live through every fixture's time: each fixture's rows
/// inserted at its schema, then every later migration, then the grants
/// `ductor migrate` makes.
async fn live_through(db: &TestDb, fixtures: &[Fixture], topic_prefix: &str) {
    for fixture in fixtures {
        migrate_to(db, fixture.schema()).await;
        for table in fixture.tables() {
            insert(db, &table, fixture.rows(&table), topic_prefix).await;
        }
    }
    db.migrate().await;
}

/// The fixtures' workflows with the test's topic prefix for `ductor.`.
fn workflows_dir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures_dir().join("workflows")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace("\"ductor.", &format!("\"{prefix}"));
        std::fs::write(dir.path().join(path.file_name().unwrap()), text).unwrap();
    }
    dir
}

/// The configuration `serve` runs the fixtures with: their workflows
/// (in `workflows`, made by [`workflows_dir`]) and pool, a drainer that
/// polls often, and retention that keeps every run, tombstone and dead
/// letter: the fixtures' times are their era's, and the test runs any time
/// after, when a retention of days would have deleted what it finishes.
fn upgrade_config(mut config: Config, workflows: &Path) -> Config {
    const CENTURY_MS: u64 = 100 * 365 * 86_400_000;
    config.coordinator.workflows_dir = workflows.to_path_buf();
    config.kafka.step_pools = vec!["fx".into()];
    config.drainer.enabled = true;
    config.drainer.poll_interval_ms = 200;
    config.runs.retention_ms = 0;
    config.runs.tombstone_retention_ms = CENTURY_MS;
    config.dead_letters.retention_ms = 0;
    config
}

/// What a run looks like in the database.
#[derive(Debug, Clone)]
struct RunRow {
    status: String,
    record_version: i64,
    last_transition_seq: i64,
    state: Value,
}

async fn run_row(db: &TestDb, run_id: &str) -> Option<RunRow> {
    let row: Option<(String, i64, i64, Value)> = sqlx::query_as(
        "SELECT status, record_version, last_transition_seq, state FROM runs WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    row.map(
        |(status, record_version, last_transition_seq, state)| RunRow {
            status,
            record_version,
            last_transition_seq,
            state,
        },
    )
}

async fn transitions(db: &TestDb, run_id: &str) -> Vec<(i64, String, Value)> {
    sqlx::query_as("SELECT seq, kind, detail FROM run_transitions WHERE run_id = $1 ORDER BY seq")
        .bind(run_id)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The operator's door: the admin listener, and a key with the `admin`
/// scope.
struct Operator {
    admin: SocketAddr,
    token: String,
}

impl Operator {
    async fn new(db: &TestDb, admin: SocketAddr) -> Operator {
        let token = common::api_key(db, "ops", &[Scope::Admin]).await;
        Operator { admin, token }
    }

    async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let auth = common::bearer(&self.token);
        let mut headers = vec![(auth.0, auth.1.as_str())];
        let bytes = body.map(Value::to_string).unwrap_or_default();
        if body.is_some() {
            headers.push(("Content-Type", "application/json"));
        }
        let (status, raw) =
            common::http(self.admin, method, path, &headers, bytes.as_bytes()).await;
        (status, serde_json::from_slice(&raw).unwrap_or(Value::Null))
    }

    /// The letter read at `partition` and `offset` of `topic`, as the
    /// listing of that topic's letters shows it.
    async fn letter_at(&self, topic: &str, partition: &Value, offset: &Value) -> Value {
        let path = format!("/v1/dead-letters?source_topic={topic}&limit=500");
        let (status, page) = self.call("GET", &path, None).await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["next"], Value::Null, "one page holds them: {page}");
        let letters = page["letters"].as_array().expect("a page of letters");
        letters
            .iter()
            .find(|l| &l["source_partition"] == partition && &l["source_offset"] == offset)
            .unwrap_or_else(|| panic!("no letter at {topic}/{partition}/{offset}: {page}"))
            .clone()
    }
}

/// Where the driver of one run sends its inputs.
struct Inputs<'a> {
    config: &'a Config,
    producer: &'a FutureProducer,
    operator: &'a Operator,
}

impl Inputs<'_> {
    async fn send(&self, topic: String, run_id: &str, value: Value) -> (i32, i64) {
        produce(
            self.producer,
            &topic,
            run_id,
            value.to_string().as_bytes(),
            &[],
        )
        .await
    }

    async fn result(&self, run_id: &str, stamp: &str, output: &Value) {
        let result = json!({
            "type": "attempt.result", "schema_version": 1, "run_id": run_id, "tenant": TENANT,
            "stamp": stamp, "outcome": "succeeded", "output": output,
        });
        let topic = self.config.topic_names().attempt_results();
        self.send(topic, run_id, result).await;
    }

    /// Sends one step of a fixture's `finish` other than a result; returns
    /// where it went.
    async fn other(&self, run_id: &str, step: &Value) -> (String, (i32, i64)) {
        let names = self.config.topic_names();
        let (topic, mut value) = if let Some(signal) = step.get("signal") {
            let mut v = signal.clone();
            v["type"] = "wakeup.signal".into();
            (names.wakeups(), v)
        } else if let Some(start) = step.get("start") {
            let mut v = start.clone();
            v["type"] = "run.start".into();
            (names.requests(), v)
        } else if let Some(reason) = step.get("cancel") {
            (
                names.wakeups(),
                json!({"type": "wakeup.cancel", "reason": reason}),
            )
        } else if let Some(retry) = step.get("retry") {
            let mut v = retry.clone();
            v["type"] = "wakeup.retry".into();
            (names.wakeups(), v)
        } else {
            panic!("{run_id}: an unknown step {step}");
        };
        value["schema_version"] = 1.into();
        value["run_id"] = run_id.into();
        value["tenant"] = TENANT.into();
        let at = self.send(topic.clone(), run_id, value).await;
        (topic, at)
    }

    /// Replays the stored dead letter read at `at` (its `source_topic`,
    /// `source_partition` and `source_offset`) through the operator API,
    /// and checks that its record went back as it was refused: its key,
    /// value and headers byte for byte, with the replay's id.
    async fn replay(&self, run_id: &str, at: &Value) {
        let topic = prefixed(&at["source_topic"], &self.config.kafka.topic_prefix);
        let topic = topic.as_str().unwrap();
        let op = self.operator;
        let letter = op
            .letter_at(topic, &at["source_partition"], &at["source_offset"])
            .await;
        let id = &letter["id"];
        let (_, whole) = op
            .call("GET", &format!("/v1/dead-letters/{id}"), None)
            .await;
        let path = format!("/v1/dead-letters/{id}/replay");
        let (status, replay) = op.call("POST", &path, Some(&json!({}))).await;
        assert_eq!(
            (status, &replay["status"]),
            (200, &json!("replayed")),
            "{replay}"
        );
        assert_eq!(replay["run"]["run_id"], run_id, "{replay}");
        let record = read_record(topic, &replay["partition"], &replay["offset"]).await;
        let bytes = |b: &Value| {
            serde_json::from_value::<Option<Bytes>>(b.clone())
                .unwrap()
                .map(|b| b.to_vec().unwrap())
        };
        assert_eq!(record.key().map(<[u8]>::to_vec), bytes(&whole["key"]));
        assert_eq!(record.payload().map(<[u8]>::to_vec), bytes(&whole["value"]));
        let mut expected: Vec<(String, Option<Vec<u8>>)> = whole["headers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| (h["key"].as_str().unwrap().to_owned(), bytes(&h["value"])))
            .collect();
        let replay_id = replay["replay_id"].as_str().unwrap().as_bytes().to_vec();
        expected.push((REPLAY_ID.to_owned(), Some(replay_id)));
        let headers: Vec<(String, Option<Vec<u8>>)> = record
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(headers, expected, "the replay of {run_id}'s letter");
    }
}

/// The record at `partition` and `offset` of `topic`.
async fn read_record(topic: &str, partition: &Value, offset: &Value) -> OwnedMessage {
    let (partition, offset) = (partition.as_i64().unwrap(), offset.as_i64().unwrap());
    let reader = common::reader(&[topic]);
    let deadline = tokio::time::Instant::now() + DONE;
    loop {
        let m = tokio::time::timeout_at(deadline, reader.recv())
            .await
            .unwrap_or_else(|_| panic!("no record at {topic}/{partition}/{offset}"))
            .expect("reading the topic");
        if i64::from(m.partition()) == partition && m.offset() == offset {
            return m.detach();
        }
    }
}

/// The stamp of the attempt `run_id` has outstanding that is none of
/// `known`, once it has one.
async fn new_attempt(db: &TestDb, run_id: &str, known: &HashSet<String>) -> String {
    eventually(
        &format!("{run_id} dispatches a new attempt"),
        DONE,
        || async {
            let row = run_row(db, run_id).await?;
            let stamp = row.state["outstanding"]["stamp"].as_str()?.to_owned();
            (!known.contains(&stamp)).then_some(stamp)
        },
    )
    .await
}

/// Goes through the steps of one run's `finish`, then checks that it ends
/// as expected, its history going on from the fixture's.
async fn finish_run(db: &TestDb, inputs: &Inputs<'_>, fixture: &Fixture, plan: &Value) {
    let run_id = plan["run_id"].as_str().unwrap();
    let mut known: HashSet<String> = fixture
        .rows("run_attempts")
        .iter()
        .filter(|a| a["run_id"] == run_id)
        .map(|a| a["stamp"].as_str().unwrap().to_owned())
        .collect();
    let mut sent = Vec::new();
    for step in plan["steps"].as_array().unwrap() {
        match step.get("result").and_then(Value::as_str) {
            Some("new") => {
                let stamp = new_attempt(db, run_id, &known).await;
                inputs.result(run_id, &stamp, &step["output"]).await;
                known.insert(stamp);
            }
            Some(stamp) => inputs.result(run_id, stamp, &step["output"]).await,
            None if step.get("replay").is_some() => {
                inputs.replay(run_id, &step["replay"]).await;
            }
            None => sent.push(inputs.other(run_id, step).await),
        }
    }
    let expect = &plan["expect"];
    if expect["status"] == "purged" {
        return assert_still_purged(db, inputs.config, run_id, &sent).await;
    }
    let status = expect["status"].as_str().unwrap();
    eventually(&format!("{run_id} is {status}"), DONE, || async {
        run_row(db, run_id).await.filter(|r| r.status == status)
    })
    .await;
    assert_history_goes_on(db, fixture, run_id, expect).await;
}

/// A tombstoned run that late inputs reached is not there again.
async fn assert_still_purged(
    db: &TestDb,
    config: &Config,
    run_id: &str,
    sent: &[(String, (i32, i64))],
) {
    for (topic, (partition, offset)) in sent {
        common::committed_past(
            &format!("the late input of {run_id} is handled"),
            &config.kafka.group_id,
            topic,
            *partition,
            *offset,
        )
        .await;
    }
    assert!(run_row(db, run_id).await.is_none(), "{run_id} came back");
    let tombstones: i64 =
        sqlx::query_scalar("SELECT count(*) FROM run_tombstones WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(tombstones, 1, "{run_id} keeps its tombstone");
}

/// The run's history is the fixture's, then exactly the expected kinds at
/// the next seqs (each transition's detail with the fields `details` names
/// for it, if the fixture names any); its row and state agree with it, the
/// state in this binary's version. A run the fixture has no row of (one a
/// replayed letter starts) has no history before.
async fn assert_history_goes_on(db: &TestDb, fixture: &Fixture, run_id: &str, expect: &Value) {
    let stored = fixture.rows("runs").iter().find(|r| r["run_id"] == run_id);
    let (last, stored_version) = stored.map_or((0, 0), |r| {
        let seq = r["last_transition_seq"].as_i64().unwrap();
        (seq, r["record_version"].as_i64().unwrap())
    });
    let history = transitions(db, run_id).await;
    let seqs: Vec<i64> = history.iter().map(|t| t.0).collect();
    let total = i64::try_from(history.len()).unwrap();
    assert_eq!(seqs, (1..=total).collect::<Vec<_>>(), "{run_id}: seqs");
    let new_kinds: Vec<&str> = history
        .iter()
        .filter(|t| t.0 > last)
        .map(|t| t.1.as_str())
        .collect();
    let expected: Vec<&str> = expect["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(
        new_kinds, expected,
        "{run_id}: the transitions after the upgrade"
    );
    if let Some(details) = expect["details"].as_array() {
        let new: Vec<&Value> = history
            .iter()
            .filter(|t| t.0 > last)
            .map(|t| &t.2)
            .collect();
        assert_details(run_id, details, &new);
    }
    let row = run_row(db, run_id).await.unwrap();
    assert_eq!(row.last_transition_seq, total, "{run_id}");
    let written = total - last;
    // One version per write of the run; a write holds each transition of
    // the run that one batch of inputs made (a signal and a retry sent
    // together may be one).
    let versions = row.record_version - stored_version;
    assert!(
        (written.min(1)..=written).contains(&versions),
        "{run_id}: {versions} versions for {written} transitions"
    );
    assert_eq!(row.state["last_transition_seq"], total, "{run_id}");
    if written > 0 {
        assert_eq!(
            row.state["v"],
            ductor::coordinator::STATE_VERSION,
            "{run_id}: written back in this binary's version"
        );
    }
}

/// Each new transition's detail has the fields its expectation names.
fn assert_details(run_id: &str, expected: &[Value], details: &[&Value]) {
    assert_eq!(expected.len(), details.len(), "{run_id}: the details");
    for (want, got) in expected.iter().zip(details) {
        for (field, value) in want.as_object().expect("expected fields") {
            assert_eq!(&got[field], value, "{run_id}: {field} of {got}");
        }
    }
}

/// Every intent that is due has been published, and Kafka has each that
/// the fixtures left pending: read back by its idempotency key.
async fn assert_effects_published(db: &TestDb, config: &Config, fixtures: &[Fixture]) {
    eventually("every due intent is published", DONE, || async {
        let undelivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM eec_effect_intent WHERE not_before <= now() AND status <> 'completed'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (undelivered == 0).then_some(())
    })
    .await;
    let pending: HashSet<String> = fixtures
        .iter()
        .flat_map(|f| f.rows("eec_effect_intent"))
        .filter(|i| i["status"] == "pending" && i["not_before"].as_str() < Some("2100"))
        .map(|i| i["idempotency_key"].as_str().unwrap().to_owned())
        .collect();
    let names = config.topic_names();
    let topics = [
        names.events(),
        names.steps("fx"),
        names.wakeups(),
        format!("{}outputs", config.kafka.topic_prefix),
    ];
    let reader = common::reader(&topics.iter().map(String::as_str).collect::<Vec<_>>());
    let seen = read_keys_until(&reader, &pending).await;
    for key in &pending {
        assert!(
            seen.contains_key(key),
            "the stored intent {key} was not published"
        );
    }
    check_old_dispatch(&seen);
}

/// Reads until every key of `wanted` has been seen; the payloads of what
/// was read, by idempotency key.
async fn read_keys_until(
    reader: &StreamConsumer,
    wanted: &HashSet<String>,
) -> BTreeMap<String, Value> {
    let mut seen = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + DONE;
    while !wanted.iter().all(|k| seen.contains_key(k)) {
        let m = tokio::time::timeout_at(deadline, reader.recv())
            .await
            .unwrap_or_else(|_| panic!("published intents missing: {wanted:?} read {seen:?}"))
            .expect("reading the published effects");
        let key = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "idempotency-key"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned());
        let payload =
            serde_json::from_slice(m.payload().unwrap_or_default()).unwrap_or(Value::Null);
        if let Some(key) = key {
            seen.insert(key, payload);
        }
    }
    seen
}

/// A dispatch the binaries before step keys left pending is one today's
/// workers take, its step key the one it would have carried.
fn check_old_dispatch(seen: &BTreeMap<String, Value>) {
    let old = &seen["fx-e2-last-step/4/1"];
    assert!(old.get("step_key").is_none(), "{old}");
    let decoded = ductor::contract::effects::StepDispatch::decode(old.to_string().as_bytes())
        .expect("today's worker decodes a dispatch without step_key");
    assert_eq!(decoded.step_key, "fx-e2-last-step/step/2");
}

/// What only some shapes show: the migration that moved the first form's
/// outputs and payloads into the history, the first form read as the
/// newer one, a kept signal consumed, a trace continued.
async fn assert_shapes_carried_over(db: &TestDb) {
    let e1 = transitions(db, "fx-e1-signalled").await;
    assert_eq!(
        e1[1].2["output"],
        json!({"reserved": 3}),
        "migration 11 moved the output"
    );
    assert_eq!(
        e1[2].2["payload"],
        json!({"note": "for Ada"}),
        "and the payload"
    );
    let late = transitions(db, "fx-e1-late").await;
    let retried = late.iter().find(|t| t.1 == "step.retried").unwrap();
    let payload: Vec<u8> = sqlx::query_scalar(
        "SELECT payload FROM eec_effect_intent WHERE run_id = 'fx-e1-late' AND seq = $1 \
         AND ce_type = 'ductor.step.dispatch'",
    )
    .bind(retried.0)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let dispatch: Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(
        dispatch["input"],
        json!({"reserved": 7}),
        "the retry's input is the first form's newest output"
    );
    let kept = transitions(db, "fx-e4-kept").await;
    assert_eq!(
        kept[2].2["passed_steps"][0]["output"]["approved"]["payload"],
        json!({"by": "early"}),
        "the signal kept by the old binary is consumed"
    );
    let headers: Vec<Value> = sqlx::query_scalar(
        "SELECT headers FROM eec_effect_intent WHERE run_id = 'fx-e5-traced' AND seq > 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(!headers.is_empty());
    for h in headers {
        let traceparent = h["traceparent"].as_str().unwrap_or_default();
        assert!(
            traceparent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "the stored trace goes on: {h}"
        );
        assert_eq!(h["tracestate"], "vendor=fx1");
    }
}

/// Every stored dead letter is listed through the operator API as it was
/// recorded, and read whole: its key, its headers (non-UTF-8 bytes and
/// all) and its value, however long. A letter replayed already answers a
/// second replay with the first one's outcome and produces nothing; a
/// discarded one is neither replayed nor discarded again. The pending ones
/// are replayed by their runs' `finish`.
async fn assert_letters_carried_over(config: &Config, operator: &Operator, fixtures: &[Fixture]) {
    let runs: HashSet<&str> = fixtures
        .iter()
        .flat_map(|f| f.rows("runs"))
        .filter_map(|r| r["run_id"].as_str())
        .collect();
    let letters: Vec<&Value> = fixtures
        .iter()
        .flat_map(|f| f.rows("dead_letters"))
        .collect();
    assert!(!letters.is_empty(), "the stored dead letters are there");
    let prefix = &config.kafka.topic_prefix;
    let topic_of = |l: &Value| {
        prefixed(&l["source_topic"], prefix)
            .as_str()
            .unwrap()
            .to_owned()
    };
    let mut before: BTreeMap<String, i64> = BTreeMap::new();
    for topic in letters.iter().map(|l| topic_of(l)) {
        let n = records(topic.clone()).await;
        before.insert(topic, n);
    }
    for stored in letters {
        let (partition, offset) = (&stored["source_partition"], &stored["source_offset"]);
        let listed = operator
            .letter_at(&topic_of(stored), partition, offset)
            .await;
        assert_listed_as_stored(&listed, stored);
        let path = format!("/v1/dead-letters/{}", listed["id"]);
        let (status, whole) = operator.call("GET", &path, None).await;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(whole["headers"], stored["headers"], "{listed}");
        assert_eq!(whole["key"], bytes_view(&stored["record_key"]), "{listed}");
        assert_eq!(whole["value"], bytes_view(&stored["value"]), "{listed}");
        assert_settled_stays_so(operator, &listed, stored, &runs).await;
    }
    for (topic, n) in before {
        assert_eq!(
            records(topic.clone()).await,
            n,
            "a replay produced to {topic}"
        );
    }
}

/// The status a stored letter's row gives it.
fn letter_status(stored: &Value) -> &'static str {
    if !stored["discarded_at"].is_null() {
        "discarded"
    } else if !stored["replayed_at"].is_null() {
        "replayed"
    } else if !stored["replay_id"].is_null() {
        "replaying"
    } else {
        "pending"
    }
}

/// A letter as the listing shows it, against its stored row.
fn assert_listed_as_stored(listed: &Value, stored: &Value) {
    for (field, column) in [
        ("stage", "stage"),
        ("class", "class"),
        ("error", "error"),
        ("input_type", "input_type"),
        ("tenant", "tenant_scope"),
        ("run_id", "run_id"),
        ("value_bytes", "value_bytes"),
        ("key_dropped", "key_dropped"),
        ("headers_dropped", "headers_dropped"),
    ] {
        assert_eq!(listed[field], stored[column], "{field} of {listed}");
    }
    assert_eq!(listed["status"], letter_status(stored), "{listed}");
    let cut = !stored["value"].is_null()
        && Some(bytea_text(&stored["value"]).len() as u64) < stored["value_bytes"].as_u64();
    assert_eq!(listed["value_cut"], cut, "{listed}");
    if !stored["replay_id"].is_null() {
        let replay = &listed["replay"];
        assert_eq!(replay["replay_id"], stored["replay_id"], "{listed}");
        assert_eq!(
            replay["partition"], stored["replayed_partition"],
            "{listed}"
        );
        assert_eq!(replay["offset"], stored["replayed_offset"], "{listed}");
        assert_eq!(replay["signed"], stored["replay_signed"], "{listed}");
    }
    if !stored["discarded_at"].is_null() {
        assert_eq!(
            listed["discard"]["reason"], stored["discard_reason"],
            "{listed}"
        );
    }
}

/// The API's view of a stored `bytea` cell: UTF-8 text, or base64.
fn bytes_view(cell: &Value) -> Value {
    if cell.is_null() {
        return Value::Null;
    }
    serde_json::to_value(Bytes::of(bytea_text(cell).as_bytes())).unwrap()
}

/// A replayed letter, replayed again, answers with its first replay and
/// its run (`runs`: those the fixtures hold); it cannot be discarded. A
/// discarded one is not replayed, and keeps its first reason.
async fn assert_settled_stays_so(
    operator: &Operator,
    listed: &Value,
    stored: &Value,
    runs: &HashSet<&str>,
) {
    let id = &listed["id"];
    let replay = format!("/v1/dead-letters/{id}/replay");
    let discard = format!("/v1/dead-letters/{id}/discard");
    let again = json!({"reason": "looked at again after the upgrade"});
    match letter_status(stored) {
        "replayed" => {
            let (status, answer) = operator.call("POST", &replay, Some(&json!({}))).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["status"], "already_replayed", "{answer}");
            assert_eq!(answer["replay_id"], stored["replay_id"], "{answer}");
            assert_eq!(
                answer["partition"], stored["replayed_partition"],
                "{answer}"
            );
            assert_eq!(answer["offset"], stored["replayed_offset"], "{answer}");
            assert_eq!(answer["run"]["run_id"], stored["run_id"], "{answer}");
            let run = stored["run_id"].as_str().unwrap_or_default();
            assert_eq!(answer["run"]["exists"], runs.contains(run), "{answer}");
            let (status, answer) = operator.call("POST", &discard, Some(&again)).await;
            assert_eq!(
                (status, &answer["error"]["code"]),
                (409, &json!("letter_settled"))
            );
        }
        "discarded" => {
            let (status, answer) = operator.call("POST", &replay, Some(&json!({}))).await;
            assert_eq!(
                (status, &answer["error"]["code"]),
                (409, &json!("letter_settled"))
            );
            let (status, answer) = operator.call("POST", &discard, Some(&again)).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["status"], "already_discarded", "{answer}");
            assert_eq!(answer["reason"], stored["discard_reason"], "{answer}");
        }
        _ => {}
    }
}

/// What the shapes since retries show: a retried step's attempts
/// numbered on from the stored ones; each run's retries kept, the stored
/// one with the new.
async fn assert_retries_carried_over(db: &TestDb) {
    for (run_id, step, attempts, retries) in [
        (
            "fx-v2-retried",
            1,
            vec![1, 2, 3],
            vec!["retry-card-1", "retry-card-2"],
        ),
        ("fx-v2-failed", 0, vec![1, 2], vec!["retry-warehouse-1"]),
    ] {
        let numbers: Vec<i32> = sqlx::query_scalar(
            "SELECT attempt FROM run_attempts WHERE run_id = $1 AND step_index = $2 ORDER BY 1",
        )
        .bind(run_id)
        .bind(step)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            numbers, attempts,
            "{run_id}: the attempts of its retried step"
        );
        let state = run_row(db, run_id).await.unwrap().state;
        let kept: Vec<&str> = state["retries"]
            .as_array()
            .unwrap_or_else(|| panic!("{run_id} keeps its retries: {state}"))
            .iter()
            .map(|r| r["action_id"].as_str().unwrap())
            .collect();
        assert_eq!(kept, retries, "{run_id}");
    }
}

/// A stored letter replayed after the upgrade starts a run that continues
/// the trace its headers carried.
async fn assert_replayed_letters_carried_over(db: &TestDb) {
    let replayed = run_row(db, "fx-d1-pending").await.unwrap().state;
    let traceparent = replayed["trace"]["traceparent"]
        .as_str()
        .unwrap_or_default();
    assert!(
        traceparent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "the replayed start continues its letter's trace: {replayed}"
    );
}

/// How many records `topic` holds.
async fn records(topic: String) -> i64 {
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", common::bootstrap_servers())
            .create()
            .unwrap();
        let metadata = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .unwrap();
        let partitions = metadata.topics()[0].partitions().len() as i32;
        (0..partitions)
            .map(|p| {
                let (low, high) = consumer
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .unwrap();
                high - low
            })
            .sum()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn todays_serve_finishes_the_runs_of_every_stored_shape_that_shipped() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 11, "the fixtures are there");
    let db = TestDb::empty().await;
    let config = test_config(&db);
    let prefix = config.kafka.topic_prefix.clone();
    let dir = workflows_dir(&prefix);
    let config = upgrade_config(config, dir.path());
    live_through(&db, &fixtures, &prefix).await;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let serve = Running::start(&config).await;
    let operator = Operator::new(&db, serve.admin).await;
    assert_letters_carried_over(&config, &operator, &fixtures).await;

    let producer = producer();
    let inputs = Inputs {
        config: &config,
        producer: &producer,
        operator: &operator,
    };
    let drivers = fixtures
        .iter()
        .flat_map(|f| f.finish().iter().map(move |plan| (f, plan)))
        .map(|(fixture, plan)| finish_run(&db, &inputs, fixture, plan));
    futures::future::join_all(drivers).await;

    assert_effects_published(&db, &config, &fixtures).await;
    assert_shapes_carried_over(&db).await;
    assert_retries_carried_over(&db).await;
    assert_replayed_letters_carried_over(&db).await;
    assert_eq!(
        records(config.topic_names().dead_letters()).await,
        0,
        "nothing of the stored runs was dead-lettered"
    );
    serve.stop().await;
    db.drop_db().await;
}

/// A state marked with a version after this binary's is set apart like a
/// state that does not decode, under its own class, and left as it is: it
/// is never read and written back in an older shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_state_newer_than_this_binary_is_set_apart_and_left_as_it_is() {
    let current = fixtures()
        .into_iter()
        .find(|f| f.name.starts_with("70-"))
        .expect("the fixture of the current version");
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    let dir = workflows_dir(&config.kafka.topic_prefix);
    let config = upgrade_config(config, dir.path());
    let newer = ductor::coordinator::STATE_VERSION + 1;
    let mut runs = current.rows("runs").to_vec();
    runs[0]["state"]["v"] = newer.into();
    let run_id = runs[0]["run_id"].as_str().unwrap().to_owned();
    let prefix = &config.kafka.topic_prefix;
    insert(&db, "runs", &runs, prefix).await;
    for table in ["run_transitions", "run_attempts", "eec_effect_intent"] {
        insert(&db, table, current.rows(table), prefix).await;
    }
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let dead_letters = common::reader(&[&config.topic_names().dead_letters()]);
    let serve = Running::start(&config).await;
    let before = run_row(&db, &run_id).await.unwrap();

    let producer = producer();
    let operator = Operator::new(&db, serve.admin).await;
    let inputs = Inputs {
        config: &config,
        producer: &producer,
        operator: &operator,
    };
    let stamp = before.state["outstanding"]["stamp"].as_str().unwrap();
    inputs.result(&run_id, stamp, &json!({"charged": 6})).await;
    let letter = tokio::time::timeout(DONE, dead_letters.recv())
        .await
        .expect("the result is dead-lettered")
        .expect("reading the dead letters");
    let header = |name: &str| {
        letter
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == name))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    assert_eq!(header("ductor-dlq-stage").as_deref(), Some("apply"));
    assert_eq!(
        header("ductor-dlq-error-class").as_deref(),
        Some(ductor::apply::ApplyFailure::NEWER_STATE_VERSION)
    );
    let why = header("ductor-dlq-error").unwrap_or_default();
    assert!(why.contains(&format!("version {newer}")), "{why}");
    let after = run_row(&db, &run_id).await.unwrap();
    assert_eq!(
        after.state, before.state,
        "the newer state is left as it is"
    );
    assert_eq!(after.record_version, before.record_version);
    assert_eq!(transitions(&db, &run_id).await.len(), 1);
    serve.stop().await;
    db.drop_db().await;
}

/// A state version comes with a migration of its own, which keeps the
/// binaries before it away (see the test below): the schema names the
/// version this binary writes, so a new version without a migration that
/// says so fails here.
#[tokio::test]
async fn the_schema_names_the_state_version_this_binary_writes() {
    let db = TestDb::migrated().await;
    let comment: Option<String> = sqlx::query_scalar(
        "SELECT col_description(attrelid, attnum) FROM pg_attribute \
         WHERE attrelid = 'runs'::regclass AND attname = 'state'",
    )
    .fetch_one(&db.owner)
    .await
    .unwrap();
    let comment = comment.expect("runs.state has a comment");
    let version = format!("state version {}", ductor::coordinator::STATE_VERSION);
    assert!(comment.contains(&version), "{comment}");
    db.drop_db().await;
}

/// A binary older than the database's schema refuses to start, or to
/// migrate or write, naming the migration it does not know and the newest
/// it knows; it leaves the database as it found it.
#[tokio::test]
async fn a_binary_refuses_a_schema_with_a_migration_it_does_not_know() {
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    let newest = ductor::infra::db::known_migrations()
        .pop()
        .expect("migrations are compiled in");
    let later = newest.version + 1_000_000;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, 'a later schema', true, '\\x00'::bytea, 1)",
    )
    .bind(later)
    .execute(&db.owner)
    .await
    .unwrap();
    let expected = [
        format!("migration {later} (a later schema)"),
        format!("the newest it knows is {newest}"),
        "run the newer binary".to_owned(),
    ];
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), toml::to_string(&config).unwrap()).unwrap();
    for command in ["serve", "migrate"] {
        let out = ductor_testkit::serve_process::on_config_file(&common::ductor_bin(), file.path())
            .arg(command)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), out)
            .await
            .unwrap_or_else(|_| panic!("`ductor {command}` ends at once"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "ductor {command}: {stderr}");
        for part in &expected {
            assert!(stderr.contains(part.as_str()), "ductor {command}: {stderr}");
        }
    }
    let redrive = ductor::cli::commands::redrive(&config, None, None)
        .await
        .expect_err("outbox redrive refuses too");
    assert!(format!("{redrive:#}").contains(&expected[0]), "{redrive:#}");
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY 1")
        .fetch_all(&db.owner)
        .await
        .unwrap();
    let mut known: Vec<i64> = ductor::infra::db::known_migrations()
        .iter()
        .map(|m| m.version)
        .collect();
    known.push(later);
    assert_eq!(applied, known, "nothing was migrated or undone");
    db.drop_db().await;
}
