//! Baselines B1a and B1b: Ductor's SQL footprint per input, without Kafka,
//! the fold or any of Ductor's code around it.
//!
//! A "typical input" is an attempt result in the middle of a run: load the
//! run, then the apply stage's own batch statement, bound by its own
//! `apply::batch::BatchWrite` (it commits on its own as it does for every
//! batch without a routed request: the `UPDATE runs` conditional on `record_version`, the
//! transition, the next attempt, the finished one, the cancel of its timeout
//! timer, and the three effect intents: event, dispatch, timeout timer, the
//! two due ones claimed at insert as `ductor serve`'s fast lane does); then
//! the drainer's share, `outbox::COMPLETE_SQL` of the two published intents
//! in its own transaction. Row contents and sizes come from the real fold.
//! B1a applies one input per transaction, B1b `k` inputs per transaction
//! through the same set-based statement.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::{Connection, Row};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::env::{BenchEnv, WORKFLOW};
use super::stats::{CpuCores, CpuTicks, Progress};
use ductor::contract::{AttemptOutcome, AttemptResult, Input, RunStart};
use ductor::coordinator::{Decision, Entropy, Transition, Workflows, fold};
use ductor::harness::BatchWrite;

/// Runs seeded at least, so tables and indexes have a realistic size.
const MIN_SEEDED_RUNS: usize = 2_000;
/// Rows per seeding statement.
const SEED_CHUNK: usize = 1_000;
/// One client iteration may not take longer than this.
const ITERATION_TIMEOUT: Duration = Duration::from_secs(60);
/// Lease of a claim taken at insert, as the drainer's default.
const LEASE_S: f64 = 90.0;

/// Throughput of one (clients, k) configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub clients: usize,
    pub k: usize,
    pub inputs_per_s: f64,
    pub profile: PointProfile,
}

#[derive(Debug, Clone, Serialize)]
pub struct PointProfile {
    pub cpu_cores: CpuCores,
    /// Mean milliseconds per iteration (the load and the batch statement of
    /// `k` inputs, and the drainer's completion), by statement.
    pub statement_ms: BTreeMap<&'static str, f64>,
}

/// Row contents taken from the real fold, reused for every input.
struct Template {
    state: String,
    detail: String,
    /// (topic, ce_type, payload, due now?) of the three intents.
    effects: Vec<(String, String, Vec<u8>, bool)>,
    headers: String,
}

