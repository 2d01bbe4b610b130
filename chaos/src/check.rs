//! The checker: waits for the system to settle, then reads the load driver's
//! log, the whole database and every topic from the beginning (with a fresh
//! consumer group), and reports violations by kind.
//!
//! Violation kinds:
//!
//! - `not_settled` — within the bound, the outbox backlog of due intents,
//!   the coordinator group's lag on the input topics and the number of
//!   running runs did not all reach zero (two rounds in a row).
//! - `lost_input` — an acknowledged good input left no trace: a
//!   client-chosen start without its run; a routed start (Kafka ack or HTTP
//!   2xx) without a completed decision for its key or without that run; a
//!   signal or cancel that was never applied although the coordinator later
//!   applied an input from a higher offset of the same partition to the same
//!   run (so the run was still running when this one came by); a retry never
//!   applied although the run is still failed by the failure it names (and
//!   not compensated: a compensated run takes no retry); a
//!   result whose attempt is still `dispatched`.
//! - `run_not_terminal` — a run still `running` after settling (workers kept
//!   answering and timeouts retry, so every run must end).
//! - `seq_gap`, `record_version`, `state_history_mismatch`,
//!   `input_applied_twice`, `stale_result_applied`, `state_replay_mismatch`,
//!   `transition_source_missing` — see [`super::history`].
//! - `event_history_mismatch` — a `run.event` on the events topic names a
//!   (run, seq) whose transition does not exist or has another kind/status.
//! - `duplicate_decision` — two decisions for one `(tenant, pool, key)`: HTTP
//!   answers naming different runs, more than one `run.accepted` run id, or
//!   an answer that differs from the routing row's decision.
//! - `dangling_decision` — a completed routing row whose decision is not a
//!   run of that tenant and pool.
//! - `bad_input_accepted` — a request meant to be refused (a key reused for
//!   a different request) was answered 2xx.
//! - `intent_not_completed` — a committed intent due before the settle point
//!   is not completed.
//! - `intent_not_published` — a completed intent appears nowhere on its topic.
//! - `duplicate_differs` — two deliveries with one idempotency key differ in
//!   message key, headers or payload.
//! - `effect_order` — on one (run, topic, partition), the first deliveries of
//!   immediately due effects do not follow (seq, effect index) order.
//! - `effect_without_intent` — a delivered message carries an idempotency
//!   key that no committed intent has (an effect of a rolled-back
//!   transaction).
//! - `effect_differs_from_intent` — a delivered effect's topic, key, headers
//!   or payload differ from its intent row.
//! - `good_input_dead_lettered` / `bad_input_not_dead_lettered` — matched on
//!   the `ductor-dlq-topic/partition/offset` headers.
//! - `effect_dead_lettered` — one of Ductor's own effects (a timer) ended in
//!   the DLQ.
//! - `off_contract` — an effect (payload or headers), a dead letter's
//!   headers, or an input the coordinator accepted, is not valid against
//!   the contract's committed JSON Schemas (`schemas/`).
//! - `lane_stalled` — a serve's `ductor_ingress_stalled_lanes`, read by the
//!   load driver every second, was above zero: an apply lane held a batch
//!   it could not commit for `coordinator.stall_after_ms`.
//! - `failed_by_timeout_not_slow` — a run failed because its last attempt
//!   timed out, although the worker's answer to that attempt was
//!   acknowledged by the broker before the attempt's deadline (and was not
//!   one it sent late on purpose): a crash of Ductor failed a healthy run.
//! - `replay_not_recorded`, `replay_answers_differ`, `replay_not_on_topic`,
//!   `replay_differs`, `replay_duplicated`, `replay_fate_changed`,
//!   `replay_applied` — the load's replays of dead letters; see
//!   [`super::replays`].
//! - `run_counts_differ` — the operator's kept count of a (tenant,
//!   workflow, version, status), what `GET /v1/runs/counts` answers, is
//!   not the number of such runs; see [`super::counts`].
//! - `tenant_crossing` — an effect whose `ductor-tenant` header or payload
//!   tenant is not its run's tenant; a decision (HTTP answer, `run.accepted`,
//!   the created run) in another tenant than the request's.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};
use tokio::time::Instant;
use uuid::Uuid;

use super::CheckArgs;
use super::history::{self, RunRows};
use super::log::{self, Record};
use super::snapshot::{
    AttemptRow, DbSnapshot, IntentRow, RoutingRow, RunRow, TransitionRow, load_db,
};
use super::topics::{self, Msg};
use super::violations::Violations;
use ductor::config::Config;
use ductor::contract::TopicNames;
use ductor::contract::headers;
use ductor::coordinator::Workflows;

/// Pause between settle rounds; longer than the ingress' offset commit
/// interval, so a clean round after a clean round means nothing moved.
const SETTLE_ROUND: Duration = Duration::from_millis(1500);
/// Bound on reading every topic.
const READ_TIMEOUT: Duration = Duration::from_secs(600);

/// The checker's one JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Faults injected, by kind (from the faults file).
    pub faults: BTreeMap<String, u64>,
    /// Inputs the log says were acknowledged (broker acks and HTTP answers).
    pub inputs: u64,
    /// Runs in the database.
    pub runs: u64,
    /// Deliveries beyond the first, over all effects.
    pub duplicate_deliveries: u64,
    /// With `--afterlife`: what retention purged and what was delivered
    /// again (see [`super::afterlife`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afterlife: Option<super::afterlife::Afterlife>,
    /// The load's replays of dead letters (see [`super::replays`]).
    pub replays: super::replays::ReplayFigures,
    pub violations: BTreeMap<String, u64>,
    pub examples: BTreeMap<String, Vec<String>>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Settles, reads everything and checks it.
pub async fn run(args: &CheckArgs, config: &Config) -> anyhow::Result<Report> {
    let records = log::read(&args.log)?;
    let (faults, deaths_ms) = match &args.faults {
        Some(path) => read_faults(path)?,
        None => (BTreeMap::new(), Vec::new()),
    };
    let workflows = ductor::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pool = connect(config).await?;
    let mut v = Violations::default();
    let settle_at = match settle(&pool, config, Duration::from_secs(args.settle_timeout_s)).await? {
        Ok(at) => at,
        Err((why, at)) => {
            v.add("not_settled", || why);
            at
        }
    };
    let db = load_db(&pool).await?;
    pool.close().await;
    let kafka = config.kafka.clone();
    let topic_list = all_topics(config, &workflows);
    let (msgs, missing) =
        tokio::task::spawn_blocking(move || topics::read_all(&kafka, &topic_list, READ_TIMEOUT))
            .await
            .context("reading topics")??;
    for topic in missing {
        tracing::info!(topic, "topic does not exist; skipped");
    }
    let mut report = analyse(
        &Inputs {
            records: &records,
            db: &db,
            msgs: &msgs,
            settle_at,
            config,
            workflows: &workflows,
            deaths_ms: &deaths_ms,
        },
        &mut v,
    );
    report.faults = faults;
    if args.afterlife && !report.violations.contains_key("not_settled") {
        let pool = connect(config).await?;
        let timeout = Duration::from_secs(args.settle_timeout_s);
        let settled = || async {
            match settle(&pool, config, timeout).await? {
                Ok(_) => Ok(()),
                Err((why, _)) => Err(anyhow::anyhow!("not settled after the redelivery: {why}")),
            }
        };
        let afterlife =
            super::afterlife::run(&pool, config, &records, &msgs, settled, &mut v).await?;
        pool.close().await;
        report.afterlife = Some(afterlife);
        report.violations = v.counts.clone();
        report.examples = v.examples.clone();
    }
    Ok(report)
}

