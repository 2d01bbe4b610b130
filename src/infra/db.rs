//! The Postgres pool and migrations.
//!
//! In: the `database` configuration. Out: pools, named in
//! `pg_stat_activity` by their part (`ductor`, `ductor-api`,
//! `ductor-readiness`, `ductor-keys`); the applied migrations and the
//! roles' grants. Guarantees: every session runs under
//! `database.statement_timeout_ms`; [`check_migrated`] refuses a schema
//! that lacks a migration of this binary or has one it does not know, and
//! `ductor migrate` refuses the latter too; a role is granted exactly its
//! list of rights, what it held before revoked in the same transaction.

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

/// Readiness's own pool of one connection (see `infra::health`), named
/// `ductor-readiness`: checking Postgres never takes a connection the
/// ingress or the drainer would wait for.
pub async fn connect_readiness(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    connect_as(config, "ductor-readiness", 1).await
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
/// (`database.app_role`) what `serve` needs and the keys role
/// (`database.keys_role`), when there is one, what `ductor keys` needs.
pub async fn migrate_database(config: &DatabaseConfig) -> anyhow::Result<()> {
    let app_role = config
        .app_role()
        .context("database.url names no role: set database.app_role")?;
    let keys_role = config.keys_role();
    if keys_role.as_deref() == Some(app_role.as_str()) {
        anyhow::bail!(
            "database.keys_role is the application role {app_role:?}: `ductor keys` needs a \
             role of its own (database.keys_url), or serve could mint keys"
        );
    }
    let mut as_migrator = config.clone();
    as_migrator.url = config.migrate_url().clone();
    // One session runs the migrations (holding sqlx's advisory lock), then
    // the grants.
    as_migrator.max_connections = 1;
    as_migrator.min_connections = 0;
    let pool = connect(&as_migrator).await?;
    let result = async {
        refuse_newer_schema(&pool).await?;
        migrate(&pool).await?;
        grant_app_role(&pool, &app_role).await?;
        match &keys_role {
            Some(role) => grant_keys_role(&pool, role).await,
            None => {
                tracing::info!(
                    "database.keys_url names no keys role: nothing granted for `ductor keys`"
                );
                Ok(())
            }
        }
    }
    .await;
    pool.close().await;
    result
}

/// `ductor keys`' pool, of one connection: the keys role's
/// (`database.keys_url`), else the role of `database.url`.
pub async fn connect_keys(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    let mut as_keys = config.clone();
    as_keys.url = config.keys_url().clone();
    as_keys.min_connections = 0;
    connect_as(&as_keys, "ductor-keys", 1).await
}

/// What one role may do in Ductor's schema. Tables are named as the
/// migrations name them; privileges in SQL, with a column list where the
/// role writes only some columns.
struct Grants {
    /// The role's part, for messages.
    name: &'static str,
    /// Each table and the privileges on it.
    tables: &'static [(&'static str, &'static str)],
    /// Functions, with their argument types, that the role calls.
    functions: &'static [&'static str],
    /// USAGE and SELECT on the schema's sequences (the intents' identity).
    sequences: bool,
}

