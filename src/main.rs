//! The `ductor` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ductor::config::Config;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "ductor",
    version,
    about = "A durable step orchestrator on Kafka and Postgres"
)]
struct Cli {
    /// A TOML file layered over the built-in defaults; `DUCTOR__SECTION__KEY`
    /// environment variables override both.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply pending database migrations.
    Migrate,
    /// Manage Kafka topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Run the coordinator, its ingress and the HTTP endpoints until SIGINT/SIGTERM.
    Serve,
    /// Operate the outbox.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Look at durable state.
    Inspect {
        #[command(subcommand)]
        command: InspectCommand,
    },
    /// Print the effective configuration (secrets redacted).
    Config,
    /// Start a run through the routing plane and print its decision as JSON.
    Submit(SubmitArgs),
}

#[derive(clap::Args)]
struct SubmitArgs {
    /// Workflow to start.
    #[arg(long)]
    workflow: String,
    /// The run's input, as JSON.
    #[arg(long, default_value = "null")]
    input: String,
    /// Tenant owning the run.
    #[arg(long, default_value = "default")]
    tenant: String,
    /// Routing pool owning the run.
    #[arg(long, default_value = "default")]
    pool: String,
    /// Workflow version; the latest loaded when absent.
    #[arg(long)]
    workflow_version: Option<u32>,
    /// Requests with the same key (per tenant and pool) get the same run;
    /// without one, every submit is a new run.
    #[arg(long)]
    idempotency_key: Option<String>,
}

#[derive(Subcommand)]
enum TopicsCommand {
    /// Create every configured topic; existing topics are left alone.
    Create,
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Put parked intents (effects that could not be published: too large,
    /// an unknown topic, no authorisation) back into the claim rounds, once
    /// the cause is fixed; prints how many.
    Redrive {
        /// Only this run's.
        #[arg(long)]
        run: Option<String>,
        /// Only those bound for this topic.
        #[arg(long)]
        topic: Option<String>,
    },
}

#[derive(Subcommand)]
enum InspectCommand {
    /// A run's state, attempts and transition history, as JSON.
    Run { run_id: String },
}

fn main() -> ExitCode {
    // Fault injection for scripts/chaos; absent from normal builds.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        match run(cli.command, config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), "ductor failed");
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            let pool = ductor::infra::db::connect(&config.database).await?;
            ductor::infra::db::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Topics {
            command: TopicsCommand::Create,
        } => {
            let outcomes = ductor::infra::kafka::create_configured_topics(&config).await?;
            for o in outcomes {
                println!(
                    "{} {}",
                    if o.created { "created" } else { "exists " },
                    o.topic
                );
            }
            let small =
                ductor::infra::kafka::topics_below_limit(&config.kafka, &config.all_topics())
                    .await?;
            if !small.is_empty() {
                return Err(ductor::infra::kafka::limits_error(&config.kafka, &small));
            }
            Ok(())
        }
        Command::Outbox {
            command: OutboxCommand::Redrive { run, topic },
        } => {
            let pool = ductor::infra::db::connect(&config.database).await?;
            let redriven =
                ductor::outbox::Drainer::redrive_parked(&pool, run.as_deref(), topic.as_deref())
                    .await?;
            println!("{}", serde_json::json!({ "redriven": redriven }));
            Ok(())
        }
        Command::Serve => {
            let shutdown = CancellationToken::new();
            ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
            ductor::cli::serve::run(config, shutdown).await
        }
        Command::Inspect {
            command: InspectCommand::Run { run_id },
        } => {
            let pool = ductor::infra::db::connect(&config.database).await?;
            let run = ductor::cli::inspect::run(&pool, &run_id)
                .await?
                .with_context(|| format!("no run with id {run_id:?}"))?;
            println!("{}", serde_json::to_string_pretty(&run)?);
            Ok(())
        }
        Command::Submit(args) => submit(args, config).await,
        Command::Config => {
            println!("{config:#?}");
            Ok(())
        }
    }
}

async fn submit(args: SubmitArgs, config: Config) -> anyhow::Result<()> {
    let limits = config.input_limits();
    let input: serde_json::Value = ductor::contract::parse_value(args.input.as_bytes(), &limits)
        .map_err(|e| anyhow::anyhow!("--input: {e}"))?;
    let mut body = serde_json::json!({
        "workflow": args.workflow,
        "tenant": args.tenant,
        "pool": args.pool,
        "input": input,
    });
    if let Some(version) = args.workflow_version {
        body["workflow_version"] = version.into();
    }
    let key = args.idempotency_key.filter(|k| !k.is_empty());
    let request = ductor::routing::http::route_request_from_body(body, key)
        .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
    ductor::contract::bound_start(&request.start, args.input.len(), &limits)
        .map_err(|e| anyhow::anyhow!("--input: {}: {}", e.class.as_str(), e.message))?;
    let workflows = ductor::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pool = ductor::infra::db::connect(&config.database).await?;
    let applier = ductor::apply::Applier::new(&config, pool, workflows);
    let submitted = ductor::routing::http::submit(&applier, &config.routing, request)
        .await
        .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
    let status = match submitted {
        ductor::routing::http::Submitted::Created(_) => "created",
        ductor::routing::http::Submitted::Duplicate(_) => "duplicate",
    };
    let mut out = serde_json::to_value(submitted.decision())?;
    out["outcome"] = status.into();
    println!("{out}");
    Ok(())
}
