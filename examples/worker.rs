//! The example step worker for `config/workflows/example.toml` (steps
//! `reserve`, `charge`, `ship` on pool `default`). Each step's output is its
//! input plus a field named after the step, so a run's final output shows
//! all three. `--fail-rate` makes `charge` fail with a retryable error part
//! of the time, to show the retry policy at work.
//!
//! ```text
//! cargo run --example worker -- --fail-rate 0.3 --max-in-flight 64
//! ```

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ductor::client::worker::{DEFAULT_MAX_IN_FLIGHT, StepDispatch, StepOutcome, WorkerOptions};
use ductor::config::Config;
use rand::Rng;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(about = "Example Ductor step worker for the \"example\" workflow")]
struct Args {
    /// Configuration file layered over the defaults (environment still wins).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Pool whose step topic to consume.
    #[arg(long, default_value = "default")]
    pool: String,
    /// Probability in [0, 1] that one attempt of "charge" fails (retryably).
    #[arg(long, default_value_t = 0.3)]
    fail_rate: f64,
    /// Steps handled at once.
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// Simulated work per step, in milliseconds.
    #[arg(long, default_value_t = 5)]
    work_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.fail_rate),
        "--fail-rate must be between 0 and 1"
    );
    anyhow::ensure!(
        args.max_in_flight >= 1,
        "--max-in-flight must be at least 1"
    );
    let config = Config::load(args.config.as_deref()).context("loading configuration")?;
    ductor::infra::telemetry::init_logging(&config.log);

    let mut options = WorkerOptions::from_config(&config, &args.pool);
    options.max_in_flight = args.max_in_flight;
    let shutdown = CancellationToken::new();
    ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
    tracing::info!(
        pool = %args.pool,
        fail_rate = args.fail_rate,
        work_ms = args.work_ms,
        "example worker starting"
    );
    let (fail_rate, work) = (args.fail_rate, Duration::from_millis(args.work_ms));
    ductor::client::worker::run(options, move |step| handle(step, fail_rate, work), shutdown).await
}

async fn handle(step: StepDispatch, fail_rate: f64, work: Duration) -> StepOutcome {
    tokio::time::sleep(work).await;
    if step.step == "charge" && rand::rng().random_bool(fail_rate) {
        tracing::info!(attempt = step.attempt, "charge declined (simulated)");
        return StepOutcome::Failed {
            message: format!("card declined (simulated, attempt {})", step.attempt),
            retryable: true,
        };
    }
    let mut output = match step.input {
        Value::Object(map) => map,
        Value::Null => Map::new(),
        other => Map::from_iter([("input".to_owned(), other)]),
    };
    output.insert(
        step.step.clone(),
        json!({ "done": true, "attempt": step.attempt, "worker_pid": std::process::id() }),
    );
    StepOutcome::Succeeded(Value::Object(output))
}