/// What `serve` (and `submit`, `inspect`, `outbox redrive`) does in SQL,
/// table by table, and nothing more.
const SERVE_GRANTS: Grants = Grants {
    name: "application role",
    tables: &[
        // Inserted by the batch statement, whose updates change a run's
        // state under the optimistic lock. What a run is (its id, tenant,
        // pool, workflow and creation) never changes, and only retention's
        // function deletes a run.
        (
            "runs",
            "SELECT, INSERT, UPDATE (status, record_version, last_transition_seq, state, \
             updated_at, finished_at)",
        ),
        // Moved by the batch statement as runs change status (an upsert);
        // retention's function moves them as it deletes runs.
        ("run_counts", "SELECT, INSERT, UPDATE (n)"),
        // The history is appended to, never changed: no UPDATE (the
        // trigger refuses one anyway), no DELETE.
        ("run_transitions", "SELECT, INSERT"),
        // An attempt is inserted, then finished once.
        (
            "run_attempts",
            "SELECT, INSERT, UPDATE (status, finished_at, error)",
        ),
        // Read before a new run is inserted; written and expired only by
        // retention's functions.
        ("run_tombstones", "SELECT"),
        // The outbox, a queue rather than history: intents are inserted,
        // claimed (`FOR UPDATE SKIP LOCKED`), completed, released, parked
        // and redriven; pending timers are cancelled and completed intents
        // purged (DELETE). What an intent carries (its run, position, key,
        // topic, headers, payload, `not_before`) is fixed at commit.
        (
            "eec_effect_intent",
            "SELECT, INSERT, DELETE, UPDATE (status, attempts, claimed_by, claim_expires_at, \
             last_error, completed_at, publish_failures, parked_at, deferred_until)",
        ),
        // Routing keys: reserved (`ON CONFLICT DO UPDATE`), fenced (`FOR
        // UPDATE`), completed, swept and purged; a key's own columns never
        // change.
        (
            "eec_routing_idempotency",
            "SELECT, INSERT, DELETE, UPDATE (status, request_fingerprint, claim_epoch, \
             decision_id, decision, reserved_at, pending_expires_at, expires_at, completed_at, \
             updated_at)",
        ),
        (
            "eec_drainer_member",
            "SELECT, INSERT, DELETE, UPDATE (heartbeat_at)",
        ),
        // Recorded dead letters: the ingress inserts one per refused input
        // (`ON CONFLICT DO NOTHING`: a redelivery adds none); what was read
        // and why it failed never changes. An operator's replay claims and
        // records, a discard notes its reason; only retention's function
        // deletes a letter.
        (
            "dead_letters",
            "SELECT, INSERT (source_topic, source_partition, source_offset, stage, class, error, \
             record_key, key_dropped, headers, headers_dropped, value, value_bytes, input_type, \
             tenant_scope, run_id), UPDATE (replay_id, replay_claimed_at, replayed_at, \
             replayed_partition, replayed_offset, replay_signed, discarded_at, discard_reason)",
        ),
        // Serve checks keys and notes their use. Making, moving, widening
        // and revoking one is `ductor keys`' (the keys role's).
        ("api_keys", "SELECT, UPDATE (last_used_at)"),
        // The start-up check that the schema is current.
        ("_sqlx_migrations", "SELECT"),
    ],
    functions: &[
        // SECURITY INVOKER: runs with serve's own rights.
        "ductor_write_guard(bigint[], bigint[])",
        // SECURITY DEFINER: retention's only way to delete history.
        "ductor_purge_finished_runs(double precision, bigint)",
        "ductor_purge_tombstones(double precision, bigint)",
        "ductor_purge_dead_letters(double precision, bigint)",
    ],
    sequences: true,
};

/// What `ductor keys` does in SQL: make a key (its own columns; the
/// creation time is the database's, and a key is made neither used nor
/// revoked), list keys, revoke one. Nothing of runs, the outbox or
/// routing.
const KEYS_GRANTS: Grants = Grants {
    name: "keys role",
    tables: &[(
        "api_keys",
        "SELECT, INSERT (key_id, tenant_scope, scopes, secret_sha256, label, \
         requests_per_second, expires_at), UPDATE (revoked_at)",
    )],
    functions: &[],
    sequences: false,
};

/// Grants `role` exactly the rights `serve` (and `submit`, `inspect`,
/// `outbox redrive`) needs in the migrator's current schema, and no more:
/// what it held before is revoked first, in the same transaction, so the
/// outcome does not depend on history. Run as the owner of the schema's
/// objects, after the migrations; a no-op when `role` is that owner.
///
/// What serve does in SQL, and so what it gets (`SERVE_GRANTS`, table by
/// table, with the reason for each):
/// - rows: SELECT on every table; INSERT where it adds rows; UPDATE only
///   of the columns it changes (`FOR UPDATE SKIP LOCKED` needs UPDATE of
///   one); DELETE only on the outbox, the routing keys and the drainer
///   members. No DELETE on `runs`, `run_transitions`, `run_attempts` or
///   `run_tombstones` or `dead_letters`, no UPDATE of the history:
///   retention deletes finished runs, expired tombstones and old dead
///   letters through SECURITY DEFINER functions of the migrator, which
///   delete nothing else. On `api_keys`,
///   SELECT and UPDATE of `last_used_at` only: serve cannot make a key,
///   move one to another tenant, widen it or un-revoke it. No TRUNCATE,
///   REFERENCES or TRIGGER anywhere.
/// - the identity sequence of `eec_effect_intent`: USAGE, SELECT.
/// - EXECUTE on `ductor_write_guard` and on the three purge functions.
/// - `LISTEN`/`NOTIFY` (`pg_notify`) need no grant.
/// - CONNECT on the database; no CREATE on it or on the schema, so no DDL.
///
/// No default privileges: a table, sequence or function a later migration
/// makes is nobody's but the migrator's until its grants are written here
/// (the roles test fails on a table serve cannot read). A default of full
/// rows on every new table would hand serve the rights taken away above
/// on the next table of history; the defaults earlier versions set are
/// revoked.
pub async fn grant_app_role(pool: &PgPool, role: &str) -> anyhow::Result<()> {
    grant_role(pool, role, &SERVE_GRANTS).await
}