async fn connect(config: &Config) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = config
        .database
        .url
        .expose()
        .parse()
        .with_context(|| format!("parsing database url {}", config.database.url))?;
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options.application_name("ductor-chaos-check"))
        .await
        .with_context(|| format!("connecting to {}", config.database.url))
}

/// The faults by kind, and when a serve died (a SIGKILL or a failpoint
/// crash), ms since the epoch.
fn read_faults(path: &Path) -> anyhow::Result<(BTreeMap<String, u64>, Vec<i64>)> {
    let (mut out, mut deaths) = (BTreeMap::new(), Vec::new());
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((out, deaths)),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fault = serde_json::from_str::<Value>(line).unwrap_or_default();
        let kind = fault
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string();
        if (kind == "kill_serve" || kind.starts_with("crash:"))
            && let Some(t) = fault.get("t_ms").and_then(Value::as_i64)
        {
            deaths.push(t);
        }
        *out.entry(kind).or_default() += 1;
    }
    Ok((out, deaths))
}

/// Every topic the checker reads: the inputs, the events, the DLQ, every
/// step topic and output topic.
fn all_topics(config: &Config, workflows: &Workflows) -> Vec<String> {
    let mut set = BTreeSet::new();
    let names = config.topic_names();
    set.insert(names.requests());
    set.insert(names.wakeups());
    set.insert(names.attempt_results());
    set.insert(names.events());
    set.insert(names.dead_letters());
    for p in &config.kafka.step_pools {
        set.insert(names.steps(p));
    }
    for t in &config.kafka.extra_topics {
        set.insert(t.clone());
    }
    for w in workflows.iter() {
        for pool in w.steps.iter().filter_map(|s| s.task_pool()) {
            set.insert(names.steps(pool));
        }
        if let Some(t) = &w.output_topic {
            set.insert(t.clone());
        }
    }
    set.into_iter().collect()
}

/// Waits until the due backlog, the coordinator's lag and the running runs
/// are zero in two rounds in a row. `Ok(settle time)`, or `Err((why, time))`
/// when the bound ran out. The time is the database's clock.
async fn settle(
    pool: &PgPool,
    config: &Config,
    timeout: Duration,
) -> anyhow::Result<Result<DateTime<Utc>, (String, DateTime<Utc>)>> {
    let deadline = Instant::now() + timeout;
    let inputs = config.topic_names().inputs();
    let mut clean = 0;
    loop {
        let kafka = config.kafka.clone();
        let group = config.kafka.group_id.clone();
        let topics = inputs.clone();
        let lag = tokio::task::spawn_blocking(move || topics::group_lag(&kafka, &group, &topics))
            .await
            .context("measuring lag")?;
        let db = sqlx::query(
            "SELECT now() AS now, \
                (SELECT count(*) FROM eec_effect_intent WHERE status <> 'completed' \
                     AND GREATEST(not_before, deferred_until) <= now()) AS due, \
                (SELECT count(*) FROM runs WHERE status = 'running') AS running",
        )
        .fetch_one(pool)
        .await;
        let state = match (&lag, &db) {
            (Ok(lag), Ok(row)) => {
                let now: DateTime<Utc> = row.try_get("now")?;
                let due: i64 = row.try_get("due")?;
                let running: i64 = row.try_get("running")?;
                Some((now, *lag, due, running))
            }
            _ => None,
        };
        if let Some((now, 0, 0, 0)) = state {
            clean += 1;
            if clean >= 2 {
                return Ok(Ok(now));
            }
        } else {
            clean = 0;
        }
        if Instant::now() >= deadline {
            let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
                .fetch_one(pool)
                .await
                .unwrap_or_else(|_| Utc::now());
            let why = match (state, lag, db) {
                (Some((_, lag, due, running)), _, _) => format!(
                    "after {} s: lag {lag}, due intents {due}, running runs {running}",
                    timeout.as_secs()
                ),
                (None, Err(e), _) => format!("after {} s: kafka: {e:#}", timeout.as_secs()),
                (None, _, Err(e)) => format!("after {} s: postgres: {e}", timeout.as_secs()),
                (None, Ok(_), Ok(_)) => "unknown".into(),
            };
            return Ok(Err((why, now)));
        }
        tokio::time::sleep(SETTLE_ROUND).await;
    }
}

/// Everything [`analyse`] looks at.
pub struct Inputs<'a> {
    pub records: &'a [Record],
    pub db: &'a DbSnapshot,
    pub msgs: &'a [Msg],
    /// Database time at which the system was seen settled.
    pub settle_at: DateTime<Utc>,
    pub config: &'a Config,
    pub workflows: &'a Workflows,
    /// When a serve died, ms since the epoch (from the faults file).
    pub deaths_ms: &'a [i64],
}

/// Runs every check over the data.
pub fn analyse(inp: &Inputs<'_>, v: &mut Violations) -> Report {
    let db = inp.db;
    let ix = Index::of(db);
    let names = inp.config.topic_names();
    let dlq_topic = names.dead_letters();

    histories(inp, &ix, v);
    let counts = super::counts::kept(&db.run_counts);
    super::counts::compare(&counts, &super::counts::counted(&db.runs), "settled", v);
    timeouts_not_slow(inp.records, db, &ix.attempt_by_stamp, v);
    lanes_stalled(inp.records, v);
    intents_without_run(db, &ix, v);

    let deliveries = deliveries(inp.msgs, &dlq_topic);
    effects_as_committed(&deliveries, &ix, v);
    intents_published(db, &deliveries, inp.settle_at, v);
    effect_order(db, &deliveries, &ix, v);
    let accepted = events_agree(db, &deliveries, &names.events(), &ix, v);
    dangling_decisions(db, &ix, v);

    let dead = dead_letters(inp.msgs, &dlq_topic, v);
    off_contract(inp.msgs, &dead, &names.inputs(), v);
    let logged = logged_inputs(inp.records, &ix, &dead, &accepted, v);
    let answered = http_answers(inp.records, &ix, v);
    let replays = super::replays::check(
        &super::replays::Seen {
            records: inp.records,
            letters: &db.letters,
            msgs: inp.msgs,
            transitions: &db.transitions,
            inputs: &names.inputs(),
            deaths_ms: inp.deaths_ms,
        },
        v,
    );

    Report {
        faults: BTreeMap::new(),
        inputs: logged + answered,
        runs: db.runs.len() as u64,
        duplicate_deliveries: duplicate_deliveries(&deliveries),
        afterlife: None,
        replays,
        violations: v.counts.clone(),
        examples: v.examples.clone(),
    }
}

/// The database rows, indexed the ways the checks look them up.
struct Index<'a> {
    runs: HashMap<&'a str, &'a RunRow>,
    /// By run, in seq order.
    transitions: HashMap<&'a str, Vec<TransitionRow>>,
    attempts: HashMap<&'a str, Vec<AttemptRow>>,
    attempt_by_stamp: HashMap<Uuid, &'a AttemptRow>,
    /// By run, in (seq, effect index) order.
    intents_by_run: HashMap<&'a str, Vec<&'a IntentRow>>,
    intent_by_key: HashMap<&'a str, &'a IntentRow>,
    /// By (tenant, pool, key).
    routing: HashMap<(&'a str, &'a str, &'a str), &'a RoutingRow>,
}

