//! `ductor-idle`: a running Ductor timed from outside, the way a quiet
//! deployment sees it.
//!
//! `ductor-bench` runs `serve` and its worker inside its own process; this
//! client runs beside any `ductor serve` and worker that are already up
//! (of this build or of another revision: it speaks only the message
//! contract's start request and `run.succeeded` event), so that two builds
//! can be compared with one client (`scripts/bench-compare --outside`).
//!
//! Two figures, in this order:
//! 1. **idle CPU**: with nothing to do, each process group's share of a
//!    core over `--cpu-window-s` seconds (the serve given by `--serve-pid`,
//!    Postgres, the Kafka broker) and the database's transactions per
//!    second (`pg_stat_database`): what Ductor costs when it has no work.
//! 2. **idle runs**: `--runs` runs of `--workflow`, one at a time, each
//!    from its start request to its `run.succeeded` event (see
//!    [`super::idle::one_at_a_time`]).
//!
//! Out: one JSON line on stdout; progress on stderr.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;

use ductor::config::Config;

use super::idle::{Idle, one_at_a_time};
use super::pipeline::{events_consumer, produce_all};
use super::stats::{CpuCores, CpuScope, CpuTicks, Progress};

/// `ductor-idle` options.
#[derive(Debug, Clone, clap::Args)]
pub struct OutsideArgs {
    /// Runs timed one at a time.
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    /// The workflow the runs start (loaded by the serve being timed).
    #[arg(long, default_value = "example")]
    pub workflow: String,
    /// The tenant the start requests name.
    #[arg(long, default_value = "bench")]
    pub tenant: String,
    /// The serve's process id, whose CPU counts as Ductor's (none: only
    /// Postgres and Kafka are counted).
    #[arg(long)]
    pub serve_pid: Option<u32>,
    /// Seconds over which idle CPU is measured, before the runs (0: not
    /// measured).
    #[arg(long, default_value_t = 30)]
    pub cpu_window_s: u64,
}

/// What a quiet deployment costs and how fast it answers.
#[derive(Debug, Serialize)]
pub struct Outside {
    pub workflow: String,
    /// Cores used with no work (absent with `--cpu-window-s 0`).
    pub idle_cpu: Option<CpuCores>,
    /// The database's committed and rolled back transactions per second
    /// with no work.
    pub idle_pg_xacts_per_s: Option<f64>,
    pub idle: Idle,
}

/// Measures idle CPU, then times the runs, and prints the JSON line.
pub async fn main(args: OutsideArgs, config: Config) -> anyhow::Result<()> {
    let mut progress = Progress::default();
    let (idle_cpu, idle_pg_xacts_per_s) = if args.cpu_window_s > 0 {
        let (cpu, xacts) = idle_cost(&args, &config, &mut progress).await?;
        (Some(cpu), Some(xacts))
    } else {
        (None, None)
    };
    let producer = ductor::infra::kafka::producer(&config.kafka, "outside")?;
    let events = events_consumer(&config).await?;
    let topic = config.topic_names().requests();
    let timeout = Duration::from_millis(config.kafka.delivery_timeout_ms);
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let idle = one_at_a_time(args.runs, &events, &mut progress, async |i| {
        let run_id = format!("outside-{}-{i}", &tag[..10]);
        let start = start_request(&run_id, &args.workflow, &args.tenant, i);
        produce_all(&producer, &topic, &[(run_id.clone(), start)], timeout).await?;
        Ok(run_id)
    })
    .await?;
    progress.done(&format!(
        "idle, one run at a time ({} runs of {}): p50 {:.1} ms, p99 {:.1} ms",
        idle.runs, args.workflow, idle.p50_ms, idle.p99_ms
    ));
    let outside = Outside {
        workflow: args.workflow,
        idle_cpu,
        idle_pg_xacts_per_s,
        idle,
    };
    println!("{}", serde_json::to_string(&outside)?);
    Ok(())
}

/// A start request of the message contract (`run.start`, schema 1).
fn start_request(run_id: &str, workflow: &str, tenant: &str, i: usize) -> String {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": tenant, "workflow": workflow,
        "input": {"order": i, "sku": "bench-item-0001", "qty": 1},
    })
    .to_string()
}

/// Cores per process group, and the database's transactions per second,
/// over the CPU window with no work sent.
async fn idle_cost(
    args: &OutsideArgs,
    config: &Config,
    progress: &mut Progress,
) -> anyhow::Result<(CpuCores, f64)> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(config.database.url.expose())
        .await
        .context("connecting to the database")?;
    let db_name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await?;
    let mut scope = CpuScope::new(&db_name, &config.kafka.bootstrap_servers);
    scope.ductor_pid = args.serve_pid.map(|p| p.to_string());
    let window = Duration::from_secs(args.cpu_window_s);
    progress.done(&format!("idle CPU over {window:?}, with no work"));
    let xacts_before = xacts(&pool).await?;
    let before = CpuTicks::sample(&scope);
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = CpuTicks::sample(&scope);
    let xacts_after = xacts(&pool).await?;
    pool.close().await;
    // The two readings of pg_stat_database are transactions of their own.
    let xacts = xacts_after.saturating_sub(xacts_before).saturating_sub(1);
    Ok((
        before.cores_until(&after),
        xacts as f64 / started.elapsed().as_secs_f64(),
    ))
}

/// The current database's committed and rolled back transactions so far.
async fn xacts(pool: &sqlx::PgPool) -> anyhow::Result<u64> {
    // Statistics are read once per transaction and cached; a fresh
    // snapshot makes two readings in one session differ.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(pool)
        .await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .context("reading pg_stat_database")?;
    Ok(u64::try_from(n).unwrap_or(0))
}
