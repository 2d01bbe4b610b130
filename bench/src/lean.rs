//! Baseline B1-lean: the Postgres work a minimal exactly-once step
//! orchestrator must do per input, fixed and independent of Ductor's
//! schema, so that a heavier footprint of Ductor's cannot make its own
//! limit smaller and its ratio look better.
//!
//! In tables of its own (`lean_*`, created in the bench database), per
//! input: one `UPDATE` of a run row conditional on its version (a version,
//! a transition sequence and a state of about [`STATE_BYTES`] bytes), one
//! transition row, one attempt row and two outbox rows (an event and the
//! next dispatch, each with its idempotency key and a payload of about
//! [`PAYLOAD_BYTES`] bytes) inserted; set-based, [`INPUTS_PER_TX`] inputs
//! per transaction. Then the drainer's share of those inputs: one
//! set-based `DELETE` of [`DRAIN_PER_TX`] published outbox rows, claimed
//! with `FOR UPDATE SKIP LOCKED`, in a transaction of its own. Both
//! commit with the database's `synchronous_commit`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::env::BenchEnv;
use super::footprint::{Point, PointProfile};
use super::stats::{CpuTicks, Progress};

/// Inputs applied by one transaction.
pub const INPUTS_PER_TX: usize = 100;
/// Outbox rows each input writes: its event and its next dispatch.
const OUTBOX_PER_INPUT: usize = 2;
/// Published outbox rows the drainer deletes in one transaction: the
/// rows of one apply transaction.
pub const DRAIN_PER_TX: usize = INPUTS_PER_TX * OUTBOX_PER_INPUT;
/// Size of a run's state, bytes.
pub const STATE_BYTES: usize = 60;
/// Size of an outbox row's payload, bytes.
pub const PAYLOAD_BYTES: usize = 200;
/// Runs each client owns, so the run table and its index have a realistic
/// size and a run is not updated twice in a row.
const RUNS_PER_CLIENT: usize = 2_000;
/// One client iteration may not take longer than this.
const ITERATION_TIMEOUT: Duration = Duration::from_secs(60);

/// What each iteration spends its time on, in the order the statements run.
pub const STATEMENTS: [&str; 2] = ["apply", "drain"];

/// The lean tables: a narrow run row, the history, and the outbox.
const CREATE_SQL: &str = "
CREATE TABLE IF NOT EXISTS lean_runs (
    run_id bigint PRIMARY KEY,
    version bigint NOT NULL,
    last_seq bigint NOT NULL,
    state text NOT NULL
) WITH (fillfactor = 80);
CREATE TABLE IF NOT EXISTS lean_transitions (
    run_id bigint NOT NULL,
    seq bigint NOT NULL,
    kind text NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS lean_attempts (
    stamp uuid PRIMARY KEY,
    run_id bigint NOT NULL,
    seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS lean_outbox (
    id bigserial PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    payload text NOT NULL
);";

const TABLES: &str = "lean_runs, lean_transitions, lean_attempts, lean_outbox";

/// One input to each run of the batch: the run moves from its version to
/// the next only if no one else moved it, and its transition, attempt and
/// two outbox rows are written from the rows actually updated.
const APPLY_SQL: &str = "
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::uuid[])
        AS i(run_id, version, stamp)
), moved AS (
    UPDATE lean_runs r
       SET version = r.version + 1, last_seq = r.last_seq + 1, state = $4
      FROM input i
     WHERE r.run_id = i.run_id AND r.version = i.version
    RETURNING r.run_id, r.last_seq AS seq, i.stamp
), transitions AS (
    INSERT INTO lean_transitions (run_id, seq, kind)
    SELECT run_id, seq, 'step_succeeded' FROM moved
), attempts AS (
    INSERT INTO lean_attempts (stamp, run_id, seq)
    SELECT stamp, run_id, seq FROM moved
), outbox AS (
    INSERT INTO lean_outbox (idempotency_key, payload)
    SELECT m.run_id || ':' || m.seq || ':' || e.index, $5
      FROM moved m CROSS JOIN generate_series(0, 1) AS e(index)
)
SELECT count(*) FROM moved";

/// The drainer's completion of published rows, claimed without waiting on
/// another drainer's. The claim is materialised: as a subquery of the
/// `DELETE`, the planner may run it more than once, and each run skips
/// other rows, so one statement could delete more than `$1`.
const DRAIN_SQL: &str = "
WITH claimed AS MATERIALIZED (
    SELECT id FROM lean_outbox ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED
)
DELETE FROM lean_outbox o USING claimed c WHERE o.id = c.id";

/// Measures B1-lean with each of `clients` for `per_point` each.
pub async fn grid(
    env: &BenchEnv,
    clients: &[usize],
    per_point: Duration,
    progress: &mut Progress,
) -> anyhow::Result<Vec<Point>> {
    env.as_owner(CREATE_SQL, "creating the lean baseline's tables")
        .await?;
    let mut points = Vec::new();
    for &c in clients {
        progress.update(&format!(
            "B1-lean: {c} clients, {INPUTS_PER_TX} inputs per transaction"
        ));
        let point = point(env, c, per_point).await?;
        progress.done(&format!(
            "B1-lean: {c} clients x {INPUTS_PER_TX} inputs/tx: {:.0} inputs/s \
             (cores: postgres {:.2}, client {:.2})",
            point.inputs_per_s, point.profile.cpu_cores.postgres, point.profile.cpu_cores.ductor
        ));
        points.push(point);
    }
    env.as_owner(
        &format!("DROP TABLE {TABLES}"),
        "dropping the lean baseline's tables",
    )
    .await?;
    Ok(points)
}

