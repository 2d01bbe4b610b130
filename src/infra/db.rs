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

/// Retention's one loop: runs `sql`, a delete of at most `$2` rows older
/// than `$1` seconds, until a statement deletes less than a batch or
/// `max_rounds` statements ran; returns how many rows went. `sql` is a
/// DELETE, or a SELECT of the rows a purge function deleted (Postgres
/// reports as affected the rows a SELECT returned). Each statement stays
/// short, so that retention never holds locks or a snapshot long.
pub async fn delete_in_rounds(
    pool: &PgPool,
    sql: &str,
    age: std::time::Duration,
    batch: usize,
    max_rounds: u32,
) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    for _ in 0..max_rounds {
        let deleted = sqlx::query(sql)
            .bind(age.as_secs_f64())
            .bind(batch as i64)
            .execute(pool)
            .await?
            .rows_affected();
        total += deleted;
        if deleted < batch as u64 {
            break;
        }
    }
    Ok(total)
}

/// Drops database `name` (a trusted identifier) if it exists.
///
/// `WITH (FORCE)` would refuse when an autovacuum worker is busy in the
/// database (a process of another role), so instead: end the sessions of
/// our own role, and of the roles it is a member of (the application
/// role, in the local stack), still connected to it, then a plain DROP,
/// which stops autovacuum workers by itself and waits up to 5 s for other
/// sessions to leave. Tried three times, for a session that connected
/// meanwhile.
#[cfg(any(test, feature = "internals"))]
pub async fn drop_database(admin: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let mut result = Ok(());
    for _ in 0..3 {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid() \
               AND pg_has_role(current_user, usesysid, 'MEMBER')",
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

/// Applies the pending migrations on `pool`, whose role becomes the owner
/// of what they create. Grants nothing: see [`migrate_database`].
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR
        .run(pool)
        .await
        .context("applying database migrations")
}

/// `ductor migrate`: connects as the migrator (`database.migrate_url`),
/// applies the pending migrations, and grants the application role
/// (`database.app_role`) what `serve` needs.
pub async fn migrate_database(config: &DatabaseConfig) -> anyhow::Result<()> {
    let app_role = config
        .app_role()
        .context("database.url names no role: set database.app_role")?;
    let mut as_migrator = config.clone();
    as_migrator.url = config.migrate_url().clone();
    // One session runs the migrations (holding sqlx's advisory lock), then
    // the grants.
    as_migrator.max_connections = 1;
    as_migrator.min_connections = 0;
    let pool = connect(&as_migrator).await?;
    let result = async {
        migrate(&pool).await?;
        grant_app_role(&pool, &app_role).await
    }
    .await;
    pool.close().await;
    result
}

/// Grants `role` exactly the rights `serve` (and `submit`, `inspect`,
/// `outbox redrive`) needs in the migrator's current schema, and no more:
/// what it held before is revoked first, in the same transaction, so the
/// outcome does not depend on history. Run as the owner of the schema's
/// objects, after the migrations; a no-op when `role` is that owner.
///
/// What serve does in SQL, and so what it gets:
/// - reads and writes rows of Ductor's tables: SELECT, INSERT, UPDATE,
///   DELETE (`FOR UPDATE SKIP LOCKED` needs UPDATE; retention and the
///   routing purge delete). No TRUNCATE, REFERENCES or TRIGGER.
/// - the identity sequence of `eec_effect_intent`: USAGE, SELECT.
/// - `ductor_write_guard` (SECURITY INVOKER, so it runs with serve's own
///   rights) and the append-only trigger's function: EXECUTE.
/// - `_sqlx_migrations`: SELECT only, for the start-up check that the
///   schema is current ([`check_migrated`]).
/// - `LISTEN`/`NOTIFY` (`pg_notify`) need no grant.
/// - CONNECT on the database; no CREATE on it or on the schema, so no DDL.
///
/// Default privileges give the same rights on tables, sequences and
/// functions the migrator creates later, so a new migration's table is
/// usable by serve without another grant.
pub async fn grant_app_role(pool: &PgPool, role: &str) -> anyhow::Result<()> {
    let (me, schema, database): (String, Option<String>, String) = sqlx::query_as(
        "SELECT current_user::text, current_schema()::text, current_database()::text",
    )
    .fetch_one(pool)
    .await
    .context("reading the migrator's role and schema")?;
    if me == role {
        tracing::info!(
            role,
            "the application role is the migrator and owns the schema: nothing to grant"
        );
        return Ok(());
    }
    let schema = schema.context("the migrator's search_path names no schema")?;
    // One simple query of several statements is one transaction.
    sqlx::raw_sql(&grant_statements(role, &schema, &database).join(";\n"))
        .execute(pool)
        .await
        .with_context(|| format!("granting the application role {role:?} its rights"))?;
    warn_on_ddl_rights(pool, role, &schema).await
}

/// The statements of [`grant_app_role`], names quoted.
fn grant_statements(role: &str, schema: &str, database: &str) -> Vec<String> {
    let (role, schema, database) = (
        quote_ident(role),
        quote_ident(schema),
        quote_ident(database),
    );
    let rows = "SELECT, INSERT, UPDATE, DELETE";
    let migrations = format!("{schema}._sqlx_migrations");
    vec![
        format!("REVOKE ALL ON DATABASE {database} FROM {role}"),
        format!("GRANT CONNECT ON DATABASE {database} TO {role}"),
        format!("REVOKE ALL ON SCHEMA {schema} FROM {role}"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}"),
        format!("GRANT {rows} ON ALL TABLES IN SCHEMA {schema} TO {role}"),
        format!("REVOKE INSERT, UPDATE, DELETE ON {migrations} FROM {role}"),
        format!("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}"),
        format!("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
        format!("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role}"),
        format!("ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT {rows} ON TABLES TO {role}"),
        format!(
            "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT ON SEQUENCES TO {role}"
        ),
        format!("ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT EXECUTE ON FUNCTIONS TO {role}"),
    ]
}

/// Warns when `role` can still change the schema after the grants: it is
/// a superuser, or has the rights of the database's or a table's owner, or
/// may create in the database or the schema. Grants cannot take such
/// rights away; the operator has to (`scripts/stack` shows how).
async fn warn_on_ddl_rights(pool: &PgPool, role: &str, schema: &str) -> anyhow::Result<()> {
    let rights: Option<(bool, bool, bool, bool, bool)> = sqlx::query_as(
        "SELECT r.rolsuper, pg_has_role(r.oid, d.datdba, 'USAGE'), \
                has_database_privilege(r.oid, d.oid, 'CREATE'), \
                has_schema_privilege(r.oid, n.oid, 'CREATE'), \
                EXISTS (SELECT FROM pg_class c WHERE c.relnamespace = n.oid \
                          AND pg_has_role(r.oid, c.relowner, 'USAGE')) \
         FROM pg_roles r, pg_database d, pg_namespace n \
         WHERE r.rolname = $1 AND d.datname = current_database() AND n.nspname = $2",
    )
    .bind(role)
    .bind(schema)
    .fetch_optional(pool)
    .await
    .context("reading the application role's rights")?;
    if let Some((superuser, owns_database, creates_schemas, creates_in_schema, owns_tables)) =
        rights
        && (superuser || owns_database || creates_schemas || creates_in_schema || owns_tables)
    {
        tracing::warn!(
            role,
            superuser,
            owns_database,
            creates_schemas,
            creates_in_schema,
            owns_tables,
            "the application role can still change the schema, which serve never needs"
        );
    }
    Ok(())
}

/// `name` as a quoted SQL identifier.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Fails unless every migration of this binary is applied, naming the
/// first one missing: a `serve` that does not migrate must not run on an
/// older schema. Migrations applied by a newer binary are fine.
pub async fn check_migrated(pool: &PgPool) -> anyhow::Result<()> {
    const HINT: &str = "run `ductor migrate` as the migrator (database.migrate_url), \
                        or set database.migrate_on_start = true";
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(pool)
            .await
            .with_context(|| format!("reading the applied migrations: {HINT}"))?;
    let mut missing = MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version));
    if let Some(first) = missing.next() {
        anyhow::bail!(
            "the database schema lacks {} migration(s), from {} {}: {HINT}",
            1 + missing.count(),
            first.version,
            first.description
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_the_grants_are_quoted_identifiers() {
        assert_eq!(quote_ident("ductor"), "\"ductor\"");
        assert_eq!(quote_ident("a\"b; DROP"), "\"a\"\"b; DROP\"");
        let statements = grant_statements("app\"x", "public", "db");
        assert!(statements.iter().all(|s| s.contains("\"app\"\"x\"")));
        assert!(
            statements
                .iter()
                .all(|s| !s.contains("CREATE") && !s.contains("TRUNCATE"))
        );
    }
}
