//! The bench's private world: its own database and randomly prefixed topics,
//! created at the start and removed at the end, so runs never see each
//! other's data.

use std::path::PathBuf;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use ductor::config::{Config, DatabaseUrl};
use ductor_testkit::scratch::{ScratchDatabase, ScratchTopics};

/// The pool of the bench workflow's steps.
pub const POOL: &str = "bench";
/// The bench workflow's name.
pub const WORKFLOW: &str = "bench";
/// Steps of the bench workflow.
pub const STEPS: u32 = 3;
/// Inputs one run of the bench workflow needs: its start and one result per step.
pub const INPUTS_PER_RUN: u32 = STEPS + 1;
/// Step timeout: far beyond any phase, so no timeout timer falls due while
/// the bench runs (they stay pending in the outbox, as in production).
const STEP_TIMEOUT_MS: u64 = 3_600_000;
/// Ductor's tables, which every phase empties and analyses.
const TABLES: &str = "runs, run_transitions, run_attempts, eec_effect_intent";
/// Connections of the bench's own pool (progress queries, seeding).
const BENCH_POOL_CONNECTIONS: u32 = 4;

/// The workflow every phase runs: three steps on pool `bench`, one attempt
/// each, no output topic (completion is the `run.succeeded` transition).
pub fn workflow_toml() -> String {
    let mut toml = format!("name = \"{WORKFLOW}\"\nversion = 1\n");
    for step in 1..=STEPS {
        toml.push_str(&format!(
            "\n[[steps]]\nname = \"s{step}\"\npool = \"{POOL}\"\ntimeout_ms = {STEP_TIMEOUT_MS}\n\n\
             [steps.retry]\nmax_attempts = 1\n"
        ));
    }
    toml
}

/// The bench's database, topics and workflow directory.
pub struct BenchEnv {
    /// The user's configuration, pointed at the bench database.
    pub base: Config,
    /// A pool on the bench database for the bench's own queries, as the
    /// application role, like the pipelines'.
    pub pool: PgPool,
    /// A connection of the bench database's owner, the migrator, for what
    /// the application role may not do (TRUNCATE, ANALYZE).
    owner: PgPool,
    pub db_name: String,
    pub db_url: String,
    /// Random part of every name this run creates.
    pub tag: String,
    /// Which processes count as the stack's Postgres and Kafka.
    pub cpu: super::stats::CpuScope,
    admin_url: String,
    scratch: ScratchDatabase,
    topics: ScratchTopics,
    workflows: PathBuf,
}

impl BenchEnv {
    /// Creates `ductor_bench_<random>` on the configured server as the
    /// migrator (`database.migrate_url`), migrates it as `ductor migrate`
    /// does, and writes the bench workflow to a temporary directory.
    pub async fn create(config: &Config) -> anyhow::Result<BenchEnv> {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
        let admin_url = config.database.migrate_url().expose().to_string();
        let scratch = ScratchDatabase::create(&admin_url, &format!("ductor_bench_{tag}_")).await?;
        let db_name = scratch.name.clone();
        let db_url = scratch.url_for(config.database.url.expose())?;

        let mut base = config.clone();
        base.database.url = DatabaseUrl::new(db_url.clone());
        base.database.migrate_url = Some(DatabaseUrl::new(scratch.url_for(&admin_url)?));
        base.database.migrate_on_start = false;
        let workflows = std::env::temp_dir().join(format!("ductor-bench-{tag}"));
        std::fs::create_dir_all(&workflows).context("creating the workflow directory")?;
        std::fs::write(workflows.join("bench.toml"), workflow_toml())
            .context("writing the bench workflow")?;
        base.coordinator.workflows_dir = workflows.clone();
        base.kafka.step_pools = vec![POOL.to_string()];
        base.kafka.extra_topics = Vec::new();
        // Ports of their own, so that a bench beside a running serve (or
        // another bench) binds.
        base.server.listen = "127.0.0.1:0".parse().context("parsing listen address")?;
        base.server.admin_listen = "127.0.0.1:0"
            .parse()
            .context("parsing admin listen address")?;

        ductor::infra::db::migrate_database(&base.database).await?;
        let env = BenchEnv {
            pool: PgPoolOptions::new()
                .max_connections(BENCH_POOL_CONNECTIONS)
                .connect_with(connect_options(&base)?)
                .await
                .with_context(|| format!("connecting to {db_name}"))?,
            owner: admin_pool(base.database.migrate_url().expose()).await?,
            cpu: super::stats::CpuScope::new(&db_name, &base.kafka.bootstrap_servers),
            base,
            db_name,
            db_url,
            tag,
            admin_url,
            scratch,
            topics: ScratchTopics::default(),
            workflows,
        };
        Ok(env)
    }

    pub fn workflows_dir(&self) -> PathBuf {
        self.workflows.clone()
    }