/// Grants `role` what `ductor keys` needs (`KEYS_GRANTS`): SELECT on
/// `api_keys`, INSERT of a new key's own columns, UPDATE of `revoked_at`;
/// CONNECT and USAGE on the schema; nothing else, and no default
/// privileges. Like [`grant_app_role`], it revokes first and is a no-op
/// when `role` is the owner.
pub async fn grant_keys_role(pool: &PgPool, role: &str) -> anyhow::Result<()> {
    grant_role(pool, role, &KEYS_GRANTS).await
}

async fn grant_role(pool: &PgPool, role: &str, grants: &Grants) -> anyhow::Result<()> {
    let (me, schema, database): (String, Option<String>, String) = sqlx::query_as(
        "SELECT current_user::text, current_schema()::text, current_database()::text",
    )
    .fetch_one(pool)
    .await
    .context("reading the migrator's role and schema")?;
    let part = grants.name;
    if me == role {
        tracing::info!(
            role,
            part,
            "the role is the migrator and owns the schema: nothing to grant"
        );
        return Ok(());
    }
    let schema = schema.context("the migrator's search_path names no schema")?;
    // One simple query of several statements is one transaction.
    sqlx::raw_sql(&grant_statements(role, &schema, &database, grants).join(";\n"))
        .execute(pool)
        .await
        .with_context(|| format!("granting the {part} {role:?} its rights"))?;
    warn_on_ddl_rights(pool, role, &schema).await
}

/// The statements of [`grant_role`], names quoted.
fn grant_statements(role: &str, schema: &str, database: &str, grants: &Grants) -> Vec<String> {
    let (role, schema, database) = (
        quote_ident(role),
        quote_ident(schema),
        quote_ident(database),
    );
    let mut statements = vec![
        format!("REVOKE ALL ON DATABASE {database} FROM {role}"),
        format!("GRANT CONNECT ON DATABASE {database} TO {role}"),
        format!("REVOKE ALL ON SCHEMA {schema} FROM {role}"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        // Column privileges go with their table's.
        format!("REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}"),
        format!("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}"),
        format!("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {role}"),
    ];
    for kind in ["TABLES", "SEQUENCES", "FUNCTIONS"] {
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE ALL ON {kind} FROM {role}"
        ));
    }
    for (table, privileges) in grants.tables {
        let table = quote_ident(table);
        statements.push(format!("GRANT {privileges} ON {schema}.{table} TO {role}"));
    }
    if grants.sequences {
        statements.push(format!(
            "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"
        ));
    }
    for function in grants.functions {
        statements.push(format!(
            "GRANT EXECUTE ON FUNCTION {schema}.{function} TO {role}"
        ));
    }
    statements
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
    .with_context(|| format!("reading the rights of role {role:?}"))?;
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
            "the role can still change the schema, which no command but migrate needs"
        );
    }
    Ok(())
}

/// `name` as a quoted SQL identifier.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// What `ductor migrate` and `serve` tell an operator whose schema lacks
/// migrations.
const PENDING_HINT: &str = "run `ductor migrate` as the migrator (database.migrate_url), \
                            or set database.migrate_on_start = true";

/// A migration, as this binary compiles it in and as `_sqlx_migrations`
/// records it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct MigrationId {
    pub version: i64,
    pub description: String,
}

impl std::fmt::Display for MigrationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.version, self.description)
    }
}

