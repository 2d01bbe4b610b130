//! Drives the demo: submits N runs of a workflow as `run.start` requests on
//! Kafka, sends each run the signal its `await_signal` step waits for as
//! soon as the run exists (so it comes before the step waits, or while it
//! does), shows their progress from Postgres, and ends with one JSON line
//! `{"runs":N,"succeeded":..,"failed":..,"cancelled":..,"seconds":..}`.
//! Exits 0 when every run reached a terminal state before the deadline.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use ductor::config::Config;
use futures::stream::{self, StreamExt};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Submit runs and follow them to completion")]
struct Args {
    /// Configuration file layered over the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// How many runs to submit.
    #[arg(long, default_value_t = 300)]
    runs: usize,
    /// Workflow to run.
    #[arg(long, default_value = "order")]
    workflow: String,
    /// The signal each run gets once it exists (`wakeup.signal` on Kafka);
    /// empty for none.
    #[arg(long, default_value = "payment_confirmed")]
    signal: String,
    /// Tenant owning the runs.
    #[arg(long, default_value = "demo")]
    tenant: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Submits the batch, follows it, and prints the summary line; true when
/// every run reached a terminal state before the deadline.
async fn run(args: Args) -> anyhow::Result<bool> {
    let config = Config::load(args.config.as_deref())?;
    let pool = ductor::infra::db::connect(&config.database).await?;
    let producer = ductor::infra::kafka::producer(&config.kafka, "demo")?;
    let batch = uuid::Uuid::new_v4().simple().to_string();
    let run_ids: Vec<String> = (0..args.runs)
        .map(|i| format!("demo-{}-{i:05}", &batch[..8]))
        .collect();
    let started = Instant::now();
    submit(&producer, &config, &args, &run_ids).await?;
    eprintln!(
        "submitted {} runs of {:?} in {:.1}s",
        args.runs,
        args.workflow,
        started.elapsed().as_secs_f64()
    );
    let batch = Batch {
        prefix: format!("demo-{}-%", &batch[..8]),
        runs: args.runs,
        started,
        deadline: started + Duration::from_secs(args.timeout_s),
    };
    let signals = Signals {
        producer: &producer,
        topic: config.topic_names().wakeups(),
        timeout: Duration::from_millis(config.kafka.delivery_timeout_ms),
        name: args.signal.clone(),
        sent: HashSet::new(),
    };
    let counts = follow(&pool, &batch, signals).await?;
    let seconds = started.elapsed().as_secs_f64();
    let retries = count_retries(&pool, &batch.prefix).await?;
    // Keys in a fixed order, for people reading the line.
    println!(
        "{{\"runs\":{},\"succeeded\":{},\"failed\":{},\"cancelled\":{},\"retries\":{},\"seconds\":{:.2}}}",
        args.runs, counts.succeeded, counts.failed, counts.cancelled, retries, seconds
    );
    Ok(counts.terminal() >= args.runs as i64)
}

/// The runs this driver submitted, and until when it follows them.
struct Batch {
    /// A `LIKE` pattern matching the batch's run ids.
    prefix: String,
    runs: usize,
    started: Instant,
    deadline: Instant,
}

/// Sends one `run.start` request per run of this batch, many in flight at
/// once, and fails if any of them was not acknowledged.
async fn submit(
    producer: &FutureProducer,
    config: &Config,
    args: &Args,
    run_ids: &[String],
) -> anyhow::Result<()> {
    let topic = config.topic_names().requests();
    let timeout = Duration::from_millis(config.kafka.delivery_timeout_ms);
    let sent: Vec<anyhow::Result<()>> = stream::iter(run_ids.iter())
        .map(|run_id| {
            let value = start_request(args, run_id);
            let topic = &topic;
            async move {
                producer
                    .send(FutureRecord::to(topic).key(run_id).payload(&value), timeout)
                    .await
                    .map(|_| ())
                    .map_err(|(e, _)| anyhow::anyhow!("submitting {run_id}: {e}"))
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    sent.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    Ok(())
}

/// The `run.start` request of one run.
fn start_request(args: &Args, run_id: &str) -> String {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": args.tenant, "workflow": args.workflow,
        "input": {"order": run_id},
    })
    .to_string()
}

/// Shows the batch's progress twice a second until all its runs are
/// terminal or the deadline passes; returns the last counts.
async fn follow(
    pool: &sqlx::PgPool,
    batch: &Batch,
    mut signals: Signals<'_>,
) -> anyhow::Result<Counts> {
    loop {
        signals.send_to_new_runs(pool, &batch.prefix).await?;
        let counts = status_counts(pool, &batch.prefix).await?;
        let terminal = counts.terminal();
        eprint!(
            "\r  {:>6.1}s  running {:>5}  succeeded {:>5}  failed {:>5}  cancelled {:>5}  ",
            batch.started.elapsed().as_secs_f64(),
            batch.runs as i64 - terminal,
            counts.succeeded,
            counts.failed,
            counts.cancelled
        );
        let _ = std::io::stderr().flush();
        if terminal >= batch.runs as i64 || Instant::now() >= batch.deadline {
            eprintln!();
            return Ok(counts);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The signal every run of the batch gets once, as soon as it exists: a
/// signal for a run that does not exist yet would be refused.
struct Signals<'a> {
    producer: &'a FutureProducer,
    topic: String,
    timeout: Duration,
    name: String,
    sent: HashSet<String>,
}

impl Signals<'_> {
    async fn send_to_new_runs(&mut self, pool: &sqlx::PgPool, prefix: &str) -> anyhow::Result<()> {
        if self.name.is_empty() {
            return Ok(());
        }
        let runs: Vec<(String, String)> =
            sqlx::query_as("SELECT run_id, tenant_scope FROM runs WHERE run_id LIKE $1")
                .bind(prefix)
                .fetch_all(pool)
                .await
                .context("listing the batch's runs")?;
        let new: Vec<(String, String)> = runs
            .into_iter()
            .filter(|(run_id, _)| !self.sent.contains(run_id))
            .collect();
        let this = &*self;
        let sent: Vec<anyhow::Result<()>> = stream::iter(new.iter())
            .map(|(run_id, tenant)| async move {
                let value = json!({
                    "type": "wakeup.signal", "schema_version": 1, "run_id": run_id,
                    "tenant": tenant, "signal_id": format!("{}-{run_id}", this.name),
                    "name": this.name, "payload": {"confirmed_by": "demo"},
                })
                .to_string();
                let record = FutureRecord::to(&this.topic).key(run_id).payload(&value);
                this.producer
                    .send(record, this.timeout)
                    .await
                    .map(|_| ())
                    .map_err(|(e, _)| anyhow::anyhow!("signalling {run_id}: {e}"))
            })
            .buffer_unordered(256)
            .collect()
            .await;
        sent.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
        self.sent.extend(new.into_iter().map(|(run_id, _)| run_id));
        Ok(())
    }
}

/// How many attempts of the batch's runs were retries.
async fn count_retries(pool: &sqlx::PgPool, prefix: &str) -> anyhow::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM run_attempts a JOIN runs r USING (run_id) \
         WHERE r.run_id LIKE $1 AND a.attempt > 1",
    )
    .bind(prefix)
    .fetch_one(pool)
    .await
    .context("counting retries")
}

struct Counts {
    succeeded: i64,
    failed: i64,
    cancelled: i64,
}

impl Counts {
    /// Runs that reached a terminal state.
    fn terminal(&self) -> i64 {
        self.succeeded + self.failed + self.cancelled
    }
}

async fn status_counts(pool: &sqlx::PgPool, prefix: &str) -> anyhow::Result<Counts> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM runs WHERE run_id LIKE $1 GROUP BY status")
            .bind(prefix)
            .fetch_all(pool)
            .await
            .context("counting runs")?;
    let get = |s: &str| {
        rows.iter()
            .find(|(status, _)| status == s)
            .map_or(0, |r| r.1)
    };
    Ok(Counts {
        succeeded: get("succeeded"),
        failed: get("failed"),
        cancelled: get("cancelled"),
    })
}
