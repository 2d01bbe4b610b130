//! The Postgres pool and migrations.

use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::DatabaseConfig;

/// The schema migrations, compiled into the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub async fn connect(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = config
        .url
        .expose()
        .parse()
        .with_context(|| format!("parsing database url {}", config.url))?;
    let options = session_options(options, config).application_name("ductor");
    PgPoolOptions::new()
        .max_connections(config.max_connections)
        .min_connections(config.min_connections)
        .acquire_timeout(Duration::from_millis(config.acquire_timeout_ms))
        .connect_with(options)
        .await
        .with_context(|| format!("connecting to postgres at {}", config.url))
}

/// The settings every Ductor connection starts with.
pub fn session_options(options: PgConnectOptions, config: &DatabaseConfig) -> PgConnectOptions {
    options.options([("statement_timeout", config.statement_timeout_ms.to_string())])
}

pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR
        .run(pool)
        .await
        .context("applying database migrations")
}