/// A row of `_sqlx_migrations`: a migration applied, or one whose
/// application failed.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct AppliedMigration {
    pub version: i64,
    pub description: String,
    pub success: bool,
}

/// How a database's migrations stand against this binary's, when they do
/// not match.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaMismatch {
    /// The database has a migration this binary does not know: a newer
    /// binary migrated it, and this one could write what the newer ones
    /// cannot read (or fail on what they changed).
    #[error(
        "the database schema has migration {found}, which this binary does not know; the newest \
         it knows is {known}: a newer Ductor has migrated this database, so run the newer \
         binary (serve, submit and migrate alike) instead of this one"
    )]
    Newer {
        found: MigrationId,
        known: MigrationId,
    },
    /// Migrations of this binary not (successfully) applied yet.
    #[error("the database schema lacks {count} migration(s), from {first}: {PENDING_HINT}")]
    Pending { first: MigrationId, count: usize },
}

/// The migrations compiled into this binary, oldest first.
pub fn known_migrations() -> Vec<MigrationId> {
    MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| MigrationId {
            version: m.version,
            description: m.description.to_string(),
        })
        .collect()
}

/// Whether a database with the `applied` migrations is one this binary
/// may write, knowing the migrations `known` (oldest first). Pure. A
/// migration the binary does not know, applied or failed, is the newest
/// such one (a newer binary's schema: refused first, since migrating
/// cannot mend it); else the first of its own not applied.
pub fn schema_mismatch(
    known: &[MigrationId],
    applied: &[AppliedMigration],
) -> Option<SchemaMismatch> {
    let newest_unknown = applied
        .iter()
        .filter(|a| known.iter().all(|k| k.version != a.version))
        .max_by_key(|a| a.version);
    if let (Some(found), Some(newest)) = (newest_unknown, known.iter().max_by_key(|k| k.version)) {
        return Some(SchemaMismatch::Newer {
            found: MigrationId {
                version: found.version,
                description: found.description.clone(),
            },
            known: newest.clone(),
        });
    }
    let mut pending = known
        .iter()
        .filter(|k| !applied.iter().any(|a| a.version == k.version && a.success));
    let first = pending.next()?;
    Some(SchemaMismatch::Pending {
        first: first.clone(),
        count: 1 + pending.count(),
    })
}

