//! `ductor-chaos`: the load driver and the checker of `scripts/chaos`
//! (see `crate`).
//!
//! Exit status of `check`: 0 no violation, 1 violations (the JSON line says
//! which), 2 the checker itself failed.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ductor::config::Config;
use ductor_chaos::{CheckArgs, LoadArgs};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "ductor-chaos",
    about = "Chaos load driver and guarantee checker for Ductor"
)]
struct Cli {
    /// Ductor's configuration file (the one the `serve` processes use);
    /// `DUCTOR__SECTION__KEY` environment variables override it.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive a mixed workload (and be the step worker), logging every event.
    Load(LoadArgs),
    /// Wait for the system to settle, check every guarantee, print one JSON line.
    Check(CheckArgs),
    /// Send hostile inputs among good runs to a `ductor serve` it starts in
    /// a process of its own (on the configured database and topic prefix),
    /// check that each was refused
    /// once and every good run completed, print one JSON line. Set small
    /// input limits (`DUCTOR__COORDINATOR__MAX_INPUT_BYTES` and the shape
    /// limits) so that values past them are cheap to send.
    Fuzz(ductor_chaos::fuzz::FuzzArgs),
    /// Measure what a SIGKILL of a serve and its immediate restart cost a
    /// healthy workload (see `ductor_chaos::restart`); exits 1 when a run
    /// failed or an attempt timed out.
    Restart(ductor_chaos::restart::RestartArgs),
    /// Delete every topic of the configured topic prefix (a chaos run's own
    /// topics); refuses the default prefix.
    DeleteTopics,
    /// Create one topic with its own partition count (left alone if it
    /// exists), before `ductor topics create` makes the rest.
    CreateTopic {
        #[arg(long)]
        topic: String,
        #[arg(long)]
        partitions: i32,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        let outcome = match cli.command {
            Command::Load(args) => load(args, config).await,
            Command::CreateTopic { topic, partitions } => {
                ductor::infra::kafka::ensure_topics(&config.kafka, &[topic], partitions)
                    .await
                    .map(|outcome| (json_line(&outcome), true))
            }
            Command::DeleteTopics => ductor_chaos::topics::delete_prefixed(&config)
                .await
                .map(|deleted| (serde_json::json!({ "deleted": deleted }).to_string(), true)),
            Command::Restart(args) => ductor_chaos::restart::run(&config, &args)
                .await
                .map(|r| (r.json_line(), r.ok())),
            Command::Fuzz(args) => ductor_chaos::fuzz::run(&config, &args)
                .await
                .map(|r| (r.json_line(), r.ok())),
            Command::Check(args) => ductor_chaos::check::run(&args, &config)
                .await
                .map(|report| (json_line(&report), report.ok())),
        };
        verdict(outcome)
    })
}

/// The load driver, stopped by signals; its summary line (a load has no
/// violations of its own).
async fn load(args: LoadArgs, config: Config) -> anyhow::Result<(String, bool)> {
    let (stop, abort) = (CancellationToken::new(), CancellationToken::new());
    stop_then_abort_on_signals(stop.clone(), abort.clone())
        .map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let summary = ductor_chaos::load::run(args, config, stop, abort).await?;
    Ok((json_line(&summary), true))
}

/// One JSON line of `value`.
fn json_line(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// The first SIGINT/SIGTERM ends the load phase (the wind-down follows), the
/// second ends the wind-down too.
fn stop_then_abort_on_signals(
    stop: CancellationToken,
    abort: CancellationToken,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        for token in [stop, abort] {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            token.cancel();
        }
    });
    Ok(())
}

/// A harness's report line and exit status: 0 without violations, 1 with
/// some, 2 when it could not run.
fn verdict(outcome: anyhow::Result<(String, bool)>) -> ExitCode {
    match outcome {
        Ok((line, ok)) => {
            println!("{line}");
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