impl<'a> Index<'a> {
    fn of(db: &'a DbSnapshot) -> Index<'a> {
        Index {
            runs: db.runs.iter().map(|r| (r.run_id.as_str(), r)).collect(),
            transitions: by_run(&db.transitions, |t| t.run_id.as_str(), TransitionRow::clone),
            attempts: by_run(&db.attempts, |a| a.run_id.as_str(), AttemptRow::clone),
            attempt_by_stamp: db.attempts.iter().map(|a| (a.stamp, a)).collect(),
            intents_by_run: by_run(&db.intents, |i| i.run_id.as_str(), |i| i),
            intent_by_key: db.intents.iter().map(|i| (i.key.as_str(), i)).collect(),
            routing: db
                .routing
                .iter()
                .map(|r| ((r.tenant.as_str(), r.pool.as_str(), r.key.as_str()), r))
                .collect(),
        }
    }

    fn transitions(&self, run: &str) -> &[TransitionRow] {
        self.transitions.get(run).map_or(&[], Vec::as_slice)
    }

    fn attempts(&self, run: &str) -> &[AttemptRow] {
        self.attempts.get(run).map_or(&[], Vec::as_slice)
    }

    fn intents(&self, run: &str) -> &[&'a IntentRow] {
        self.intents_by_run.get(run).map_or(&[], Vec::as_slice)
    }

    /// The run a completed routing row decided for (tenant, pool, key).
    fn decision(&self, tenant: &str, pool: &str, key: &str) -> Option<&'a str> {
        self.routing
            .get(&(tenant, pool, key))
            .filter(|row| row.status == "completed")
            .and_then(|row| row.decision_id.as_deref())
    }

    /// The run recorded a transition for `input_ref`.
    fn applied(&self, run: &str, input_ref: &str) -> bool {
        self.transitions(run)
            .iter()
            .any(|t| t.input_ref == input_ref)
    }

    /// The run was provably still taking inputs from this partition after
    /// this offset.
    fn later_on_partition(&self, run: &str, at: At<'_>) -> bool {
        self.transitions(run)
            .iter()
            .any(|t| at.is_before(t.source.as_ref()))
    }

    /// The offset a run was created from, when it is later than `at` on the
    /// same topic and partition.
    fn created_later(&self, run: &str, at: At<'_>) -> Option<i64> {
        self.transitions(run)
            .first()
            .and_then(|t| t.source.as_ref())
            .filter(|source| at.is_before(Some(*source)))
            .map(|(_, _, so)| *so)
    }

    /// The attempt was dispatched by a transition before `seq`.
    fn attempt_dispatched_before(&self, run: &str, stamp: Uuid, seq: i64) -> bool {
        self.transitions(run)
            .iter()
            .any(|t| t.seq < seq && history::introduced(t, stamp))
    }
}

/// `rows` grouped by the run they belong to, each kept in its order.
fn by_run<'a, R, T>(
    rows: &'a [R],
    run_id: impl Fn(&'a R) -> &'a str,
    keep: impl Fn(&'a R) -> T,
) -> HashMap<&'a str, Vec<T>> {
    let mut out: HashMap<&str, Vec<T>> = HashMap::new();
    for row in rows {
        out.entry(run_id(row)).or_default().push(keep(row));
    }
    out
}

/// Per run: the stored state agrees with its history (see
/// [`super::history`]), and the run ended.
fn histories(inp: &Inputs<'_>, ix: &Index<'_>, v: &mut Violations) {
    let config = inp.config;
    let names = config.topic_names();
    let requests_topic = names.requests();
    let wakeups_topic = names.wakeups();
    let results_topic = names.attempt_results();
    let inputs_by_pos: HashMap<(String, i32, i64), &Msg> = inp
        .msgs
        .iter()
        .filter(|m| {
            m.topic == requests_topic || m.topic == wakeups_topic || m.topic == results_topic
        })
        .map(|m| ((m.topic.clone(), m.partition, m.offset), m))
        .collect();
    let topic_names = TopicNames {
        prefix: config.kafka.topic_prefix.clone(),
    };
    let ctx = history::Context {
        workflows: inp.workflows,
        topics: &topic_names,
        inputs: &inputs_by_pos,
        requests_topic: &requests_topic,
        wakeups_topic: &wakeups_topic,
        results_topic: &results_topic,
        limits: config.input_limits(),
        max_state_bytes: config.coordinator.max_state_bytes,
    };
    for run in &inp.db.runs {
        let id = run.run_id.as_str();
        history::check_run(
            &ctx,
            &RunRows {
                run,
                transitions: ix.transitions(id),
                attempts: ix.attempts(id),
                intents: ix.intents(id),
            },
            v,
        );
        if run.status == "running" {
            v.add("run_not_terminal", || {
                format!("{id} is still running after settling")
            });
        }
    }
}

/// The stamp of a logged worker answer (`result:<stamp>`).
fn result_stamp(r: &Record) -> Option<&str> {
    r.input_ref
        .as_deref()
        .and_then(|i| i.strip_prefix("result:"))
}

/// Runs failed by a timeout although the worker was not slow: the attempt
/// that exhausted the run's retries timed out, yet an answer to it (not one
/// sent late on purpose) was acknowledged before its deadline.
fn timeouts_not_slow(
    records: &[Record],
    db: &DbSnapshot,
    attempt_by_stamp: &HashMap<Uuid, &AttemptRow>,
    v: &mut Violations,
) {
    let mut answered: HashMap<&str, i64> = HashMap::new();
    for r in records {
        let result = r.kind.as_deref() == Some(log::KIND_RESULT);
        if !result || !r.acked || r.note.as_deref() == Some("late") {
            continue;
        }
        let Some(stamp) = result_stamp(r) else {
            continue;
        };
        let first = answered.entry(stamp).or_insert(r.t_ms);
        *first = (*first).min(r.t_ms);
    }
    for t in &db.transitions {
        if t.kind != ductor::contract::TransitionKind::RunFailed.as_str()
            || t.detail["cause"] != "attempts_exhausted"
        {
            continue;
        }
        let Some(stamp) = t.detail["stamp"].as_str() else {
            continue;
        };
        let Some(attempt) = Uuid::parse_str(stamp)
            .ok()
            .and_then(|s| attempt_by_stamp.get(&s))
        else {
            continue;
        };
        let deadline_ms = attempt.deadline.timestamp_millis();
        match answered.get(stamp) {
            Some(&at) if attempt.status == "timed_out" && at <= deadline_ms => {
                v.add("failed_by_timeout_not_slow", || {
                    format!(
                        "{}: attempt {stamp} timed out, answered {} ms before its deadline",
                        t.run_id,
                        deadline_ms - at
                    )
                })
            }
            _ => {}
        }
    }
}

/// Every stalled-lanes reading the load driver logged: a lane held a batch
/// it could not commit.
fn lanes_stalled(records: &[Record], v: &mut Violations) {
    for r in records.iter().filter(|r| r.ev == log::EV_STALL) {
        v.add("lane_stalled", || {
            format!(
                "{} at {}: {}",
                r.server.as_deref().unwrap_or("?"),
                r.t_ms,
                r.note.as_deref().unwrap_or("")
            )
        });
    }
}

/// An intent is committed by a transition of an existing run.
fn intents_without_run(db: &DbSnapshot, ix: &Index<'_>, v: &mut Violations) {
    for i in &db.intents {
        if !ix.runs.contains_key(i.run_id.as_str()) {
            v.add("state_history_mismatch", || {
                format!("intent {} names a run that does not exist", i.key)
            });
        }
    }
}

/// Effects as delivered, by idempotency key: every message carrying one,
/// except dead letters (which keep the headers of what they carry).
type Deliveries<'m> = BTreeMap<&'m str, Vec<&'m Msg>>;