    /// A configuration of its own for one pipeline: topic prefix
    /// `bench-<tag>-<name>.` and consumer group `bench-<tag>-<name>`.
    pub fn pipeline_config(&self, name: &str) -> Config {
        let mut config = self.base.clone();
        let prefix = format!("bench-{}-{name}", self.tag);
        config.kafka.topic_prefix = format!("{prefix}.");
        config.kafka.group_id = prefix;
        config
    }

    /// Creates every topic of `config`, remembering them for [`BenchEnv::cleanup`].
    pub async fn create_topics(&self, config: &Config) -> anyhow::Result<()> {
        let topics = config.all_topics();
        self.topics.own(topics.iter().cloned());
        ductor::infra::kafka::ensure_topics(&config.kafka, &topics, config.kafka.partitions)
            .await?;
        Ok(())
    }

    /// `ALTER DATABASE .. SET synchronous_commit`; applies to sessions opened
    /// afterwards, so call it before a pipeline connects. Returns the value a
    /// new session sees.
    pub async fn set_synchronous_commit(&self, on: bool) -> anyhow::Result<String> {
        let admin = admin_pool(&self.admin_url).await?;
        let value = if on { "on" } else { "off" };
        sqlx::query(&format!(
            "ALTER DATABASE {} SET synchronous_commit = {value}",
            self.db_name
        ))
        .execute(&admin)
        .await
        .context("setting synchronous_commit")?;
        admin.close().await;
        let check = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(connect_options(&self.base)?)
            .await
            .context("connecting to check synchronous_commit")?;
        let seen: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&check)
            .await?;
        check.close().await;
        anyhow::ensure!(
            seen == value,
            "synchronous_commit is {seen} in a new session, expected {value}"
        );
        Ok(seen)
    }

    /// Empties Ductor's tables, so every phase starts from the same state.
    pub async fn truncate(&self) -> anyhow::Result<()> {
        self.execute(
            &format!("TRUNCATE {TABLES} CASCADE"),
            "truncating the bench tables",
        )
        .await
    }

    /// Refreshes the planner statistics of Ductor's tables. A running
    /// system has autovacuum keep them current; a bench phase is shorter
    /// than its first round, and plans made for empty tables would measure
    /// the planner, not Ductor.
    pub async fn analyze(&self) -> anyhow::Result<()> {
        self.execute(&format!("ANALYZE {TABLES}"), "analysing the bench tables")
            .await
    }

    /// Runs `sql`, one or more statements without parameters, on the bench
    /// database as its owner, for tables of the bench's own; `what` names
    /// it in an error.
    pub async fn as_owner(&self, sql: &str, what: &'static str) -> anyhow::Result<()> {
        sqlx::raw_sql(sql)
            .execute(&self.owner)
            .await
            .context(what)?;
        Ok(())
    }

    /// Connection options of the bench database's owner, with Ductor's
    /// session settings, for clients of tables the bench owns.
    pub fn owner_connect_options(&self) -> anyhow::Result<PgConnectOptions> {
        let options: PgConnectOptions = self
            .base
            .database
            .migrate_url()
            .expose()
            .parse()
            .context("parsing the bench database's owner url")?;
        Ok(
            ductor::infra::db::session_options(options, &self.base.database)
                .application_name("ductor-bench"),
        )
    }

    /// Runs `sql` on the bench database as its owner; `what` names it in
    /// an error.
    async fn execute(&self, sql: &str, what: &'static str) -> anyhow::Result<()> {
        sqlx::query(sql).execute(&self.owner).await.context(what)?;
        Ok(())
    }

    /// Drops the database and deletes the topics; reports what it could not do.
    pub async fn cleanup(self) -> anyhow::Result<()> {
        self.pool.close().await;
        self.owner.close().await;
        let mut problems = Vec::new();
        if let Err(e) = std::fs::remove_dir_all(&self.workflows) {
            problems.push(format!("removing {}: {e}", self.workflows.display()));
        }
        if let Err(e) = self.scratch.drop().await {
            problems.push(format!("{e:#}"));
        }
        if let Err(e) = self.topics.delete(&self.base.kafka).await {
            problems.push(format!("{e:#}"));
        }
        anyhow::ensure!(problems.is_empty(), "cleanup: {}", problems.join("; "));
        Ok(())
    }
}

async fn admin_pool(url: &str) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .context("connecting to postgres as the migrator (database.migrate_url)")
}

/// Connection options for the bench database, as Ductor's own pool sets them.
pub fn connect_options(config: &Config) -> anyhow::Result<PgConnectOptions> {
    let options: PgConnectOptions = config
        .database
        .url
        .expose()
        .parse()
        .context("parsing the bench database url")?;
    // The baselines run Ductor's statements with Ductor's session settings.
    Ok(
        ductor::infra::db::session_options(options, &config.database)
            .application_name("ductor-bench"),
    )
}
