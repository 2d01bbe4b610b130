//! API keys for the harness's HTTP callers, one per tenant, made in the
//! database the serves use as `ductor keys create` makes them: as the keys
//! role (`database.keys_url`).

use std::collections::BTreeMap;

use anyhow::Context;
use ductor::auth::Scope;
use ductor::config::Config;
use ductor::harness::KeyRequest;

/// Each tenant's `Authorization` header value.
pub async fn issue(
    config: &Config,
    tenants: &[String],
) -> anyhow::Result<BTreeMap<String, String>> {
    let pool = ductor::infra::db::connect_keys(&config.database).await?;
    let mut headers = BTreeMap::new();
    for tenant in tenants {
        let new = ductor::auth::key::generate().context("reading the random source")?;
        let request = KeyRequest {
            tenant: tenant.clone(),
            scopes: vec![Scope::RunsWrite, Scope::RunsRead],
            label: Some("ductor-chaos".into()),
            requests_per_second: None,
            expires_at: None,
        };
        ductor::auth::store::insert(&pool, &new, &request)
            .await
            .with_context(|| format!("storing the API key of tenant {tenant}"))?;
        headers.insert(tenant.clone(), format!("Bearer {}", new.token));
    }
    pool.close().await;
    Ok(headers)
}