fn deliveries<'m>(msgs: &'m [Msg], dlq_topic: &str) -> Deliveries<'m> {
    let mut deliveries: Deliveries<'m> = BTreeMap::new();
    for m in msgs.iter().filter(|m| m.topic != dlq_topic) {
        if let Some(key) = m.header_str("idempotency-key") {
            deliveries.entry(key).or_default().push(m);
        }
    }
    deliveries
}

/// Deliveries beyond the first, over all effects.
fn duplicate_deliveries(deliveries: &Deliveries<'_>) -> u64 {
    deliveries
        .values()
        .map(|copies| copies.len() as u64 - 1)
        .sum()
}

/// Headers as a sorted list, so that the order of a jsonb map does not matter.
fn header_set(headers: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let mut h = headers.to_vec();
    h.sort();
    h
}

fn intent_headers(intent: &IntentRow) -> Vec<(String, Vec<u8>)> {
    let mut h: Vec<(String, Vec<u8>)> = intent
        .headers
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.as_str().unwrap_or_default().as_bytes().to_vec(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    h.sort();
    h
}

/// Every delivered effect is one a transition committed, delivered as its
/// intent row says, every copy alike, in its run's tenant.
fn effects_as_committed(deliveries: &Deliveries<'_>, ix: &Index<'_>, v: &mut Violations) {
    for (key, copies) in deliveries {
        copies_identical(key, copies, v);
        let first = copies[0];
        match ix.intent_by_key.get(key) {
            None => effect_without_intent(key, first, ix, v),
            Some(intent) => {
                copies_match_intent(key, copies, intent, v);
                tenant_of_effect(key, first, ix, v);
            }
        }
    }
}

/// Two deliveries with one idempotency key are byte-identical: message
/// key, payload and headers.
fn copies_identical(key: &str, copies: &[&Msg], v: &mut Violations) {
    let first = copies[0];
    let first_headers = header_set(&first.headers);
    if copies.iter().skip(1).any(|c| {
        c.key != first.key || c.payload != first.payload || header_set(&c.headers) != first_headers
    }) {
        v.add("duplicate_differs", || {
            format!("{key}: {} deliveries are not byte-identical", copies.len())
        });
    }
}

/// A delivery no intent backs is an effect of a rolled-back transaction,
/// but for one case: a timeout timer whose publish was reported failed (yet
/// may have landed) can be deleted afterwards by the transition that
/// finished its attempt: its transition exists, its attempt ended.
fn effect_without_intent(key: &str, first: &Msg, ix: &Index<'_>, v: &mut Violations) {
    let run_id = first.header_str("ductor-run-id").unwrap_or("");
    let seq: i64 = first
        .header_str("ductor-seq")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let committed = ix.transitions(run_id).iter().any(|t| t.seq == seq);
    let cancelled = serde_json::from_slice::<Value>(&first.payload)
        .is_ok_and(|p| history::cancelled_timeout(&p, ix.attempts(run_id)));
    if !(committed && cancelled) {
        v.add("effect_without_intent", || {
            format!("{key} on {} has no committed intent", first.topic)
        });
    }
}

/// Every copy of an effect has its intent's topic, key, payload and headers.
fn copies_match_intent(key: &str, copies: &[&Msg], intent: &IntentRow, v: &mut Violations) {
    if copies.iter().any(|c| {
        c.topic != intent.topic
            || c.key.as_deref() != Some(intent.message_key.as_slice())
            || c.payload != intent.payload
            || header_set(&c.headers) != intent_headers(intent)
    }) {
        v.add("effect_differs_from_intent", || {
            format!("{key}: a delivery differs from its intent row")
        });
    }
}

/// Nothing crosses tenants: an effect's `ductor-tenant` header is its run's
/// tenant and the tenant its payload names.
fn tenant_of_effect(key: &str, first: &Msg, ix: &Index<'_>, v: &mut Violations) {
    let header_tenant = first.header_str("ductor-tenant").unwrap_or("");
    let payload_tenant = serde_json::from_slice::<Value>(&first.payload)
        .ok()
        .and_then(|p| p.get("tenant").and_then(Value::as_str).map(String::from));
    let run_tenant = first
        .header_str("ductor-run-id")
        .and_then(|r| ix.runs.get(r))
        .map(|r| r.tenant.as_str());
    if run_tenant.is_some_and(|t| t != header_tenant)
        || payload_tenant
            .as_deref()
            .is_some_and(|t| t != header_tenant)
    {
        v.add("tenant_crossing", || {
            format!(
                "{key}: header tenant {header_tenant:?}, payload {payload_tenant:?}, run {run_tenant:?}"
            )
        });
    }
}

/// Every committed intent due before the settle point is completed and on
/// its topic.
fn intents_published(
    db: &DbSnapshot,
    deliveries: &Deliveries<'_>,
    settle_at: DateTime<Utc>,
    v: &mut Violations,
) {
    for i in &db.intents {
        if i.status != "completed" {
            if i.due_at <= settle_at {
                v.add("intent_not_completed", || {
                    format!("{} ({}) is {} though due", i.key, i.topic, i.status)
                });
            }
            continue;
        }
        let on_topic = deliveries
            .get(i.key.as_str())
            .is_some_and(|c| c.iter().any(|m| m.topic == i.topic));
        if !on_topic {
            v.add("intent_not_published", || {
                format!("{} is completed but not on {}", i.key, i.topic)
            });
        }
    }
}

/// First deliveries per (run, topic) follow (seq, effect index) order,
/// among effects due at once (timers are due later by design).
fn effect_order(db: &DbSnapshot, deliveries: &Deliveries<'_>, ix: &Index<'_>, v: &mut Violations) {
    let transition_at: HashMap<(&str, i64), DateTime<Utc>> = db
        .transitions
        .iter()
        .map(|t| ((t.run_id.as_str(), t.seq), t.created_at))
        .collect();
    // In order where a consumer can see an order: on one partition. A
    // run's own effects share one; what it sends other runs (a child's
    // start and cancel, keyed by the child) lands on theirs.
    let mut streams: BTreeMap<(&str, &str, i32), Vec<&Msg>> = BTreeMap::new();
    for copies in deliveries.values() {
        for m in copies {
            if let Some(run) = m.header_str("ductor-run-id") {
                streams
                    .entry((run, m.topic.as_str(), m.partition))
                    .or_default()
                    .push(m);
            }
        }
    }
    for ((run, topic, _), mut msgs) in streams {
        msgs.sort_by_key(|m| m.offset);
        let immediate = |intent: &IntentRow| {
            transition_at
                .get(&(run, intent.seq))
                .is_some_and(|at| intent.not_before <= *at)
        };
        let mut seen = HashSet::new();
        let mut last: Option<(i64, i32)> = None;
        for m in msgs {
            let Some(key) = m.header_str("idempotency-key") else {
                continue;
            };
            if !seen.insert(key) {
                continue;
            }
            let Some(intent) = ix.intent_by_key.get(key).filter(|i| immediate(i)) else {
                continue;
            };
            let pos = (intent.seq, intent.effect_index);
            if last.is_some_and(|l| l >= pos) {
                v.add("effect_order", || {
                    format!("{run} on {topic}: {key} delivered after {last:?}")
                });
            }
            last = Some(pos);
        }
    }
}

/// A text field of an event, empty when missing.
fn text(p: &Value, k: &str) -> String {
    p.get(k).and_then(Value::as_str).unwrap_or("").to_string()
}

/// What the events topic says was accepted for routed requests.
#[derive(Default)]
struct Accepted {
    /// Run ids by (tenant, pool, idempotency key).
    by_key: BTreeMap<(String, String, String), BTreeSet<String>>,
    /// (run, tenant) by the request's correlation id.
    by_corr: HashMap<String, (String, String)>,
}

/// The events topic agrees with the history, and accepted one run per
/// routed key, in the request's tenant.
fn events_agree(
    db: &DbSnapshot,
    deliveries: &Deliveries<'_>,
    events_topic: &str,
    ix: &Index<'_>,
    v: &mut Violations,
) -> Accepted {
    let mut accepted = Accepted::default();
    let history_index: HashMap<(&str, i64), (&str, &str)> = db
        .transitions
        .iter()
        .map(|t| {
            (
                (t.run_id.as_str(), t.seq),
                (t.kind.as_str(), t.to_status.as_str()),
            )
        })
        .collect();
    for copies in deliveries.values() {
        let m = copies[0];
        if m.topic != events_topic {
            continue;
        }
        let Ok(p) = serde_json::from_slice::<Value>(&m.payload) else {
            continue;
        };
        match p.get("type").and_then(Value::as_str) {
            Some("run.event") => event_in_history(&p, &history_index, v),
            Some("run.accepted") => accepted.record(&p, ix, v),
            _ => {}
        }
    }
    for ((tenant, pool, key), ids) in &accepted.by_key {
        if ids.len() > 1 {
            v.add("duplicate_decision", || {
                format!(
                    "({tenant}, {pool}, {key}) accepted as {} runs: {ids:?}",
                    ids.len()
                )
            });
        }
    }
    accepted
}

/// A `run.event` names a (run, seq) whose transition has its kind and status.
fn event_in_history(
    p: &Value,
    history_index: &HashMap<(&str, i64), (&str, &str)>,
    v: &mut Violations,
) {
    let run = text(p, "run_id");
    let seq = p.get("seq").and_then(Value::as_i64).unwrap_or(0);
    let (kind, status) = (text(p, "kind"), text(p, "status"));
    if history_index.get(&(run.as_str(), seq)) != Some(&(kind.as_str(), status.as_str())) {
        v.add("event_history_mismatch", || {
            format!("{run} seq {seq} {kind}/{status} is not in the history")
        });
    }
}

impl Accepted {
    /// Notes a `run.accepted`; its run must be of the tenant it says.
    fn record(&mut self, p: &Value, ix: &Index<'_>, v: &mut Violations) {
        let (run, tenant, pool) = (text(p, "run_id"), text(p, "tenant"), text(p, "pool"));
        if let Some(key) = p.get("idempotency_key").and_then(Value::as_str) {
            self.by_key
                .entry((tenant.clone(), pool.clone(), key.to_string()))
                .or_default()
                .insert(run.clone());
        }
        if ix
            .runs
            .get(run.as_str())
            .is_some_and(|r| r.tenant != tenant)
        {
            v.add("tenant_crossing", || {
                format!("run.accepted for {run} says tenant {tenant}")
            });
        }
        if let Some(corr) = p.get("correlation_id").and_then(Value::as_str) {
            self.by_corr.insert(corr.to_string(), (run, tenant));
        }
    }
}

/// A completed routing row decided a run of its own tenant and pool.
fn dangling_decisions(db: &DbSnapshot, ix: &Index<'_>, v: &mut Violations) {
    for r in &db.routing {
        if r.status != "completed" {
            continue;
        }
        let ok = r
            .decision_id
            .as_deref()
            .and_then(|d| ix.runs.get(d))
            .is_some_and(|run| run.tenant == r.tenant && run.pool == r.pool);
        if !ok {
            v.add("dangling_decision", || {
                format!(
                    "({}, {}, {}) decided {:?}, which is no run of that tenant and pool",
                    r.tenant, r.pool, r.key, r.decision_id
                )
            });
        }
    }
}

/// Where each dead letter's input was; none of Ductor's own effects may
/// be among them.
fn dead_letters(msgs: &[Msg], dlq_topic: &str, v: &mut Violations) -> HashSet<(String, i32, i64)> {
    let mut dead: HashSet<(String, i32, i64)> = HashSet::new();
    for m in msgs.iter().filter(|m| m.topic == dlq_topic) {
        let pos = (
            m.header_str(headers::DLQ_TOPIC).map(String::from),
            m.header_str(headers::DLQ_PARTITION)
                .and_then(|p| p.parse().ok()),
            m.header_str(headers::DLQ_OFFSET)
                .and_then(|o| o.parse().ok()),
        );
        if let (Some(t), Some(p), Some(o)) = pos {
            dead.insert((t, p, o));
        }
        if let Some(key) = m.header_str("idempotency-key") {
            v.add("effect_dead_lettered", || {
                format!("Ductor's own effect {key} was dead-lettered")
            });
        }
    }
    dead
}

/// Every record Ductor published (effects, dead letters) and every input
/// the coordinator accepted (not dead-lettered) is valid against the
/// contract's committed schemas: the schemas promise users nothing the
/// engine does not keep, and take nothing the engine refuses.
fn off_contract(
    msgs: &[Msg],
    dead: &HashSet<(String, i32, i64)>,
    inputs: &[String],
    v: &mut Violations,
) {
    use ductor_testkit::schemas::{check_message, check_published};
    for m in msgs {
        let at = || format!("{} [{}] @{}", m.topic, m.partition, m.offset);
        if let Err(e) = check_published(&m.headers, &m.payload) {
            v.add("off_contract", || format!("{}: {e}", at()));
            continue;
        }
        let accepted_input =
            inputs.contains(&m.topic) && !dead.contains(&(m.topic.clone(), m.partition, m.offset));
        if !accepted_input {
            continue;
        }
        let checked = serde_json::from_slice::<Value>(&m.payload)
            .map_err(|e| e.to_string())
            .and_then(|value| check_message(&value));
        if let Err(e) = checked {
            v.add("off_contract", || format!("accepted input {}: {e}", at()));
        }
    }
}

/// A topic, partition and offset an input was acknowledged at.
#[derive(Clone, Copy)]
struct At<'a> {
    topic: &'a str,
    partition: i32,
    offset: i64,
}