/// One client count, on emptied and freshly seeded tables.
async fn point(env: &BenchEnv, clients: usize, duration: Duration) -> anyhow::Result<Point> {
    seed(env, clients).await?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(
            PgConnection::connect_with(&env.owner_connect_options()?)
                .await
                .context("connecting a lean baseline client")?,
        );
    }
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    let cpu_before = CpuTicks::sample(&env.cpu);
    for (c, mut conn) in conns.into_iter().enumerate() {
        let (done, stop) = (done.clone(), stop.clone());
        let first = (c * RUNS_PER_CLIENT) as i64;
        tasks.spawn(async move {
            let seconds = client(&mut conn, first, &done, &stop).await?;
            anyhow::Ok((Instant::now(), seconds, conn))
        });
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut ended = started;
    let mut seconds = [0.0; STATEMENTS.len()];
    let mut iterations = 0u64;
    let mut finished = Vec::with_capacity(clients);
    while let Some(joined) = tasks.join_next().await {
        let (end, (client_seconds, client_iterations), conn) =
            joined.context("a lean baseline client panicked")??;
        ended = ended.max(end);
        iterations += client_iterations;
        for (sum, s) in seconds.iter_mut().zip(client_seconds) {
            *sum += s;
        }
        finished.push(conn);
    }
    let cpu_cores = cpu_before.cores_until(&CpuTicks::sample(&env.cpu));
    for conn in finished {
        conn.close().await.ok();
    }
    let statement_ms = STATEMENTS
        .iter()
        .zip(seconds)
        .map(|(name, s)| (*name, 1000.0 * s / iterations.max(1) as f64))
        .collect();
    Ok(Point {
        clients,
        k: INPUTS_PER_TX,
        inputs_per_s: done.load(Ordering::Relaxed) as f64
            / ended.duration_since(started).as_secs_f64(),
        profile: PointProfile {
            cpu_cores,
            statement_ms,
        },
    })
}

/// Empties the lean tables and seeds the runs of `clients` clients.
async fn seed(env: &BenchEnv, clients: usize) -> anyhow::Result<()> {
    env.as_owner(&format!("TRUNCATE {TABLES}"), "emptying the lean tables")
        .await?;
    let total = (clients * RUNS_PER_CLIENT) as i64;
    env.as_owner(
        &format!(
            "INSERT INTO lean_runs (run_id, version, last_seq, state) \
             SELECT g, 1, 1, repeat('s', {STATE_BYTES}) FROM generate_series(0, {}) AS g; \
             ANALYZE {TABLES}",
            total - 1
        ),
        "seeding the lean runs",
    )
    .await
}

/// One client on its own runs `first ..`, round robin, until `stop`: an
/// apply transaction, then a drain transaction. Returns the seconds spent
/// in each statement and the iterations.
async fn client(
    conn: &mut PgConnection,
    first: i64,
    done: &AtomicU64,
    stop: &AtomicBool,
) -> anyhow::Result<([f64; STATEMENTS.len()], u64)> {
    let mut versions = vec![1i64; RUNS_PER_CLIENT];
    let state = "t".repeat(STATE_BYTES);
    let payload = "p".repeat(PAYLOAD_BYTES);
    let mut cursor = 0;
    let mut seconds = [0.0; STATEMENTS.len()];
    let mut iterations = 0;
    while !stop.load(Ordering::Relaxed) {
        let slots: Vec<usize> = (0..INPUTS_PER_TX)
            .map(|j| (cursor + j) % RUNS_PER_CLIENT)
            .collect();
        cursor = (cursor + INPUTS_PER_TX) % RUNS_PER_CLIENT;
        let ids: Vec<i64> = slots.iter().map(|&s| first + s as i64).collect();
        let at: Vec<i64> = slots.iter().map(|&s| versions[s]).collect();
        let stamps: Vec<Uuid> = slots.iter().map(|_| Uuid::new_v4()).collect();
        let lap = Instant::now();
        let moved: i64 = tokio::time::timeout(
            ITERATION_TIMEOUT,
            sqlx::query_scalar(APPLY_SQL)
                .bind(&ids)
                .bind(&at)
                .bind(&stamps)
                .bind(&state)
                .bind(&payload)
                .fetch_one(&mut *conn),
        )
        .await
        .context("a lean apply timed out")??;
        anyhow::ensure!(
            moved == INPUTS_PER_TX as i64,
            "a lean apply moved {moved} of {INPUTS_PER_TX} runs: another writer moved them"
        );
        let applied = Instant::now();
        let drained = tokio::time::timeout(
            ITERATION_TIMEOUT,
            sqlx::query(DRAIN_SQL)
                .bind(DRAIN_PER_TX as i64)
                .execute(&mut *conn),
        )
        .await
        .context("a lean drain timed out")??
        .rows_affected();
        anyhow::ensure!(
            drained <= DRAIN_PER_TX as u64,
            "a lean drain deleted {drained} rows, more than the {DRAIN_PER_TX} it claimed"
        );
        seconds[0] += applied.duration_since(lap).as_secs_f64();
        seconds[1] += applied.elapsed().as_secs_f64();
        for &s in &slots {
            versions[s] += 1;
        }
        iterations += 1;
        done.fetch_add(INPUTS_PER_TX as u64, Ordering::Relaxed);
    }
    Ok((seconds, iterations))
}
