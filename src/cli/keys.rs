//! `ductor keys`: the API keys of the public listener. A key is printed
//! once, when it is made; the database keeps only its hash.
//!
//! Every subcommand connects as the keys role (`database.keys_url`), the
//! only role besides the migrator that may make or revoke a key: `serve`'s
//! role may only read keys and note their use.
//!
//! In: the [`Config`] and the flags ([`CreateArgs`], a tenant, a key id).
//! Out: JSON: a new key with its row (the only time the key is shown), the
//! keys without their secrets, or a revocation. Guarantees: a tenant,
//! label, rate, scope list or expiry out of bounds is refused before
//! anything is written, naming its flag; a refusal for want of a privilege
//! says to set `database.keys_url`.

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::auth::key::{self, parse_expiry, parse_scopes};
use crate::auth::store::{self, KeyRequest, Revoked};
use crate::config::Config;

/// What `ductor keys create` was asked for, as typed.
pub struct CreateArgs {
    pub tenant: String,
    pub scopes: String,
    pub expires: Option<String>,
    pub label: Option<String>,
    pub requests_per_second: Option<u32>,
}

/// Makes a key and returns it with its row, as JSON: the only time the key
/// itself is shown.
pub async fn create(config: &Config, args: CreateArgs) -> anyhow::Result<Value> {
    let request = request(args, chrono::Utc::now())?;
    let pool = pool(config).await?;
    let new = key::generate().context("reading the system's random source")?;
    let info = store::insert(&pool, &new, &request)
        .await
        .map_err(|e| refused_hint(e, "storing the key"))?;
    let mut out = serde_json::to_value(info)?;
    out["key"] = json!(new.token);
    Ok(out)
}

fn request(args: CreateArgs, now: chrono::DateTime<chrono::Utc>) -> anyhow::Result<KeyRequest> {
    if !crate::contract::input::is_id(&args.tenant) {
        bail!("--tenant: 1 to 128 characters of [A-Za-z0-9_.:-]");
    }
    if args.label.as_ref().is_some_and(|l| l.chars().count() > 200) {
        bail!("--label: at most 200 characters");
    }
    if args
        .requests_per_second
        .is_some_and(|n| n == 0 || n > i32::MAX as u32)
    {
        bail!("--requests-per-second: between 1 and {}", i32::MAX);
    }
    let scopes = parse_scopes(&args.scopes).map_err(|e| anyhow::anyhow!("--scopes: {e}"))?;
    let expires_at = args
        .expires
        .map(|text| parse_expiry(&text, now))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--expires: {e}"))?;
    Ok(KeyRequest {
        tenant: args.tenant,
        scopes,
        label: args.label,
        requests_per_second: args.requests_per_second,
        expires_at,
    })
}

/// Every key (or one tenant's), without secrets, a JSON value per key.
pub async fn list(config: &Config, tenant: Option<&str>) -> anyhow::Result<Vec<Value>> {
    let pool = pool(config).await?;
    let keys = store::list(&pool, tenant)
        .await
        .map_err(|e| refused_hint(e, "listing keys"))?;
    keys.into_iter()
        .map(|k| serde_json::to_value(k).map_err(Into::into))
        .collect()
}

/// Revokes a key by its id; its next request is refused.
pub async fn revoke(config: &Config, key_id: &str) -> anyhow::Result<Value> {
    let pool = pool(config).await?;
    let revoked = store::revoke(&pool, key_id)
        .await
        .map_err(|e| refused_hint(e, "revoking"))?;
    match revoked {
        Revoked::Now => Ok(json!({"key_id": key_id, "revoked": true})),
        Revoked::Already => Ok(json!({"key_id": key_id, "revoked": true, "already": true})),
        Revoked::NoSuchKey => bail!("no key with id {key_id:?}"),
    }
}

/// Postgres' `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

async fn pool(config: &Config) -> anyhow::Result<PgPool> {
    crate::infra::db::connect_keys(&config.database).await
}

/// `error` in the context of `what`, with the fix when Postgres refused
/// the statement for want of a privilege: `ductor keys` connected as a
/// role that may not manage keys, most likely `serve`'s because
/// `database.keys_url` is unset.
fn refused_hint(error: sqlx::Error, what: &'static str) -> anyhow::Error {
    let refused = error
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == INSUFFICIENT_PRIVILEGE);
    let error = anyhow::Error::new(error).context(what);
    if refused {
        error.context(
            "the role of database.keys_url (unset: database.url) may not manage API keys: \
             set database.keys_url (DATABASE_KEYS_URL) to the URL of the keys role, \
             to which `ductor migrate` grants them (database.keys_role)",
        )
    } else {
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> CreateArgs {
        CreateArgs {
            tenant: "acme".into(),
            scopes: "runs:write,runs:read".into(),
            expires: Some("30d".into()),
            label: None,
            requests_per_second: Some(50),
        }
    }

    #[test]
    fn a_request_takes_its_fields_from_the_arguments() {
        let now = chrono::Utc::now();
        let r = request(args(), now).unwrap();
        assert_eq!(r.tenant, "acme");
        assert_eq!(r.scopes.len(), 2);
        assert_eq!(r.expires_at, Some(now + chrono::Duration::days(30)));
        assert_eq!(r.requests_per_second, Some(50));
    }

    #[test]
    fn bad_arguments_name_their_flag() {
        let now = chrono::Utc::now();
        type Spoil = fn(&mut CreateArgs);
        let cases: [(Spoil, &str); 4] = [
            (|a| a.tenant = "a b".into(), "--tenant"),
            (|a| a.scopes = "runs:all".into(), "--scopes"),
            (|a| a.expires = Some("soon".into()), "--expires"),
            (|a| a.requests_per_second = Some(0), "--requests-per-second"),
        ];
        for (spoil, flag) in cases {
            let mut a = args();
            spoil(&mut a);
            let e = request(a, now).unwrap_err().to_string();
            assert!(e.starts_with(flag), "{e}");
        }
    }
}