impl At<'_> {
    /// `source` is a later offset of the same topic and partition.
    fn is_before(self, source: Option<&(String, i32, i64)>) -> bool {
        source.is_some_and(|(t, p, o)| t == self.topic && *p == self.partition && *o > self.offset)
    }
}

/// An input the broker acknowledged, as the log has it.
struct Logged<'a> {
    r: &'a Record,
    at: At<'a>,
    tenant: &'a str,
    run_id: &'a str,
}

impl<'a> Logged<'a> {
    fn of(r: &'a Record) -> Option<Logged<'a>> {
        let (Some(topic), Some(partition), Some(offset)) =
            (r.topic.as_deref(), r.partition, r.offset)
        else {
            return None;
        };
        Some(Logged {
            r,
            at: At {
                topic,
                partition,
                offset,
            },
            tenant: r.tenant.as_deref().unwrap_or(""),
            run_id: r.run_id.as_deref().unwrap_or(""),
        })
    }

    /// How an example names the input.
    fn what(&self) -> String {
        let At {
            topic,
            partition,
            offset,
        } = self.at;
        format!(
            "{} {} at {topic}/{partition}@{offset}",
            self.r.kind.as_deref().unwrap_or("?"),
            self.r
                .input_ref
                .as_deref()
                .or(self.r.bad.as_deref())
                .unwrap_or("")
        )
    }
}

/// The log: nothing acknowledged is lost; good never dead-lettered, bad
/// always. Returns how many inputs the broker acknowledged.
fn logged_inputs(
    records: &[Record],
    ix: &Index<'_>,
    dead: &HashSet<(String, i32, i64)>,
    accepted: &Accepted,
    v: &mut Violations,
) -> u64 {
    let mut inputs = 0u64;
    for r in records.iter().filter(|r| r.ev == log::EV_INPUT && r.acked) {
        inputs += 1;
        let Some(input) = Logged::of(r) else {
            continue;
        };
        if !dead_letter_fate(&input, expected_good(&input, ix), dead, v) {
            continue;
        }
        match r.kind.as_deref() {
            Some(log::KIND_START) => start_kept(&input, ix, v),
            Some(log::KIND_ROUTED) => {
                routed_start_kept(&input, ix, v);
                accepted_in_tenant(&input, accepted, v);
            }
            Some(log::KIND_SIGNAL | log::KIND_CANCEL) => wakeup_kept(&input, ix, v),
            Some(log::KIND_RETRY) => retry_kept(&input, ix, v),
            Some(log::KIND_RESULT) => result_kept(&input, ix, v),
            _ => {}
        }
    }
    inputs
}

/// Whether an input should have been taken. The load knows for all but a
/// signal id reused with another payload: that one is a mismatch if the
/// first copy was recorded, and a no-op like its first copy if not.
fn expected_good(input: &Logged<'_>, ix: &Index<'_>) -> bool {
    let reused = input.r.kind.as_deref() == Some(log::KIND_SIGNAL)
        && input.r.note.as_deref() == Some("mismatch");
    if !reused {
        return input.r.good;
    }
    let input_ref = input.r.input_ref.as_deref().unwrap_or("");
    !ix.applied(input.run_id, input_ref)
}

/// A bad input is dead-lettered, a good one is not; true for a good one,
/// whose fate the other checks look at.
fn dead_letter_fate(
    input: &Logged<'_>,
    good: bool,
    dead: &HashSet<(String, i32, i64)>,
    v: &mut Violations,
) -> bool {
    let pos = (
        input.at.topic.to_string(),
        input.at.partition,
        input.at.offset,
    );
    if !good {
        if !dead.contains(&pos) {
            v.add("bad_input_not_dead_lettered", || {
                format!(
                    "{} ({})",
                    input.what(),
                    input.r.bad.as_deref().unwrap_or("")
                )
            });
        }
        return false;
    }
    if dead.contains(&pos) {
        v.add("good_input_dead_lettered", || input.what());
    }
    true
}

/// A client-chosen start created its run, in its tenant, from this copy or
/// an earlier one.
fn start_kept(input: &Logged<'_>, ix: &Index<'_>, v: &mut Violations) {
    let (run_id, tenant) = (input.run_id, input.tenant);
    match ix.runs.get(run_id) {
        None => v.add("lost_input", || {
            format!("{}: run {run_id} missing", input.what())
        }),
        Some(run) if run.tenant != tenant => v.add("tenant_crossing", || {
            format!("{run_id} requested by {tenant}, owned by {}", run.tenant)
        }),
        Some(_) => {
            if let Some(o1) = ix.created_later(run_id, input.at) {
                v.add("lost_input", || {
                    format!(
                        "{}: {run_id} was created by a later copy at offset {o1}",
                        input.what()
                    )
                });
            }
        }
    }
}

/// A routed start got a completed decision for its key, naming a run of
/// its tenant, decided from this request or an earlier one.
fn routed_start_kept(input: &Logged<'_>, ix: &Index<'_>, v: &mut Violations) {
    let (r, tenant) = (input.r, input.tenant);
    let At {
        topic,
        partition: p,
        offset: o,
    } = input.at;
    let key = r
        .key
        .clone()
        .unwrap_or_else(|| format!("kafka:{topic}:{p}:{o}"));
    let pool = r.pool.as_deref().unwrap_or("default");
    let decided = ix.decision(tenant, pool, &key);
    match decided.map(|d| (d, ix.runs.get(d))) {
        None => v.add("lost_input", || {
            format!(
                "{}: no decision for ({tenant}, {pool}, {key})",
                input.what()
            )
        }),
        Some((d, None)) => v.add("lost_input", || {
            format!("{}: decision {d} is no run", input.what())
        }),
        Some((d, Some(run))) if run.tenant != tenant => v.add("tenant_crossing", || {
            format!("({tenant}, {key}) decided {d} of tenant {}", run.tenant)
        }),
        Some((d, Some(_))) => {
            // Requests with one key share a partition, in order: a
            // decision made from a later offset means this one was skipped.
            if let Some(o1) = ix.created_later(d, input.at) {
                v.add("lost_input", || {
                    format!(
                        "{}: ({tenant}, {key}) was decided at the later offset {o1}",
                        input.what()
                    )
                });
            }
        }
    }
}

/// The `run.accepted` announced for a routed request is in its tenant.
fn accepted_in_tenant(input: &Logged<'_>, accepted: &Accepted, v: &mut Violations) {
    let tenant = input.tenant;
    if let Some((run, t)) = input
        .r
        .corr
        .as_deref()
        .and_then(|c| accepted.by_corr.get(c))
        && t != tenant
    {
        v.add("tenant_crossing", || {
            format!("request of {tenant} accepted as {run} of {t}")
        });
    }
}

/// A signal or cancel was applied, unless its run had already stopped
/// taking inputs from its partition.
fn wakeup_kept(input: &Logged<'_>, ix: &Index<'_>, v: &mut Violations) {
    let run_id = input.run_id;
    let input_ref = input.r.input_ref.as_deref().unwrap_or("");
    if !ix.applied(run_id, input_ref) && ix.later_on_partition(run_id, input.at) {
        v.add("lost_input", || {
            format!(
                "{}: {run_id} took later inputs of the partition but not this one",
                input.what()
            )
        });
    }
}

/// A retry names a failure: it is applied unless that failure was retried
/// under another action id first, the run was cancelled, or the run failed
/// compensated (what it did is undone, and nothing is left to retry); an
/// unapplied one is lost when the run is still failed by the very failure
/// it names and not compensated. An applied one retried that failure and no
/// other.
fn retry_kept(input: &Logged<'_>, ix: &Index<'_>, v: &mut Violations) {
    let run_id = input.run_id;
    let input_ref = input.r.input_ref.as_deref().unwrap_or("");
    let Some(seq) = input.r.failed_seq else {
        return;
    };
    if let Some(t) = ix
        .transitions(run_id)
        .iter()
        .find(|t| t.input_ref == input_ref)
    {
        if t.detail.get("failed_seq").and_then(Value::as_i64) != Some(seq) {
            v.add("state_history_mismatch", || {
                format!(
                    "{}: applied to another failure than seq {seq}",
                    input.what()
                )
            });
        }
        return;
    }
    let still_failed_by_it = ix.runs.get(run_id).is_some_and(|run| {
        serde_json::from_value::<ductor::coordinator::RunState>(run.state.clone())
            .is_ok_and(|state| state.failure_seq() == Some(seq) && !state.is_compensated())
    });
    if still_failed_by_it {
        v.add("lost_input", || {
            format!("{}: {run_id} is still failed by seq {seq}", input.what())
        });
    }
}

/// A worker's answer was applied while its attempt was outstanding: an
/// unapplied one is lost when the attempt is still dispatched, or when a
/// later message of its partition was applied before the attempt ended
/// another way.
fn result_kept(input: &Logged<'_>, ix: &Index<'_>, v: &mut Violations) {
    let run_id = input.run_id;
    let stamp = result_stamp(input.r).and_then(|s| Uuid::parse_str(s).ok());
    let input_ref = input.r.input_ref.as_deref().unwrap_or("");
    let attempt = stamp.and_then(|s| ix.attempt_by_stamp.get(&s));
    let Some(a) = attempt.filter(|_| !ix.applied(run_id, input_ref)) else {
        return;
    };
    let ended_at = a.status != "dispatched";
    let ended_seq = ended_seq(ix.transitions(run_id), a);
    // A later message of this partition was applied while the attempt was
    // still outstanding: this result came by first and should have been
    // applied.
    let passed_over = ix.transitions(run_id).iter().any(|t| {
        input.at.is_before(t.source.as_ref())
            && ended_seq.is_some_and(|e| t.seq < e)
            && ix.attempt_dispatched_before(run_id, a.stamp, t.seq)
    });
    if !ended_at || passed_over {
        v.add("lost_input", || {
            format!(
                "{}: not applied while its attempt was outstanding",
                input.what()
            )
        });
    }
}

/// The seq at which an attempt stopped being outstanding for another
/// reason than its result (timeout, cancel, or another branch's failure).
fn ended_seq(transitions: &[TransitionRow], a: &AttemptRow) -> Option<i64> {
    transitions
        .iter()
        .find(|t| {
            t.input_ref == format!("timer:timeout:{}", a.stamp)
                || (t.kind == "run.cancelled"
                    && t.detail.get("stamp").and_then(Value::as_str)
                        == Some(a.stamp.to_string().as_str()))
                || history::cancels(t, a.stamp)
        })
        .map(|t| t.seq)
}

/// The runs HTTP answers named, by (tenant, pool, idempotency key).
type Answers<'r> = BTreeMap<(&'r str, &'r str, &'r str), BTreeSet<&'r str>>;

