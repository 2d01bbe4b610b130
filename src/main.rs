//! The `ductor` command line.
//!
//! In: the arguments, and the configuration file of `--config` (or
//! `DUCTOR_CONFIG`). Out: the command's result on stdout (JSON for
//! `submit`, `inspect`, `keys` and `outbox redrive`), errors on stderr.
//! Guarantees: exit status 0 on success, 1 when the command failed (for
//! the commands over the HTTP API, `runs` and `outbox`: when the API
//! refused it), 2 when the arguments or the configuration do not parse, 3
//! when the API could not be reached or failed (a retry may help); every
//! command is `ductor::cli`'s, this file only parses and prints.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ductor::cli::client::{ApiClient, CliError};
use ductor::cli::{commands, operator};
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
    /// Operate the outbox, over the HTTP API (a key with the admin scope).
    Outbox {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// List, read, replay and discard dead letters, over the HTTP API.
    Dlq {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// List, search, count, show, cancel and retry runs, over the HTTP API.
    Runs {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: RunsCommand,
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
    /// Manage the API keys of the public HTTP API.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Check workflow definition files as `serve` loads them.
    Workflows {
        #[command(subcommand)]
        command: WorkflowsCommand,
    },
    /// Write the JSON Schemas of every message and header set of the
    /// contract, and the HTTP API's OpenAPI document, under a directory
    /// (the repository's are in `schemas/`).
    Schemas {
        /// Where to write them.
        #[arg(long, default_value = "schemas")]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum WorkflowsCommand {
    /// Read, parse and validate each file (and refuse a name and version
    /// that two of them define); print one line per file, `ok` or why it
    /// is refused (its workflow, step, field and rule). Exits with 1 when
    /// any is refused.
    Check {
        /// The files, as in `coordinator.workflows_dir` (one workflow each).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Make a key bound to a tenant and print it, once, as JSON (`key`); only
    /// its hash is stored.
    Create {
        /// The tenant every request with this key acts as.
        #[arg(long)]
        tenant: String,
        /// What the key may do, comma-separated: runs:write (start, signal,
        /// cancel), runs:read, admin.
        #[arg(long)]
        scopes: String,
        /// When the key stops working: a duration (90d, 12h, 30m) or an RFC
        /// 3339 time. Without it, the key works until revoked.
        #[arg(long)]
        expires: Option<String>,
        /// A note for `keys list`: whose key it is.
        #[arg(long)]
        label: Option<String>,
        /// This key's request rate, over `server.requests_per_second`.
        #[arg(long)]
        requests_per_second: Option<u32>,
    },
    /// Print every key (or one tenant's) as JSON lines, without secrets.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a key by its id; its next request is refused.
    Revoke { key_id: String },
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

/// Where the HTTP API is. The key is read from `DUCTOR_API_KEY` only, so
/// that it never shows in a process list.
#[derive(clap::Args)]
struct ApiArgs {
    /// The public listener's URL; default: `server.listen` of the
    /// configuration (https when `server.tls_cert_file` is set).
    #[arg(long, global = true, env = "DUCTOR_URL")]
    url: Option<String>,
    /// PEM file of the CA that signed the server's certificate, for
    /// https (default: the system's bundle).
    #[arg(long, global = true, env = "DUCTOR_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// A readable table, or the API's JSON.
    #[arg(long, global = true, value_enum, default_value = "table")]
    output: operator::Output,
}

impl ApiArgs {
    fn client(&self, config: &Config) -> anyhow::Result<ApiClient> {
        let url = self.url.clone().unwrap_or_else(|| default_url(config));
        let key = std::env::var("DUCTOR_API_KEY").ok();
        let timeout = std::time::Duration::from_millis(config.server.request_timeout_ms)
            + std::time::Duration::from_secs(5);
        ApiClient::new(&url, key, self.ca_file.clone(), timeout)
    }
}

/// The public listener as a client on this host reaches it.
fn default_url(config: &Config) -> String {
    let scheme = if config.server.tls_cert_file.is_some() {
        "https"
    } else {
        "http"
    };
    let mut listen = config.server.listen;
    if listen.ip().is_unspecified() {
        listen.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    format!("{scheme}://{listen}")
}

#[derive(Subcommand)]
enum RunsCommand {
    /// A page of runs, newest first (every page with --all).
    List {
        #[command(flatten)]
        filter: operator::RunFilterArgs,
        /// Runs in a page (the server's default, 50, without it).
        #[arg(long)]
        limit: Option<u32>,
        /// Start after this cursor (the `more: --after` of a page).
        #[arg(long)]
        after: Option<String>,
        /// Follow every page to the last.
        #[arg(long)]
        all: bool,
    },
    /// How many runs the filters find, by status.
    Counts {
        #[command(flatten)]
        filter: operator::RunFilterArgs,
    },
    /// One run: its attempts and its transitions with their effects.
    Show { run_id: String },
    /// Cancel a run (a `wakeup.cancel` through the coordinator).
    Cancel {
        run_id: String,
        #[arg(long)]
        reason: Option<String>,
        /// The cancel's name, recorded in the run's history.
        #[arg(long)]
        action_id: Option<String>,
    },
    /// Retry a failed run from the step it failed in (a `wakeup.retry`
    /// through the coordinator).
    Retry {
        run_id: String,
        #[arg(long)]
        reason: Option<String>,
        /// The retry's idempotency key: sent again with the same one, the
        /// run is retried at most once. The server picks one when absent.
        #[arg(long)]
        action_id: Option<String>,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// A page of dead letters, newest first.
    List {
        #[command(flatten)]
        filter: operator::LetterFilterArgs,
        #[arg(long)]
        limit: Option<u32>,
        /// Start after this id (the `more: --after` of a page).
        #[arg(long)]
        after: Option<i64>,
    },
    /// One letter whole: its key, headers and value, and its replay or discard.
    Show { id: i64 },
    /// Produce a letter's input again to the topic it came from, once;
    /// without an id, the letters the filters find (one page).
    Replay {
        id: Option<i64>,
        #[command(flatten)]
        filter: operator::LetterFilterArgs,
    },
    /// Set a letter aside with a reason: it is never replayed.
    Discard {
        id: i64,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// What waits to be published, per topic, and the parked intents.
    Status,
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
                // A refusal of the API (1) or an API out of reach (3).
                e.downcast_ref::<CliError>()
                    .map_or(ExitCode::FAILURE, |c| ExitCode::from(c.exit_status()))
            }
        }
    })
}

async fn runs(
    client: &ApiClient,
    command: RunsCommand,
    output: operator::Output,
) -> Result<String, CliError> {
    match command {
        RunsCommand::List {
            filter,
            limit,
            after,
            all,
        } => operator::list_runs(client, &filter, limit, after, all, output).await,
        RunsCommand::Counts { filter } => operator::count_runs(client, &filter, output).await,
        RunsCommand::Show { run_id } => operator::show_run(client, &run_id, output).await,
        RunsCommand::Cancel {
            run_id,
            reason,
            action_id,
        } => {
            let args = operator::ActionArgs { reason, action_id };
            operator::cancel_run(client, &run_id, args).await
        }
        RunsCommand::Retry {
            run_id,
            reason,
            action_id,
        } => {
            let args = operator::ActionArgs { reason, action_id };
            operator::retry_run(client, &run_id, args).await
        }
    }
}

async fn dlq(
    client: &ApiClient,
    command: DlqCommand,
    output: operator::Output,
) -> Result<String, CliError> {
    match command {
        DlqCommand::List {
            filter,
            limit,
            after,
        } => operator::list_letters(client, &filter, limit, after, output).await,
        DlqCommand::Show { id } => operator::show_letter(client, id).await,
        DlqCommand::Replay { id, filter } => operator::replay_letters(client, id, &filter).await,
        DlqCommand::Discard { id, reason } => operator::discard_letter(client, id, &reason).await,
    }
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            commands::migrate(&config).await?;
            println!("migrations applied");
        }
        Command::Topics {
            command: TopicsCommand::Create,
        } => {
            for line in commands::create_topics(&config).await? {
                println!("{line}");
            }
        }
        Command::Outbox { api, command } => {
            let client = api.client(&config)?;
            let printed = match command {
                OutboxCommand::Status => operator::outbox_status(&client, api.output).await?,
                OutboxCommand::Redrive { run, topic } => {
                    operator::redrive(&client, run, topic).await?
                }
            };
            println!("{printed}");
        }
        Command::Dlq { api, command } => {
            let client = api.client(&config)?;
            println!("{}", dlq(&client, command, api.output).await?);
        }
        Command::Runs { api, command } => {
            let client = api.client(&config)?;
            println!("{}", runs(&client, command, api.output).await?);
        }
        Command::Serve => {
            let shutdown = CancellationToken::new();
            ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
            ductor::cli::serve::run(config, shutdown).await?;
        }
        Command::Inspect {
            command: InspectCommand::Run { run_id },
        } => {
            let run = commands::inspect_run(&config, &run_id).await?;
            println!("{}", serde_json::to_string_pretty(&run)?);
        }
        Command::Submit(args) => {
            let decision = commands::submit(args.into(), &config).await?;
            println!("{decision}");
        }
        Command::Keys { command } => keys(command, &config).await?,
        Command::Config => println!("{config:#?}"),
        Command::Workflows { command } => workflows(command)?,
        Command::Schemas { out } => {
            for line in commands::write_schemas(&out)? {
                println!("{line}");
            }
        }
    }
    Ok(())
}

fn workflows(command: WorkflowsCommand) -> anyhow::Result<()> {
    let WorkflowsCommand::Check { files } = command;
    let checked = commands::check_workflows(&files);
    for line in &checked.lines {
        println!("{line}");
    }
    if checked.refused > 0 {
        anyhow::bail!(
            "{} of {} workflow files refused",
            checked.refused,
            files.len()
        );
    }
    Ok(())
}

async fn keys(command: KeysCommand, config: &Config) -> anyhow::Result<()> {
    use ductor::cli::keys;
    match command {
        KeysCommand::Create {
            tenant,
            scopes,
            expires,
            label,
            requests_per_second,
        } => {
            let args = keys::CreateArgs {
                tenant,
                scopes,
                expires,
                label,
                requests_per_second,
            };
            println!("{}", keys::create(config, args).await?);
            eprintln!("keep the key now: it is not shown again");
        }
        KeysCommand::List { tenant } => {
            for key in keys::list(config, tenant.as_deref()).await? {
                println!("{key}");
            }
        }
        KeysCommand::Revoke { key_id } => println!("{}", keys::revoke(config, &key_id).await?),
    }
    Ok(())
}

impl From<SubmitArgs> for commands::SubmitArgs {
    fn from(a: SubmitArgs) -> Self {
        commands::SubmitArgs {
            workflow: a.workflow,
            input: a.input,
            tenant: a.tenant,
            pool: a.pool,
            workflow_version: a.workflow_version,
            idempotency_key: a.idempotency_key,
        }
    }
}
