//! The `[database]` section: where Postgres is, as which roles, and the
//! bounds of the connection pools.
//!
//! In: the URLs of the application role, the migrator and the keys role,
//! the roles `ductor migrate` grants to, and the pools' bounds. Out: the
//! URL and role each command uses ([`DatabaseConfig::migrate_url`],
//! [`DatabaseConfig::keys_url`] and the roles' fallbacks). Guarantees:
//! every URL is a `postgres://` one, every role name fits Postgres's 63
//! bytes, and each pool has at least one connection. Passwords stay in
//! [`DatabaseUrl`], which redacts them.

use serde::{Deserialize, Serialize};

use super::{ConfigError, DatabaseUrl, invalid};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Postgres connection URL, `postgres://user:password@host:port/db`,
    /// of the application role: every command but `ductor migrate`
    /// connects with it. That role needs no DDL rights (`ductor migrate`
    /// grants it what it does need). The password is redacted wherever the
    /// configuration is printed.
    ///
    /// TLS is set in the query, with libpq's names and meanings:
    /// `?sslmode=verify-full&sslrootcert=/etc/ductor/db-ca.pem` encrypts
    /// and checks that the server's certificate chains to that CA and
    /// names the host dialled; `verify-ca` skips the name, `require`
    /// encrypts without checking anything, and the default, `prefer`,
    /// encrypts when the server offers TLS, unchecked, and falls back to
    /// plain text when not. Unlike libpq, the system's trusted roots count
    /// besides `sslrootcert` (sqlx with rustls). A client certificate:
    /// `sslcert` and `sslkey`.
    pub url: DatabaseUrl,
    /// Postgres connection URL of the migrator: a role that owns the schema
    /// and every object the migrations create. `ductor migrate` (and
    /// `serve` with `migrate_on_start`) connects with it; nothing else
    /// does. Unset: `url`, one role for both, which then owns the schema.
    /// Redacted like `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_url: Option<DatabaseUrl>,
    /// The role to which `ductor migrate` grants what `serve` needs (and
    /// nothing else: what it held before is revoked): CONNECT, USAGE on
    /// the schema, and table by table the statements serve runs (SELECT
    /// everywhere, INSERT where it adds rows, UPDATE of the columns it
    /// changes, DELETE only of outbox, routing and drainer rows; on
    /// `api_keys` only SELECT and UPDATE of `last_used_at`); EXECUTE on
    /// the write guard and on retention's purge functions, its only way to
    /// delete runs and their history. Nothing by default on what later
    /// migrations create. Unset: the user of `url`. Nothing is granted
    /// when it is the migrator itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_role: Option<String>,
    /// Postgres connection URL of the keys role, for `ductor keys` (and
    /// nothing else): it may make, list and revoke API keys and touches no
    /// other table. Unset: `url`, which works only where that role owns
    /// the schema (one role for everything); with a separate application
    /// role, `ductor keys` is then refused and says to set this. Redacted
    /// like `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys_url: Option<DatabaseUrl>,
    /// The role to which `ductor migrate` grants what `ductor keys` needs:
    /// SELECT on `api_keys`, INSERT of a new key's own columns, UPDATE of
    /// `revoked_at`, CONNECT and USAGE on the schema; nothing else. Unset:
    /// the user of `keys_url`, and no keys role at all when `keys_url` is
    /// unset too. Must differ from `app_role`, or serve could mint keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys_role: Option<String>,
    /// Upper bound on pooled connections per process, for the ingress,
    /// the drainer and maintenance.
    pub max_connections: u32,
    /// Connections of the public API's own pool, apart from
    /// `max_connections`, so that callers, however many, cannot take the
    /// connections the ingress and the drainer need. A request that finds
    /// them all busy waits up to `acquire_timeout_ms`, then gets 503.
    pub api_max_connections: u32,
    /// Connections kept open while idle.
    pub min_connections: u32,
    /// How long a task waits for a pooled connection before failing.
    pub acquire_timeout_ms: u64,
    /// A pooled connection that has been idle at least this long is tested
    /// with a round trip before it is handed out, so that one the server
    /// closed meanwhile (a restart, an idle timeout) is replaced instead of
    /// failing its next statement. A connection returned more recently is
    /// handed out untested: under load each apply lane takes one per batch,
    /// and the test cost a batch 1.3-2.1 ms of a cycle of about 10-15 ms
    /// (`ductor-bench --latency-at 1300 --loads 50` on two cores). A
    /// statement on a connection that died within this window fails, and
    /// its batch is retried like after any database error. 0 tests every
    /// connection.
    pub test_idle_after_ms: u64,
    /// `statement_timeout` set on every connection, so a stuck statement
    /// cannot hold a batch (and its partition) forever.
    pub statement_timeout_ms: u64,
    /// Apply pending migrations, as the migrator (`migrate_url`), when
    /// `serve` starts. Off by default: migrating is `ductor migrate`'s job,
    /// and `serve` then only checks that every migration it knows is
    /// applied, and refuses to start on an older schema.
    pub migrate_on_start: bool,
}

impl DatabaseConfig {
    /// The URL migrations run with: `migrate_url`, else `url`.
    pub fn migrate_url(&self) -> &DatabaseUrl {
        self.migrate_url.as_ref().unwrap_or(&self.url)
    }

    /// The role `ductor migrate` grants serve's rights to: `app_role`,
    /// else the user of `url`.
    pub fn app_role(&self) -> Option<String> {
        self.app_role.clone().or_else(|| self.url.user())
    }

    /// The URL `ductor keys` connects with: `keys_url`, else `url`.
    pub fn keys_url(&self) -> &DatabaseUrl {
        self.keys_url.as_ref().unwrap_or(&self.url)
    }

    /// The role `ductor migrate` grants the rights of `ductor keys` to:
    /// `keys_role`, else the user of `keys_url`; none when neither is set.
    pub fn keys_role(&self) -> Option<String> {
        self.keys_role
            .clone()
            .or_else(|| self.keys_url.as_ref().and_then(DatabaseUrl::user))
    }
}

impl DatabaseConfig {
    /// The URLs, the role names and the pools.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let postgres = |url: &DatabaseUrl| {
            url::Url::parse(url.expose())
                .is_ok_and(|u| matches!(u.scheme(), "postgres" | "postgresql"))
        };
        if !postgres(&self.url) {
            return Err(invalid("database.url", "must be a postgres:// URL"));
        }
        if !self.migrate_url.as_ref().is_none_or(postgres) {
            return Err(invalid("database.migrate_url", "must be a postgres:// URL"));
        }
        if !self.keys_url.as_ref().is_none_or(postgres) {
            return Err(invalid("database.keys_url", "must be a postgres:// URL"));
        }
        for (key, role) in [
            ("database.app_role", &self.app_role),
            ("database.keys_role", &self.keys_role),
        ] {
            if let Some(role) = role
                && (role.is_empty() || role.len() > 63)
            {
                return Err(invalid(key, "must be 1 to 63 bytes"));
            }
        }
        if self.max_connections == 0 {
            return Err(invalid("database.max_connections", "must be at least 1"));
        }
        if self.min_connections > self.max_connections {
            return Err(invalid(
                "database.min_connections",
                "must not exceed database.max_connections",
            ));
        }
        if self.api_max_connections == 0 {
            return Err(invalid(
                "database.api_max_connections",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