/// HTTP: one decision per key, in the right tenant, that exists. Returns
/// how many requests got an answer.
fn http_answers(records: &[Record], ix: &Index<'_>, v: &mut Violations) -> u64 {
    let mut inputs = 0u64;
    let mut answers: Answers<'_> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ev == log::EV_HTTP) {
        if r.status.is_some() {
            inputs += 1;
        }
        if !r.acked {
            continue;
        }
        if let Some((key, run_id)) = http_answer(r, ix, v) {
            answers.entry(key).or_default().insert(run_id);
        }
    }
    answers_agree(&answers, ix, v);
    inputs
}

/// A 2xx answer names a run of the request's tenant, and only to a good
/// request; its (tenant, pool, key) and run, when it had a key.
fn http_answer<'r>(
    r: &'r Record,
    ix: &Index<'_>,
    v: &mut Violations,
) -> Option<((&'r str, &'r str, &'r str), &'r str)> {
    let tenant = r.tenant.as_deref().unwrap_or("");
    let pool = r.pool.as_deref().unwrap_or("default");
    let Some(run_id) = r.answer_run_id.as_deref() else {
        v.add("lost_input", || "a 2xx answer without a run id".into());
        return None;
    };
    if !r.good {
        v.add("bad_input_accepted", || {
            format!(
                "key {:?} reused for another request was answered {:?} with {run_id}",
                r.key, r.status
            )
        });
        return None;
    }
    if r.answer_tenant.as_deref() != Some(tenant) {
        v.add("tenant_crossing", || {
            format!(
                "HTTP request of {tenant} answered with tenant {:?}",
                r.answer_tenant
            )
        });
    }
    match ix.runs.get(run_id) {
        None => v.add("lost_input", || {
            format!("HTTP {:?} answered {run_id}, which is no run", r.status)
        }),
        Some(run) if run.tenant != tenant => v.add("tenant_crossing", || {
            format!(
                "HTTP request of {tenant} answered with {run_id} of {}",
                run.tenant
            )
        }),
        Some(_) => {}
    }
    let key = r.key.as_deref()?;
    Some(((tenant, pool, key), run_id))
}

/// Every answer for one key named the same run, the one its routing row
/// decided.
fn answers_agree(answers: &Answers<'_>, ix: &Index<'_>, v: &mut Violations) {
    for ((tenant, pool, key), ids) in answers {
        if ids.len() > 1 {
            v.add("duplicate_decision", || {
                format!("({tenant}, {pool}, {key}) answered with {ids:?}")
            });
        }
        match ix.decision(tenant, pool, key) {
            Some(d) if ids.iter().all(|id| *id == d) => {}
            Some(d) => v.add("duplicate_decision", || {
                format!("({tenant}, {pool}, {key}) answered {ids:?}, decided {d}")
            }),
            None => v.add("lost_input", || {
                format!("({tenant}, {pool}, {key}) answered {ids:?} but has no completed decision")
            }),
        }
    }
}

#[cfg(test)]
#[allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]
mod tests {
    use super::*;

    fn msg(topic: &str, offset: i64, key: &str, payload: &[u8], headers: &[(&str, &str)]) -> Msg {
        Msg {
            topic: topic.into(),
            partition: 0,
            offset,
            key: Some(key.as_bytes().to_vec()),
            payload: payload.to_vec(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                .collect(),
            timestamp_ms: None,
        }
    }

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn transition(seq: i64) -> TransitionRow {
        TransitionRow {
            run_id: "r1".into(),
            seq,
            input_ref: format!("signal:{seq}"),
            kind: "run.signalled".into(),
            from_status: Some("running".into()),
            to_status: "running".into(),
            step_index: 0,
            detail: Value::Null,
            source: None,
            created_at: at(),
        }
    }

    fn intent(key: &str, seq: i64, payload: &[u8], headers: Value) -> IntentRow {
        IntentRow {
            run_id: "r1".into(),
            seq,
            effect_index: 0,
            key: key.into(),
            tenant: "acme".into(),
            topic: "ductor.events".into(),
            message_key: b"r1".to_vec(),
            headers,
            payload: payload.to_vec(),
            ce_type: "ductor.run.event".into(),
            not_before: at(),
            due_at: at(),
            status: "completed".into(),
        }
    }

    /// The outbox, DLQ and decision checks, on hand-made data: each planted
    /// fault is reported under its kind, and nothing else is.
    #[test]
    fn planted_faults_are_reported_by_kind() {
        let config = Config::load_from(None, Vec::<(String, String)>::new()).unwrap();
        let h = |k: &str, s: &str| serde_json::json!({"idempotency-key": k, "ductor-run-id": "r1", "ductor-seq": s, "ductor-tenant": "acme"});
        let db = DbSnapshot {
            intents: vec![
                intent("r1/1/0", 1, b"{\"a\":1}", h("r1/1/0", "1")),
                intent("r1/2/0", 2, b"{\"a\":2}", h("r1/2/0", "2")),
                intent("r1/3/0", 3, b"{\"a\":3}", h("r1/3/0", "3")),
            ],
            transitions: (1..=3).map(transition).collect(),
            routing: vec![RoutingRow {
                tenant: "acme".into(),
                pool: "default".into(),
                key: "k1".into(),
                status: "completed".into(),
                decision_id: Some("nope".into()),
            }],
            ..DbSnapshot::default()
        };
        let hs = |k: &'static str, s: &'static str| {
            vec![
                ("idempotency-key", k),
                ("ductor-run-id", "r1"),
                ("ductor-seq", s),
                ("ductor-tenant", "acme"),
            ]
        };
        let msgs = vec![
            // r1/1/0 twice, the second copy with other bytes.
            msg("ductor.events", 0, "r1", b"{\"a\":1}", &hs("r1/1/0", "1")),
            msg("ductor.events", 1, "r1", b"{\"a\":9}", &hs("r1/1/0", "1")),
            // r1/3/0 before r1/2/0: out of order. r1/2/0 in another tenant.
            msg("ductor.events", 2, "r1", b"{\"a\":3}", &hs("r1/3/0", "3")),
            msg(
                "ductor.events",
                3,
                "r1",
                b"{\"a\":2,\"tenant\":\"globex\"}",
                &hs("r1/2/0", "2"),
            ),
            // An effect no committed intent backs.
            msg("ductor.events", 4, "r1", b"{}", &hs("r1/7/0", "7")),
            // A dead letter for a good input.
            msg(
                "ductor.dlq",
                0,
                "x",
                b"{}",
                &[
                    ("ductor-dlq-topic", "ductor.wakeups"),
                    ("ductor-dlq-partition", "0"),
                    ("ductor-dlq-offset", "5"),
                ],
            ),
        ];
        let input = |offset: i64, good: bool| Record {
            ev: log::EV_INPUT.into(),
            kind: Some(
                if good {
                    log::KIND_SIGNAL
                } else {
                    log::KIND_BAD
                }
                .into(),
            ),
            good,
            acked: true,
            run_id: Some("r1".into()),
            tenant: Some("acme".into()),
            input_ref: Some("signal:s1".into()),
            topic: Some("ductor.wakeups".into()),
            partition: Some(0),
            offset: Some(offset),
            ..Record::default()
        };
        let answer = |run: &str| Record {
            ev: log::EV_HTTP.into(),
            kind: Some(log::KIND_ROUTED.into()),
            good: true,
            acked: true,
            tenant: Some("acme".into()),
            pool: Some("default".into()),
            key: Some("k1".into()),
            status: Some(200),
            answer_run_id: Some(run.into()),
            answer_tenant: Some("acme".into()),
            ..Record::default()
        };
        let records = vec![input(5, true), input(6, false), answer("ra"), answer("rb")];
        let mut v = Violations::default();
        let report = analyse(
            &Inputs {
                records: &records,
                db: &db,
                msgs: &msgs,
                settle_at: Utc::now(),
                config: &config,
                workflows: &Workflows::default(),
                deaths_ms: &[],
            },
            &mut v,
        );
        let kinds: Vec<&str> = report.violations.keys().map(String::as_str).collect();
        assert_eq!(
            kinds,
            [
                "bad_input_not_dead_lettered",
                "dangling_decision",
                "duplicate_decision",
                "duplicate_differs",
                "effect_differs_from_intent",
                "effect_order",
                "effect_without_intent",
                "good_input_dead_lettered",
                "lost_input",
                "state_history_mismatch",
                "tenant_crossing",
            ],
            "{:#?}",
            report.examples
        );
        assert_eq!(report.duplicate_deliveries, 1);
    }

    /// Only a run whose last attempt timed out although its answer was in
    /// before the deadline, and not sent late on purpose, is reported.
    #[test]
    fn a_run_failed_by_a_timeout_its_worker_beat_is_reported() {
        let deadline = at();
        let ms = deadline.timestamp_millis();
        let mut db = DbSnapshot::default();
        let mut records = Vec::new();
        for (run, answered_ms, note) in [
            ("prompt", ms - 500, None),
            ("late", ms - 500, Some("late")),
            ("after", ms + 500, None),
        ] {
            let stamp = Uuid::new_v4();
            db.transitions.push(TransitionRow {
                run_id: run.into(),
                kind: "run.failed".into(),
                to_status: "failed".into(),
                detail: serde_json::json!({"cause": "attempts_exhausted", "stamp": stamp}),
                ..transition(9)
            });
            db.attempts.push(AttemptRow {
                stamp,
                run_id: run.into(),
                step_index: 0,
                attempt: 6,
                status: "timed_out".into(),
                dispatched_at: deadline - chrono::Duration::seconds(1),
                deadline,
                finished_at: Some(deadline),
                error: None,
            });
            records.push(Record {
                ev: log::EV_INPUT.into(),
                t_ms: answered_ms,
                kind: Some(log::KIND_RESULT.into()),
                good: true,
                acked: true,
                run_id: Some(run.into()),
                input_ref: Some(format!("result:{stamp}")),
                note: note.map(Into::into),
                ..Record::default()
            });
        }
        let by_stamp: HashMap<Uuid, &AttemptRow> =
            db.attempts.iter().map(|a| (a.stamp, a)).collect();
        let mut v = Violations::default();
        timeouts_not_slow(&records, &db, &by_stamp, &mut v);
        assert_eq!(
            v.counts.get("failed_by_timeout_not_slow"),
            Some(&1),
            "{v:?}"
        );
        assert_eq!(v.total(), 1);
        let examples = &v.examples["failed_by_timeout_not_slow"];
        assert!(examples[0].starts_with("prompt:"), "{examples:?}");
    }

    /// An unapplied retry of a run still failed by the failure it names is
    /// lost, unless the run failed compensated: nothing is left to retry.
    #[test]
    fn an_unapplied_retry_is_lost_unless_its_run_was_compensated() {
        let failed = |run: &str, compensated: bool| {
            let mut state = serde_json::json!({
                "v": 6, "run_id": run, "tenant": "acme", "pool": "default",
                "workflow": "wf", "workflow_version": 1, "status": "failed",
                "step_index": 1, "attempt": 1, "input": {}, "output": null,
                "outstanding": null, "pending_retry": null, "attempts": [], "signals": [],
                "correlation_id": null, "error": "declined", "record_version": 4,
                "last_transition_seq": 4, "failed_seq": 4,
                "created_at": "2026-12-07T10:00:00Z", "updated_at": "2026-12-07T10:00:01Z",
            });
            if compensated {
                state["compensating"] = serde_json::json!({
                    "failed_step": 1, "cause": "not_retryable", "error": "declined",
                });
            }
            RunRow {
                run_id: run.into(),
                tenant: "acme".into(),
                pool: "default".into(),
                workflow: "wf".into(),
                workflow_version: 1,
                status: "failed".into(),
                record_version: 4,
                last_transition_seq: 4,
                state,
                finished: true,
            }
        };
        let db = DbSnapshot {
            runs: vec![failed("plain", false), failed("undone", true)],
            ..DbSnapshot::default()
        };
        let ix = Index::of(&db);
        let mut v = Violations::default();
        for (offset, run) in [(1, "plain"), (2, "undone")] {
            let record = Record {
                ev: log::EV_INPUT.into(),
                kind: Some(log::KIND_RETRY.into()),
                good: true,
                acked: true,
                run_id: Some(run.into()),
                tenant: Some("acme".into()),
                input_ref: Some(format!("retry:a-{run}")),
                topic: Some("wakeups".into()),
                partition: Some(0),
                offset: Some(offset),
                failed_seq: Some(4),
                ..Record::default()
            };
            retry_kept(&Logged::of(&record).unwrap(), &ix, &mut v);
        }
        assert_eq!(v.total(), 1, "{v:?}");
        let examples = &v.examples["lost_input"];
        assert!(
            examples[0].contains("plain is still failed"),
            "{examples:?}"
        );
    }

    /// A stalled-lanes reading the load driver logged is a violation.
    #[test]
    fn a_stalled_lane_is_reported() {
        let config = Config::load_from(None, Vec::<(String, String)>::new()).unwrap();
        let records = vec![Record {
            ev: log::EV_STALL.into(),
            t_ms: 1,
            server: Some("127.0.0.1:1".into()),
            note: Some("1 lanes stalled".into()),
            ..Record::default()
        }];
        let mut v = Violations::default();
        let report = analyse(
            &Inputs {
                records: &records,
                db: &DbSnapshot::default(),
                msgs: &[],
                settle_at: Utc::now(),
                config: &config,
                workflows: &Workflows::default(),
                deaths_ms: &[],
            },
            &mut v,
        );
        let kinds: Vec<&str> = report.violations.keys().map(String::as_str).collect();
        assert_eq!(kinds, ["lane_stalled"], "{:#?}", report.examples);
    }
}