/// The rows of `_sqlx_migrations`.
async fn applied_migrations(pool: &PgPool) -> Result<Vec<AppliedMigration>, sqlx::Error> {
    sqlx::query_as("SELECT version, description, success FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
}

/// Fails unless the database's migrations are exactly this binary's:
/// naming the first one missing (a binary that does not migrate must not
/// run on an older schema), or a migration it does not know together with
/// the newest it knows (a binary must not run on a newer binary's schema,
/// whose states and rows it could misread and write back in older shapes).
/// Run by `serve` (unless it migrates itself), `submit` and `outbox
/// redrive` before they write.
pub async fn check_migrated(pool: &PgPool) -> anyhow::Result<()> {
    let applied = applied_migrations(pool)
        .await
        .with_context(|| format!("reading the applied migrations: {PENDING_HINT}"))?;
    match schema_mismatch(&known_migrations(), &applied) {
        Some(mismatch) => Err(mismatch.into()),
        None => Ok(()),
    }
}

/// Fails when the database has a migration this binary does not know,
/// before `ductor migrate` (or `serve` migrating itself) applies its own:
/// an older binary leaves a newer schema alone. A database without
/// migrations yet passes.
async fn refuse_newer_schema(pool: &PgPool) -> anyhow::Result<()> {
    let applied = match applied_migrations(pool).await {
        Ok(applied) => applied,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => return Ok(()),
        Err(e) => return Err(e).context("reading the applied migrations"),
    };
    match schema_mismatch(&known_migrations(), &applied) {
        Some(newer @ SchemaMismatch::Newer { .. }) => Err(newer.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(versions: &[i64]) -> Vec<MigrationId> {
        versions
            .iter()
            .map(|&version| MigrationId {
                version,
                description: format!("m{version}"),
            })
            .collect()
    }

    fn applied(versions: &[(i64, bool)]) -> Vec<AppliedMigration> {
        versions
            .iter()
            .map(|&(version, success)| AppliedMigration {
                version,
                description: format!("m{version}"),
                success,
            })
            .collect()
    }

    #[test]
    fn a_schema_of_exactly_the_known_migrations_matches() {
        let ours = known(&[1, 2, 3]);
        assert_eq!(
            schema_mismatch(&ours, &applied(&[(1, true), (2, true), (3, true)])),
            None
        );
    }

    #[test]
    fn missing_or_failed_migrations_are_pending_from_the_first() {
        let ours = known(&[1, 2, 3]);
        assert_eq!(
            schema_mismatch(&ours, &applied(&[(1, true), (2, false)])),
            Some(SchemaMismatch::Pending {
                first: ours[1].clone(),
                count: 2
            })
        );
        let none = schema_mismatch(&ours, &[]).unwrap();
        let message = none.to_string();
        assert!(
            message.contains("lacks 3 migration(s), from 1 (m1)")
                && message.contains("ductor migrate"),
            "{message}"
        );
    }

    #[test]
    fn a_migration_this_binary_does_not_know_is_a_newer_schema_named_with_the_newest_known() {
        let ours = known(&[1, 2, 3]);
        let newer = applied(&[(1, true), (2, true), (3, true), (4, true), (5, false)]);
        let mismatch = schema_mismatch(&ours, &newer).unwrap();
        assert_eq!(
            mismatch,
            SchemaMismatch::Newer {
                found: MigrationId {
                    version: 5,
                    description: "m5".into()
                },
                known: ours[2].clone(),
            }
        );
        let message = mismatch.to_string();
        assert!(
            message.contains("migration 5 (m5)")
                && message.contains("newest it knows is 3 (m3)")
                && message.contains("run the newer binary"),
            "{message}"
        );
        // Even with one of its own missing: migrating cannot mend a newer
        // schema, so that is what is said.
        let gap = applied(&[(1, true), (4, true)]);
        assert!(matches!(
            schema_mismatch(&ours, &gap),
            Some(SchemaMismatch::Newer { .. })
        ));
    }

    #[test]
    fn the_compiled_migrations_are_ordered_and_distinct() {
        let ours = known_migrations();
        assert!(ours.windows(2).all(|w| w[0].version < w[1].version));
        assert_eq!(ours[0].version, 20261130000001);
    }

    #[test]
    fn names_in_the_grants_are_quoted_identifiers() {
        assert_eq!(quote_ident("ductor"), "\"ductor\"");
        assert_eq!(quote_ident("a\"b; DROP"), "\"a\"\"b; DROP\"");
        for grants in [&SERVE_GRANTS, &KEYS_GRANTS] {
            let statements = grant_statements("app\"x", "public", "db", grants);
            assert!(statements.iter().all(|s| s.contains("\"app\"\"x\"")));
            assert!(
                statements
                    .iter()
                    .all(|s| !s.contains("CREATE") && !s.contains("TRUNCATE"))
            );
        }
    }

    /// What must never be granted, whatever else changes: DELETE on the
    /// history, anything on `api_keys` to serve but reading and noting use,
    /// full rows on new tables by default.
    #[test]
    fn serve_gets_no_delete_on_history_and_no_key_writes() {
        let granted = |grants: &Grants, table: &str| {
            grants
                .tables
                .iter()
                .find(|(t, _)| *t == table)
                .map(|(_, p)| *p)
                .unwrap_or_default()
        };
        for table in [
            "runs",
            "run_transitions",
            "run_attempts",
            "run_tombstones",
            "dead_letters",
        ] {
            assert!(!granted(&SERVE_GRANTS, table).contains("DELETE"), "{table}");
        }
        assert!(!granted(&SERVE_GRANTS, "run_transitions").contains("UPDATE"));
        assert_eq!(
            granted(&SERVE_GRANTS, "api_keys"),
            "SELECT, UPDATE (last_used_at)"
        );
        assert_eq!(KEYS_GRANTS.tables.len(), 1);
        let statements = grant_statements("ductor", "public", "ductor", &SERVE_GRANTS);
        assert!(
            statements
                .iter()
                .filter(|s| s.starts_with("ALTER DEFAULT PRIVILEGES"))
                .all(|s| s.contains(" REVOKE ALL "))
        );
    }
}