impl Template {
    /// Folds a start and the first step's result of the bench workflow and
    /// keeps the second transition's rows: a mid-run state, its transition
    /// detail, and its event, dispatch and timer intents.
    fn from_fold(env: &BenchEnv) -> anyhow::Result<Template> {
        let workflows = ductor::infra::workflows::load_dir(&env.workflows_dir())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let now = Utc::now();
        let run_id = "b1-template-run".to_string();
        let config = env.pipeline_config("b1");
        let second =
            mid_run_transition(&workflows, &run_id, config.coordinator.max_state_bytes, now)?;
        let topics = ductor::contract::TopicNames {
            prefix: config.kafka.topic_prefix,
        };
        let effects = second
            .effects
            .iter()
            .map(|e| {
                Ok((
                    e.target.topic(&topics),
                    e.kind.ce_type().to_owned(),
                    serde_json::to_vec(&e.payload)?,
                    e.not_before.is_none(),
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(effects.len() == 3, "expected event, dispatch and timer");
        Ok(Template {
            state: serde_json::to_string(&second.state)?,
            detail: serde_json::to_string(&second.record.detail)?,
            effects,
            headers: event_headers(&run_id, now).to_string(),
        })
    }
}

/// The second transition of run `run_id` of the bench workflow, as the
/// real fold makes it: the start, then the first step's result.
fn mid_run_transition(
    workflows: &Workflows,
    run_id: &str,
    max_state_bytes: usize,
    now: DateTime<Utc>,
) -> anyhow::Result<Transition> {
    let request: Value = serde_json::from_str(&super::pipeline::start_request(run_id, 1))?;
    let start = Input::Start(RunStart {
        run_id: run_id.to_string(),
        tenant: "bench".into(),
        workflow: WORKFLOW.into(),
        workflow_version: None,
        pool: "default".into(),
        input: request["input"].clone(),
        correlation_id: None,
        parent: None,
    });
    let first = transition(fold(
        None,
        &start,
        workflows,
        max_state_bytes,
        now,
        &entropy(),
    ))?;
    let stamp = first
        .state
        .outstanding
        .as_ref()
        .context("the start dispatched no attempt")?
        .stamp;
    let result = Input::Result(AttemptResult {
        run_id: run_id.to_string(),
        tenant: "bench".into(),
        stamp,
        outcome: AttemptOutcome::Succeeded {
            output: request["input"].clone(),
        },
    });
    transition(fold(
        Some(&first.state),
        &result,
        workflows,
        max_state_bytes,
        now,
        &entropy(),
    ))
}

/// Ductor's headers of the template run's event, as the drainer writes
/// them with every intent.
fn event_headers(run_id: &str, now: DateTime<Utc>) -> Value {
    let key = ductor::contract::idempotency_key(run_id, 2, 0);
    json!({
        "idempotency-key": key, "ductor-run-id": run_id, "ductor-seq": "2",
        "ductor-tenant": "bench", "ce_specversion": "1.0", "ce_id": key,
        "ce_source": format!("/ductor/workflows/{WORKFLOW}/v1"),
        "ce_type": ductor::contract::EffectKind::RunEvent.ce_type(),
        "ce_time": now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "ce_subject": run_id, "content-type": "application/json",
    })
}

fn entropy() -> Entropy {
    Entropy {
        stamp: Uuid::new_v4(),
        jitter_unit: 0.5,
    }
}

fn transition(decision: Decision) -> anyhow::Result<Transition> {
    match decision {
        Decision::Transition(t) => Ok(*t),
        other => anyhow::bail!("the bench workflow did not transition: {other:?}"),
    }
}

/// What each iteration spends its time on, in the order the statements run.
pub const STATEMENTS: [&str; 3] = ["load", "write", "drainer_complete"];

/// Time per statement, summed over iterations.
#[derive(Debug, Clone, Default)]
struct Laps {
    seconds: [f64; STATEMENTS.len()],
    iterations: u64,
}

/// Marks the end of one statement of an iteration.
struct Lap<'a> {
    laps: &'a mut Laps,
    last: Instant,
}

impl Lap<'_> {
    fn mark(&mut self, statement: usize) {
        let now = Instant::now();
        self.laps.seconds[statement] += now.duration_since(self.last).as_secs_f64();
        self.last = now;
    }
}

/// One run owned by a client: its current version and outstanding stamp.
struct Slot {
    run_id: String,
    version: i64,
    stamp: Uuid,
}

/// Measures every `(clients, k)` of the grid for `per_point` each.
pub async fn grid(
    env: &BenchEnv,
    clients: &[usize],
    ks: &[usize],
    per_point: Duration,
    label: &str,
    progress: &mut Progress,
) -> anyhow::Result<Vec<Point>> {
    let template = Arc::new(Template::from_fold(env)?);
    let mut points = Vec::new();
    for &k in ks {
        for &c in clients {
            progress.update(&format!("{label}: {c} clients, {k} inputs per transaction"));
            let (inputs_per_s, cpu_cores, statement_ms) =
                point(env, &template, c, k, per_point).await?;
            progress.done(&format!(
                "{label}: {c} clients x {k} inputs/tx: {inputs_per_s:.0} inputs/s \
                 (cores: postgres {:.2}, client {:.2})",
                cpu_cores.postgres, cpu_cores.ductor
            ));
            points.push(Point {
                clients: c,
                k,
                inputs_per_s,
                profile: PointProfile {
                    cpu_cores,
                    statement_ms,
                },
            });
        }
    }
    Ok(points)
}

async fn point(
    env: &BenchEnv,
    template: &Arc<Template>,
    clients: usize,
    k: usize,
    duration: Duration,
) -> anyhow::Result<(f64, CpuCores, BTreeMap<&'static str, f64>)> {
    env.truncate().await?;
    let per_client = (2 * k).max(MIN_SEEDED_RUNS.div_ceil(clients));
    let mut slots: Vec<Vec<Slot>> = Vec::with_capacity(clients);
    for c in 0..clients {
        slots.push(seed(env, template, c, per_client).await?);
    }
    env.analyze().await?;
    let pool = PgPoolOptions::new()
        .max_connections(clients as u32)
        .connect_with(super::env::connect_options(&env.base)?)
        .await
        .context("connecting the baseline clients")?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    let cpu_before = CpuTicks::sample(&env.cpu);
    for (c, slots) in slots.into_iter().enumerate() {
        let mut conn = pool
            .acquire()
            .await
            .context("acquiring a baseline connection")?
            .detach();
        let (template, done, stop) = (template.clone(), done.clone(), stop.clone());
        let claimer = format!("bench-b1-{c}");
        tasks.spawn(async move {
            let laps = client(&mut conn, &template, slots, k, &claimer, &done, &stop).await?;
            // Closed only after the CPU sample, so the backends' time counts.
            anyhow::Ok((Instant::now(), laps, conn))
        });
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut ended = started;
    let mut laps = Laps::default();
    let mut connections = Vec::with_capacity(clients);
    while let Some(joined) = tasks.join_next().await {
        let (end, client_laps, conn) = joined.context("a baseline client panicked")??;
        connections.push(conn);
        ended = ended.max(end);
        laps.iterations += client_laps.iterations;
        for (sum, s) in laps.seconds.iter_mut().zip(client_laps.seconds) {
            *sum += s;
        }
    }
    let statement_ms = STATEMENTS
        .iter()
        .zip(laps.seconds)
        .map(|(name, s)| (*name, 1000.0 * s / laps.iterations.max(1) as f64))
        .collect();
    let cpu = cpu_before.cores_until(&CpuTicks::sample(&env.cpu));
    for conn in connections {
        conn.close().await.ok();
    }
    pool.close().await;
    let seconds = ended.duration_since(started).as_secs_f64();
    Ok((
        done.load(Ordering::Relaxed) as f64 / seconds,
        cpu,
        statement_ms,
    ))
}

/// Inserts `n` runs of client `c`, each after its start: state, the start
/// transition and the dispatched first attempt.
async fn seed(
    env: &BenchEnv,
    template: &Template,
    c: usize,
    n: usize,
) -> anyhow::Result<Vec<Slot>> {
    let now = Utc::now();
    let slots: Vec<Slot> = (0..n)
        .map(|i| Slot {
            run_id: format!("b1-{c}-{i}"),
            version: 1,
            stamp: Uuid::new_v4(),
        })
        .collect();
    for chunk in slots.chunks(SEED_CHUNK) {
        let ids: Vec<&str> = chunk.iter().map(|s| s.run_id.as_str()).collect();
        let stamps: Vec<Uuid> = chunk.iter().map(|s| s.stamp).collect();
        let chunk = SeedChunk {
            env,
            ids: &ids,
            now,
        };
        chunk
            .insert(
                "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, \
                     status, record_version, last_transition_seq, state, created_at, updated_at) \
                 SELECT u.id, 'bench', 'default', $2, 1, 'running', 1, 1, $3::jsonb, $4, $4 \
                 FROM UNNEST($1::text[]) AS u(id)",
                |q| q.bind(WORKFLOW).bind(&template.state),
                "seeding runs",
            )
            .await?;
        chunk
            .insert(
                "INSERT INTO run_transitions (run_id, seq, input_ref, kind, to_status, step_index, detail, created_at) \
                 SELECT u.id, 1, 'start', 'run.started', 'running', 0, $2::jsonb, $3 \
                 FROM UNNEST($1::text[]) AS u(id)",
                |q| q.bind(&template.detail),
                "seeding transitions",
            )
            .await?;
        chunk
            .insert(
                "INSERT INTO run_attempts (stamp, run_id, step_index, attempt, status, dispatched_at, deadline) \
                 SELECT u.stamp, u.id, 0, 1, 'dispatched', $3, $3 + interval '1 hour' \
                 FROM UNNEST($1::text[], $2::uuid[]) AS u(id, stamp)",
                |q| q.bind(&stamps),
                "seeding attempts",
            )
            .await?;
    }
    Ok(slots)
}

/// A statement of [`sqlx::query`] being bound.
type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// One chunk of seeded runs: every seeding statement takes the chunk's run
/// ids first (`$1`) and the seeding time last.
struct SeedChunk<'a> {
    env: &'a BenchEnv,
    ids: &'a [&'a str],
    now: DateTime<Utc>,
}

impl<'a> SeedChunk<'a> {
    /// Inserts the chunk's rows with `sql`, its own columns bound by
    /// `columns` between the ids and the time; `what` names it in an error.
    async fn insert(
        &self,
        sql: &'a str,
        columns: impl FnOnce(Query<'a>) -> Query<'a>,
        what: &'static str,
    ) -> anyhow::Result<()> {
        columns(sqlx::query(sql).bind(self.ids))
            .bind(self.now)
            .execute(&self.env.pool)
            .await
            .context(what)?;
        Ok(())
    }
}

/// One client: batches of `k` inputs on its own runs, round robin, until
/// `stop`; the drainer's completion after each batch.
async fn client(
    conn: &mut PgConnection,
    template: &Template,
    mut slots: Vec<Slot>,
    k: usize,
    claimer: &str,
    done: &AtomicU64,
    stop: &AtomicBool,
) -> anyhow::Result<Laps> {
    let mut cursor = 0;
    let mut laps = Laps::default();
    while !stop.load(Ordering::Relaxed) {
        let batch: Vec<usize> = (0..k).map(|j| (cursor + j) % slots.len()).collect();
        cursor = (cursor + k) % slots.len();
        tokio::time::timeout(
            ITERATION_TIMEOUT,
            iteration(conn, template, &mut slots, &batch, claimer, &mut laps),
        )
        .await
        .context("a baseline iteration timed out")??;
        laps.iterations += 1;
        done.fetch_add(k as u64, Ordering::Relaxed);
    }
    Ok(laps)
}

/// One iteration of a client: load the batch's runs, apply one input to
/// each in one batch statement, complete the published intents as the
/// drainer does, and move each run on to its new version and attempt.
async fn iteration(
    conn: &mut PgConnection,
    t: &Template,
    slots: &mut [Slot],
    batch: &[usize],
    claimer: &str,
    laps: &mut Laps,
) -> anyhow::Result<()> {
    let now: DateTime<Utc> = Utc::now();
    let inputs = BatchInputs::of(slots, batch);

    let mut lap = Lap {
        laps,
        last: Instant::now(),
    };
    load_runs(conn, &inputs.ids).await?;
    lap.mark(0);

    let claimed_ids = write_batch(conn, t, &inputs, claimer, now).await?;
    lap.mark(1);

    // The drainer's share: mark the published intents completed.
    sqlx::query(ductor::harness::COMPLETE_SQL)
        .bind(&claimed_ids)
        .bind(claimer)
        .execute(&mut *conn)
        .await?;
    lap.mark(2);

    for (j, &i) in batch.iter().enumerate() {
        slots[i].version = inputs.seqs[j];
        slots[i].stamp = inputs.new_stamps[j];
    }
    Ok(())
}

/// The runs of one batch and what their next input changes: each run's
/// current version and outstanding attempt, and the transition seq and
/// attempt stamp the input gives it.
struct BatchInputs {
    ids: Vec<String>,
    versions: Vec<i64>,
    old_stamps: Vec<Uuid>,
    new_stamps: Vec<Uuid>,
    seqs: Vec<i64>,
}

impl BatchInputs {
    fn of(slots: &[Slot], batch: &[usize]) -> BatchInputs {
        let k = batch.len();
        let ids: Vec<String> = batch.iter().map(|&i| slots[i].run_id.clone()).collect();
        let versions: Vec<i64> = batch.iter().map(|&i| slots[i].version).collect();
        let old_stamps: Vec<Uuid> = batch.iter().map(|&i| slots[i].stamp).collect();
        let new_stamps: Vec<Uuid> = (0..k).map(|_| Uuid::new_v4()).collect();
        let seqs: Vec<i64> = versions.iter().map(|v| v + 1).collect();
        BatchInputs {
            ids,
            versions,
            old_stamps,
            new_stamps,
            seqs,
        }
    }
}

/// The apply path's load of a batch's runs.
async fn load_runs(conn: &mut PgConnection, ids: &[String]) -> anyhow::Result<()> {
    let k = ids.len();
    let rows = sqlx::query("SELECT run_id, record_version, state FROM runs WHERE run_id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?;
    anyhow::ensure!(rows.len() == k, "loaded {} of {k} runs", rows.len());
    Ok(())
}

/// The apply path's batch statement, [`ductor::apply::batch::WRITE_BATCH_SQL`],
/// for one input to each run of `inputs`: no inserted runs, the
/// conditional updates, the history and the effects. Returns the ids of
/// the intents claimed at insert, for the drainer's completion.
async fn write_batch(
    conn: &mut PgConnection,
    t: &Template,
    inputs: &BatchInputs,
    claimer: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<i64>> {
    let k = inputs.ids.len();
    let refs: Vec<String> = inputs
        .old_stamps
        .iter()
        .map(|s| format!("result:{s}"))
        .collect();
    let positions = intent_positions(t, inputs);
    let mut write = BatchWrite {
        claimer: Some(claimer),
        lease_s: LEASE_S,
        // Updated runs, transitions, attempts inserted and finished: one
        // each per input. A shortfall fails the statement.
        expected: Some(vec![0, k as i64, k as i64, k as i64, k as i64]),
        ..BatchWrite::default()
    };
    runs_and_history(&mut write, t, inputs, &refs, now);
    intents(&mut write, t, inputs, &positions, now);
    let row = write.query().fetch_one(&mut *conn).await?;
    Ok(row.try_get("claimed_ids")?)
}

/// The idempotency key of every intent of the batch, and the cancel key of
/// its timers (a timer carries one, like a step's timeout timer).
struct IntentPositions {
    keys: Vec<String>,
    cancel_keys: Vec<Option<String>>,
}

fn intent_positions(t: &Template, inputs: &BatchInputs) -> IntentPositions {
    let mut positions = IntentPositions {
        keys: Vec::new(),
        cancel_keys: Vec::new(),
    };
    for (j, id) in inputs.ids.iter().enumerate() {
        for (index, (_, _, _, due_now)) in t.effects.iter().enumerate() {
            let key = ductor::contract::idempotency_key(id, inputs.seqs[j], index);
            positions.keys.push(key);
            let stamp = inputs.new_stamps[j].to_string();
            let cancel = (!*due_now).then(|| ductor::contract::timeout_cancel_key(&stamp));
            positions.cancel_keys.push(cancel);
        }
    }
    positions
}

/// Each input's run updated at its version, its transition, the next
/// attempt, the finished one and the cancel of that one's timer.
fn runs_and_history<'a>(
    write: &mut BatchWrite<'a>,
    t: &'a Template,
    inputs: &'a BatchInputs,
    refs: &'a [String],
    now: DateTime<Utc>,
) {
    let k = inputs.ids.len();
    let later = now + chrono::Duration::hours(1);
    let ids: Vec<&str> = inputs.ids.iter().map(String::as_str).collect();
    let u = &mut write.updates;
    u.run_id.clone_from(&ids);
    u.expected_version.clone_from(&inputs.versions);
    u.status = vec!["running"; k];
    u.seq.clone_from(&inputs.seqs);
    u.state = vec![t.state.clone(); k];
    u.updated_at = vec![now; k];
    u.finished_at = vec![None; k];
    let h = &mut write.transitions;
    h.run_id.clone_from(&ids);
    h.seq.clone_from(&inputs.seqs);
    h.input_ref = refs.iter().map(String::as_str).collect();
    h.kind = vec!["step.succeeded"; k];
    h.from_status = vec![Some("running"); k];
    h.to_status = vec!["running"; k];
    h.step_index = inputs.seqs.iter().map(|s| (*s - 1) as i32).collect();
    h.detail = vec![t.detail.as_str(); k];
    h.source_topic = vec![Some("bench.attempt-results"); k];
    h.source_partition = vec![Some(0); k];
    h.source_offset = inputs.seqs.iter().map(|s| Some(*s)).collect();
    h.at = vec![now; k];
    let a = &mut write.attempts;
    a.stamp.clone_from(&inputs.new_stamps);
    a.run_id = ids;
    a.step_index = inputs.versions.iter().map(|v| *v as i32).collect();
    a.attempt = vec![1; k];
    a.status = vec!["dispatched"; k];
    a.dispatched_at = vec![now; k];
    a.deadline = vec![later; k];
    a.finished_at = vec![None; k];
    a.error = vec![None; k];
    let f = &mut write.finishes;
    f.stamp.clone_from(&inputs.old_stamps);
    f.status = vec!["succeeded"; k];
    f.finished_at = vec![now; k];
    f.error = vec![None; k];
    write.cancel_keys = inputs
        .old_stamps
        .iter()
        .map(|s| ductor::contract::timeout_cancel_key(&s.to_string()))
        .collect();
}

/// The three intents of each input: event and dispatch due now (claimed at
/// insert for the fast lane), the timeout timer in an hour.
fn intents<'a>(
    write: &mut BatchWrite<'a>,
    t: &'a Template,
    inputs: &'a BatchInputs,
    positions: &'a IntentPositions,
    now: DateTime<Utc>,
) {
    let c = &mut write.intents;
    let mut n = 0;
    for (j, id) in inputs.ids.iter().enumerate() {
        for (index, (topic, ce_type, payload, due_now)) in t.effects.iter().enumerate() {
            c.run_id.push(id);
            c.seq.push(inputs.seqs[j]);
            c.effect_index.push(index as i32);
            c.key.push(&positions.keys[n]);
            c.tenant.push("bench");
            c.topic.push(topic);
            c.message_key.push(id.as_bytes());
            c.headers.push(t.headers.clone());
            c.payload.push(payload);
            c.ce_type.push(ce_type);
            c.not_before.push(if *due_now {
                now
            } else {
                now + chrono::Duration::hours(1)
            });
            c.cancel_key.push(positions.cancel_keys[n].as_deref());
            c.due.push(*due_now);
            n += 1;
        }
    }
}

/// The best point of a grid.
pub fn best(points: &[Point]) -> Option<Point> {
    points
        .iter()
        .max_by(|a, b| a.inputs_per_s.total_cmp(&b.inputs_per_s))
        .cloned()
}
