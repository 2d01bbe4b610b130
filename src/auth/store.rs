//! The `api_keys` table: issue, look up, note use, list, revoke.
//!
//! In: a [`NewKey`] with its [`KeyRequest`], or a key id. Out: rows of
//! `api_keys` as a [`StoredKey`] (to verify) or a [`KeyInfo`] (to show,
//! without the secret's hash), and what a revocation found ([`Revoked`]).
//! Guarantees: expiry and revocation are judged by the database's clock;
//! `last_used_at` is written at most once per [`LAST_USED_RESOLUTION_S`]
//! per key; a scope name this build does not know grants nothing.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};

use super::key::{NewKey, Scope, StoredKey};

/// What `ductor keys create` asks for.
#[derive(Debug, Clone)]
pub struct KeyRequest {
    pub tenant: String,
    pub scopes: Vec<Scope>,
    pub label: Option<String>,
    pub requests_per_second: Option<u32>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// A key as `ductor keys list` shows it: everything but its secret.
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    pub key_id: String,
    pub tenant: String,
    pub scopes: Vec<&'static str>,
    pub label: Option<String>,
    pub requests_per_second: Option<i32>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

fn scope_names(scopes: &[Scope]) -> Vec<&'static str> {
    scopes.iter().map(|s| s.as_str()).collect()
}

/// Scopes as stored; a name this build does not know is left out (it grants
/// nothing here).
fn scopes_of(names: &[String]) -> Vec<Scope> {
    names.iter().filter_map(|n| Scope::parse(n)).collect()
}

pub async fn insert(pool: &PgPool, key: &NewKey, request: &KeyRequest) -> sqlx::Result<KeyInfo> {
    let row = sqlx::query(
        "INSERT INTO api_keys (key_id, tenant_scope, scopes, secret_sha256, label, \
             requests_per_second, expires_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING created_at",
    )
    .bind(&key.key_id)
    .bind(&request.tenant)
    .bind(scope_names(&request.scopes))
    .bind(&key.secret_sha256[..])
    .bind(&request.label)
    .bind(request.requests_per_second.map(|n| n as i32))
    .bind(request.expires_at)
    .fetch_one(pool)
    .await?;
    Ok(KeyInfo {
        key_id: key.key_id.clone(),
        tenant: request.tenant.clone(),
        scopes: scope_names(&request.scopes),
        label: request.label.clone(),
        requests_per_second: request.requests_per_second.map(|n| n as i32),
        created_at: row.try_get("created_at")?,
        expires_at: request.expires_at,
        last_used_at: None,
        revoked_at: None,
    })
}

/// The row of `key_id`, whatever its state.
pub async fn load(pool: &PgPool, key_id: &str) -> sqlx::Result<Option<StoredKey>> {
    let row = sqlx::query(
        "SELECT key_id, tenant_scope, scopes, secret_sha256, requests_per_second, \
             COALESCE(expires_at <= now(), false) AS expired, \
             revoked_at IS NOT NULL AS revoked, \
             (last_used_at IS NULL \
               OR last_used_at < now() - make_interval(secs => $2)) AS use_unnoted \
         FROM api_keys WHERE key_id = $1",
    )
    .bind(key_id)
    .bind(LAST_USED_RESOLUTION_S as f64)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let scopes: Vec<String> = row.try_get("scopes")?;
    Ok(Some(StoredKey {
        key_id: row.try_get("key_id")?,
        tenant: row.try_get("tenant_scope")?,
        scopes: scopes_of(&scopes),
        secret_sha256: row.try_get("secret_sha256")?,
        requests_per_second: row
            .try_get::<Option<i32>, _>("requests_per_second")?
            .map(|n| n.max(1) as u32),
        expired: row.try_get("expired")?,
        revoked: row.try_get("revoked")?,
        use_unnoted: row.try_get("use_unnoted")?,
    }))
}

/// How stale `last_used_at` may get: it is written at most this often per
/// key, so that a busy key costs no write per request.
pub const LAST_USED_RESOLUTION_S: i64 = 60;

/// Notes that `key_id` was used just now, unless it was within the
/// resolution.
pub async fn touch(pool: &PgPool, key_id: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE api_keys SET last_used_at = now() WHERE key_id = $1 \
           AND (last_used_at IS NULL OR last_used_at < now() - make_interval(secs => $2))",
    )
    .bind(key_id)
    .bind(LAST_USED_RESOLUTION_S as f64)
    .execute(pool)
    .await?;
    Ok(())
}

/// Every key, or one tenant's, oldest first.
pub async fn list(pool: &PgPool, tenant: Option<&str>) -> sqlx::Result<Vec<KeyInfo>> {
    let rows = sqlx::query(
        "SELECT key_id, tenant_scope, scopes, label, requests_per_second, created_at, \
             expires_at, last_used_at, revoked_at \
         FROM api_keys WHERE $1::text IS NULL OR tenant_scope = $1 \
         ORDER BY created_at, key_id",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            let scopes: Vec<String> = row.try_get("scopes")?;
            Ok(KeyInfo {
                key_id: row.try_get("key_id")?,
                tenant: row.try_get("tenant_scope")?,
                scopes: scope_names(&scopes_of(&scopes)),
                label: row.try_get("label")?,
                requests_per_second: row.try_get("requests_per_second")?,
                created_at: row.try_get("created_at")?,
                expires_at: row.try_get("expires_at")?,
                last_used_at: row.try_get("last_used_at")?,
                revoked_at: row.try_get("revoked_at")?,
            })
        })
        .collect()
}

/// What revoking a key found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revoked {
    Now,
    Already,
    NoSuchKey,
}

/// Revokes `key_id` from now on; the next request with it is refused.
pub async fn revoke(pool: &PgPool, key_id: &str) -> sqlx::Result<Revoked> {
    let was: Option<Option<DateTime<Utc>>> = sqlx::query_scalar(
        "WITH old AS (SELECT key_id, revoked_at FROM api_keys WHERE key_id = $1 FOR UPDATE), \
              new AS (UPDATE api_keys k SET revoked_at = now() FROM old \
                      WHERE k.key_id = old.key_id AND old.revoked_at IS NULL) \
         SELECT revoked_at FROM old",
    )
    .bind(key_id)
    .fetch_optional(pool)
    .await?;
    Ok(match was {
        None => Revoked::NoSuchKey,
        Some(None) => Revoked::Now,
        Some(Some(_)) => Revoked::Already,
    })
}
