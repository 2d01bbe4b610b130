//! The example step worker for the workflows of `config/workflows/` (every
//! step on pool `default`). Each step's output is its input plus a field
//! named after the step, so a run's final output shows them all.
//! `--fail-rate` makes `charge` fail with a retryable error part of the
//! time, to show the retry policy at work; a step whose input names it in
//! `"fail"` (`{"fail": "ship_order"}`) fails for good, to show a catch or a
//! compensation at work.
//!
//! With `--payments-url`, `charge` really charges: it posts the amount to
//! `<url>/charges` with the step's `step_key` as its `Idempotency-Key`, the
//! same for every attempt of the step. An attempt that timed out, or whose
//! worker died after the payments service took the charge, is retried with
//! the same key, and the service answers with the charge it already made:
//! every run is charged once, however often its step runs.
//!
//! ```text
//! cargo run --example worker -- --fail-rate 0.3 --max-in-flight 64
//! cargo run --example worker -- --fail-rate 0 --payments-url http://127.0.0.1:8099
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
#[command(about = "Example Ductor step worker for the workflows of config/workflows")]
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
    /// A payments service (`http://host:port`) that "charge" posts to.
    #[arg(long)]
    payments_url: Option<url::Url>,
}

/// What the handler knows besides the dispatch.
#[derive(Clone)]
struct Handler {
    fail_rate: f64,
    work: Duration,
    payments: Option<url::Url>,
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
    if let Some(url) = &args.payments_url {
        anyhow::ensure!(
            url.scheme() == "http" && url.host_str().is_some(),
            "--payments-url must be http://host:port"
        );
    }
    let config = Config::load(args.config.as_deref()).context("loading configuration")?;
    // With `telemetry.otlp_endpoint` set, the handlers' spans are exported.
    let telemetry = ductor::client::init_telemetry(&config.log, &config.telemetry);

    let mut options = WorkerOptions::from_config(&config, &args.pool);
    options.max_in_flight = args.max_in_flight;
    let shutdown = CancellationToken::new();
    ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
    tracing::info!(
        pool = %args.pool,
        fail_rate = args.fail_rate,
        work_ms = args.work_ms,
        payments = args.payments_url.as_ref().map(url::Url::as_str),
        "example worker starting"
    );
    let handler = Handler {
        fail_rate: args.fail_rate,
        work: Duration::from_millis(args.work_ms),
        payments: args.payments_url,
    };
    let ran =
        ductor::client::worker::run(options, move |step| handler.clone().handle(step), shutdown)
            .await;
    // The last spans go out before the process does.
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    ran
}

impl Handler {
    async fn handle(self, step: StepDispatch) -> StepOutcome {
        tokio::time::sleep(self.work).await;
        if step.step == "charge" && rand::rng().random_bool(self.fail_rate) {
            tracing::info!(attempt = step.attempt, "charge declined (simulated)");
            return StepOutcome::Failed {
                message: format!("card declined (simulated, attempt {})", step.attempt),
                retryable: true,
            };
        }
        if step.input.get("fail").and_then(Value::as_str) == Some(step.step.as_str()) {
            tracing::info!(step = %step.step, "failing for good, as the input asks");
            return StepOutcome::Failed {
                message: format!("{} failed, as its input asks", step.step),
                retryable: false,
            };
        }
        let mut done =
            json!({ "done": true, "attempt": step.attempt, "worker_pid": std::process::id() });
        if let (Some(url), "charge") = (&self.payments, step.step.as_str()) {
            match charge(url, &step).await {
                Ok(charge) => done["charge"] = charge,
                Err(e) => {
                    tracing::warn!(
                        attempt = step.attempt,
                        error = format!("{e:#}"),
                        "charge failed"
                    );
                    return StepOutcome::Failed {
                        message: format!("payments service: {e:#}"),
                        retryable: true,
                    };
                }
            }
        }
        let mut output = match step.input {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => Map::from_iter([("input".to_owned(), other)]),
        };
        output.insert(step.step.clone(), done);
        StepOutcome::Succeeded(Value::Object(output))
    }
}

/// Charges the run's amount (its input's `amount`, 1 if none) once per
/// step: the `Idempotency-Key` is the step's key, not the attempt's. The
/// call ends by the attempt's deadline, after which its result would be
/// ignored anyway.
async fn charge(url: &url::Url, step: &StepDispatch) -> anyhow::Result<Value> {
    let amount = step
        .input
        .get("amount")
        .and_then(Value::as_u64)
        .unwrap_or(1);
    let body = json!({ "run_id": step.run_id, "amount": amount }).to_string();
    let left = (step.deadline - chrono::Utc::now())
        .to_std()
        .unwrap_or_default();
    tokio::time::timeout(left, post_json(url, "/charges", &step.step_key, body))
        .await
        .context("no answer before the attempt's deadline")?
}

/// One `POST` over HTTP/1.1 on a connection of its own; the answer's JSON
/// body if its status is 2xx.
async fn post_json(url: &url::Url, path: &str, key: &str, body: String) -> anyhow::Result<Value> {
    use http_body_util::{BodyExt, Full};
    let host = url.host_str().context("the URL has no host")?;
    let port = url.port_or_known_default().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host, port)).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::post(path)
        .header(hyper::header::HOST, format!("{host}:{port}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(hyper::body::Bytes::from(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let bytes = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "answered {status}");
    Ok(serde_json::from_slice(&bytes)?)
}
