//! API keys for the harness's HTTP callers, one per tenant and one for the
//! operator, made in the database the serves use as `ductor keys create`
//! makes them: as the keys role (`database.keys_url`).

use std::collections::BTreeMap;

use anyhow::Context;
use ductor::auth::Scope;
use ductor::config::Config;
use ductor::harness::KeyRequest;

/// The operator key's tenant: an `admin` key acts on every tenant's
/// letters, so this names only who holds it.
const OPERATOR: &str = "chaos-operator";

/// Each tenant's `Authorization` header value.
pub async fn issue(
    config: &Config,
    tenants: &[String],
) -> anyhow::Result<BTreeMap<String, String>> {
    let pool = ductor::infra::db::connect_keys(&config.database).await?;
    let mut headers = BTreeMap::new();
    for tenant in tenants {
        let header = store(&pool, tenant, vec![Scope::RunsWrite, Scope::RunsRead]).await?;
        headers.insert(tenant.clone(), header);
    }
    pool.close().await;
    Ok(headers)
}

/// The `Authorization` header value of an `admin` key: what the admin
/// listener asks of an operator.
pub async fn issue_admin(config: &Config) -> anyhow::Result<String> {
    let pool = ductor::infra::db::connect_keys(&config.database).await?;
    let header = store(&pool, OPERATOR, vec![Scope::Admin]).await;
    pool.close().await;
    header
}

/// Stores a fresh key of `tenant` with `scopes`; its header value.
async fn store(pool: &sqlx::PgPool, tenant: &str, scopes: Vec<Scope>) -> anyhow::Result<String> {
    let new = ductor::auth::key::generate().context("reading the random source")?;
    let request = KeyRequest {
        tenant: tenant.to_owned(),
        scopes,
        label: Some("ductor-chaos".into()),
        requests_per_second: None,
        expires_at: None,
    };
    ductor::auth::store::insert(pool, &new, &request)
        .await
        .with_context(|| format!("storing an API key of {tenant}"))?;
    Ok(format!("Bearer {}", new.token))
}
