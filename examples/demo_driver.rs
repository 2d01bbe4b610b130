//! Drives the demo: submits N runs of a workflow as `run.start` requests on
//! Kafka, sends each run the signal its `await_signal` step waits for as
//! soon as the run exists (so it comes before the step waits, or while it
//! does), shows their progress from Postgres, and ends with one JSON line
//! `{"runs":N,"succeeded":..,"failed":..,"cancelled":..,"retries":..,
//! "checkout":{..},"seconds":..}`.
//!
//! With `--checkout-runs M` it also submits M runs of `checkout` (a charge,
//! a reservation in two warehouses at once, a shipping), every
//! `--compensate-every`th asking the example worker to fail its shipping
//! for good: those must end compensated (the holds released and the card
//! refunded, then failed with cause `compensated`), the others succeeded.
//! Exits 0 when every run reached a terminal state before the deadline and
//! every checkout ended as it should.

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
    /// How many runs of the workflow `checkout` to submit beside them.
    #[arg(long, default_value_t = 0)]
    checkout_runs: usize,
    /// Every this many checkouts, one whose shipping fails for good.
    #[arg(long, default_value_t = 10)]
    compensate_every: usize,
}

/// The workflow of `--checkout-runs`, and the step its failing runs fail.
const CHECKOUT: &str = "checkout";
const FAILING_STEP: &str = "ship_order";

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
    anyhow::ensure!(
        args.compensate_every >= 1,
        "--compensate-every must be at least 1"
    );
    let config = Config::load(args.config.as_deref())?;
    let pool = ductor::infra::db::connect(&config.database).await?;
    let producer = ductor::infra::kafka::producer(&config.kafka, "demo")?;
    let batch = uuid::Uuid::new_v4().simple().to_string();
    let orders: Vec<(String, serde_json::Value)> = (0..args.runs)
        .map(|i| format!("demo-{}-{i:05}", &batch[..8]))
        .map(|id| (id.clone(), json!({ "order": id })))
        .collect();
    let checkouts: Vec<(String, serde_json::Value)> = (0..args.checkout_runs)
        .map(|i| {
            let id = format!("demo-{}-checkout-{i:05}", &batch[..8]);
            let input = if i % args.compensate_every == args.compensate_every - 1 {
                json!({ "order": id, "fail": FAILING_STEP })
            } else {
                json!({ "order": id })
            };
            (id, input)
        })
        .collect();
    let started = Instant::now();
    submit(&producer, &config, &args.tenant, &args.workflow, &orders).await?;
    submit(&producer, &config, &args.tenant, CHECKOUT, &checkouts).await?;
    eprintln!(
        "submitted {} runs of {:?} and {} of {CHECKOUT:?} in {:.1}s",
        args.runs,
        args.workflow,
        args.checkout_runs,
        started.elapsed().as_secs_f64()
    );
    let batch = Batch {
        prefix: format!("demo-{}-%", &batch[..8]),
        checkouts: format!("demo-{}-checkout-%", &batch[..8]),
        runs: args.runs + args.checkout_runs,
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
    let failing = checkouts.iter().filter(|(_, i)| i["fail"] == FAILING_STEP);
    let expected = Expected {
        compensated: failing.count() as i64,
        runs: args.checkout_runs as i64,
    };
    let ended = summarize(&pool, &batch, &counts, &expected).await?;
    Ok(counts.terminal() >= batch.runs as i64 && ended)
}

/// How many checkouts there are, and how many must end compensated.
struct Expected {
    runs: i64,
    compensated: i64,
}

/// Prints the summary line; true when the checkouts ended as they should.
async fn summarize(
    pool: &sqlx::PgPool,
    batch: &Batch,
    counts: &Counts,
    expected: &Expected,
) -> anyhow::Result<bool> {
    let seconds = batch.started.elapsed().as_secs_f64();
    let retries = count_retries(pool, &batch.prefix).await?;
    let ended = checkout_ends(pool, &batch.checkouts).await?;
    // Keys in a fixed order, for people reading the line.
    println!(
        "{{\"runs\":{},\"succeeded\":{},\"failed\":{},\"cancelled\":{},\"retries\":{},\
         \"checkout\":{{\"runs\":{},\"succeeded\":{},\"compensated\":{},\"undone_steps\":{}}},\
         \"seconds\":{:.2}}}",
        batch.runs,
        counts.succeeded,
        counts.failed,
        counts.cancelled,
        retries,
        expected.runs,
        ended.succeeded,
        ended.compensated,
        ended.undone,
        seconds
    );
    let as_asked = ended.compensated == expected.compensated
        && ended.succeeded == expected.runs - expected.compensated;
    if !as_asked {
        eprintln!(
            "checkout: {} of {} runs should have ended compensated and the rest succeeded; \
             {} compensated and {} succeeded",
            expected.compensated, expected.runs, ended.compensated, ended.succeeded
        );
    }
    Ok(as_asked)
}

/// How the checkouts ended: succeeded, failed compensated (every
/// compensation ran), and how many compensations succeeded in all.
struct CheckoutEnds {
    succeeded: i64,
    compensated: i64,
    undone: i64,
}

async fn checkout_ends(pool: &sqlx::PgPool, pattern: &str) -> anyhow::Result<CheckoutEnds> {
    let (succeeded, compensated, undone): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), \
                count(*) FILTER (WHERE status = 'failed' AND state ? 'compensating' \
                                 AND NOT state ? 'compensable'), \
                (SELECT count(*) FROM run_transitions t \
                  WHERE t.run_id LIKE $1 AND t.detail ? 'compensated_key') \
         FROM runs WHERE run_id LIKE $1",
    )
    .bind(pattern)
    .fetch_one(pool)
    .await
    .context("counting how the checkouts ended")?;
    Ok(CheckoutEnds {
        succeeded,
        compensated,
        undone,
    })
}

/// The runs this driver submitted, and until when it follows them.
struct Batch {
    /// A `LIKE` pattern matching the batch's run ids.
    prefix: String,
    /// A `LIKE` pattern matching its checkouts' run ids.
    checkouts: String,
    runs: usize,
    started: Instant,
    deadline: Instant,
}

/// Sends one `run.start` request per run of this batch, many in flight at
/// once, and fails if any of them was not acknowledged.
async fn submit(
    producer: &FutureProducer,
    config: &Config,
    tenant: &str,
    workflow: &str,
    runs: &[(String, serde_json::Value)],
) -> anyhow::Result<()> {
    let topic = config.topic_names().requests();
    let timeout = Duration::from_millis(config.kafka.delivery_timeout_ms);
    let sent: Vec<anyhow::Result<()>> = stream::iter(runs.iter())
        .map(|(run_id, input)| {
            let value = start_request(tenant, workflow, run_id, input);
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
fn start_request(tenant: &str, workflow: &str, run_id: &str, input: &serde_json::Value) -> String {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": tenant, "workflow": workflow, "input": input,
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
        signals
            .send_to_new_runs(pool, &batch.prefix, &batch.checkouts)
            .await?;
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
    /// Signals the runs matching `prefix` but the checkouts, which wait for
    /// none.
    async fn send_to_new_runs(
        &mut self,
        pool: &sqlx::PgPool,
        prefix: &str,
        checkouts: &str,
    ) -> anyhow::Result<()> {
        if self.name.is_empty() {
            return Ok(());
        }
        let runs: Vec<(String, String)> = sqlx::query_as(
            "SELECT run_id, tenant_scope FROM runs WHERE run_id LIKE $1 AND run_id NOT LIKE $2",
        )
        .bind(prefix)
        .bind(checkouts)
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
