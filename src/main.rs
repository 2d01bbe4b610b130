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
    /// Look at durable state.
    Inspect {
        #[command(subcommand)]
        command: InspectCommand,
    },
    /// Print the effective configuration (secrets redacted).
    Config,
}

#[derive(Subcommand)]
enum TopicsCommand {
    /// Create every configured topic; existing topics are left alone.
    Create,
}

#[derive(Subcommand)]
enum InspectCommand {
    /// A run's state, attempts and transition history, as JSON.
    Run { run_id: String },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    ductor::telemetry::init_logging(&config.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "ductor failed");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            let pool = ductor::db::connect(&config.database).await?;
            ductor::db::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Topics {
            command: TopicsCommand::Create,
        } => {
            let outcomes = ductor::kafka::create_configured_topics(&config).await?;
            for o in outcomes {
                println!(
                    "{} {}",
                    if o.created { "created" } else { "exists " },
                    o.topic
                );
            }
            Ok(())
        }
        Command::Serve => {
            let shutdown = CancellationToken::new();
            ductor::serve::cancel_on_signals(shutdown.clone())?;
            ductor::serve::run(config, shutdown).await
        }
        Command::Inspect {
            command: InspectCommand::Run { run_id },
        } => {
            let pool = ductor::db::connect(&config.database).await?;
            let run = ductor::inspect::run(&pool, &run_id)
                .await?
                .with_context(|| format!("no run with id {run_id:?}"))?;
            println!("{}", serde_json::to_string_pretty(&run)?);
            Ok(())
        }
        Command::Config => {
            println!("{config:#?}");
            Ok(())
        }
    }
}
