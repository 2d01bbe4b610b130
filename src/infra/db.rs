//! The Postgres pool and migrations.

use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

use crate::config::DatabaseConfig;

/// The schema migrations, compiled into the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The process's pool, for the ingress, the drainer and maintenance.
pub async fn connect(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    connect_as(config, "ductor", config.max_connections).await
}

/// The public API's own pool (`database.api_max_connections`), apart from
/// the process's, and named `ductor-api` in `pg_stat_activity`.
pub async fn connect_api(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    connect_as(config, "ductor-api", config.api_max_connections).await
}

async fn connect_as(config: &DatabaseConfig, name: &str, max: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = config
        .url
        .expose()
        .parse()
        .with_context(|| format!("parsing database url {}", config.url))?;
    let options = session_options(options, config).application_name(name);
    // Tests only connections that have waited in the pool (see
    // `DatabaseConfig::test_idle_after_ms`).
    let test_idle_after = Duration::from_millis(config.test_idle_after_ms);
    PgPoolOptions::new()
        .max_connections(max)
        .min_connections(config.min_connections.min(max))
        .acquire_timeout(Duration::from_millis(config.acquire_timeout_ms))
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= test_idle_after {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .with_context(|| format!("connecting to postgres at {}", config.url))
}

/// The settings every Ductor connection starts with.
pub fn session_options(options: PgConnectOptions, config: &DatabaseConfig) -> PgConnectOptions {
    options.options([("statement_timeout", config.statement_timeout_ms.to_string())])
}

/// Drops database `name` (a trusted identifier) if it exists.
///
/// `WITH (FORCE)` would refuse when an autovacuum worker is busy in the
/// database (a process of another role), so instead: end the sessions of
/// our own role still connected to it, then a plain DROP, which stops
/// autovacuum workers by itself and waits up to 5 s for other sessions to
/// leave. Tried three times, for a session that connected meanwhile.
#[cfg(any(test, feature = "internals"))]
pub async fn drop_database(admin: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let mut result = Ok(());
    for _ in 0..3 {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND usename = current_user AND pid <> pg_backend_pid()",
        )
        .bind(name)
        .execute(admin)
        .await?;
        result = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
            .execute(admin)
            .await
            .map(|_| ());
        if result.is_ok() {
            break;
        }
    }
    result
}

pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR
        .run(pool)
        .await
        .context("applying database migrations")
}
