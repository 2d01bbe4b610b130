//! Identity: who a request to the public API comes from.
//!
//! In: the `Authorization: Bearer <key>` header of a request. Out: the
//! [`Caller`] — the key's tenant and scopes — or a refusal. Guarantees: the
//! tenant of a request is its key's, never one the request names; a key that
//! is wrong, expired or revoked is refused on its next request (the row of
//! a known key id is read every time, nothing of it is cached; an id found
//! in no row is remembered as unknown for `server.unknown_key_cache_ms`);
//! a client address that keeps failing is held back before its keys are
//! looked up ([`rate::FailureGate`]); the caller is never told
//! which of those it was, the `ductor_api_auth_failures_total` counter is;
//! keys are never logged, and only a hash of each is stored.
//!
//! `server.auth = "disabled"` turns this off for local development: every
//! request is then [`Identity::Anonymous`] and names its tenant itself.

pub mod key;
pub mod rate;
pub mod store;

use sqlx::PgPool;

use crate::config::AuthMode;
pub use key::{Caller, Refusal, Scope};

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A caller with a valid key.
    Key(Caller),
    /// Anyone, with authentication disabled.
    Anonymous,
}

/// Why a request cannot go on as who it claims to be.
#[derive(Debug)]
pub enum AuthError {
    /// No valid key (401).
    Unauthenticated(Refusal),
    /// A valid key without the scope the endpoint needs (403).
    MissingScope(Scope),
    /// The keys could not be read (503).
    Unavailable(sqlx::Error),
}

/// Checks the keys of requests against the database.
#[derive(Clone)]
pub struct Authenticator {
    mode: AuthMode,
    pool: PgPool,
    /// Key ids lately found in no row: refused without a query.
    unknown: std::sync::Arc<rate::UnknownKeys>,
}

impl Authenticator {
    /// Keys of `pool`'s `api_keys`, with ids found in no row remembered
    /// for `unknown_for` (`server.unknown_key_cache_ms`).
    pub fn new(mode: AuthMode, pool: PgPool, unknown_for: std::time::Duration) -> Self {
        Authenticator {
            mode,
            pool,
            unknown: std::sync::Arc::new(rate::UnknownKeys::new(unknown_for)),
        }
    }

    /// Who sent a request with this `Authorization` header, if it may do
    /// what needs `scope`.
    pub async fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope,
    ) -> Result<Identity, AuthError> {
        self.authenticate_any(authorization, &[scope]).await
    }

    /// Who sent a request with this `Authorization` header, if its key has
    /// one of `scopes` (the first is the one a refusal names).
    pub async fn authenticate_any(
        &self,
        authorization: Option<&[u8]>,
        scopes: &[Scope],
    ) -> Result<Identity, AuthError> {
        if self.mode == AuthMode::Disabled {
            return Ok(Identity::Anonymous);
        }
        let caller = self.caller(authorization).await.inspect_err(|e| {
            if let AuthError::Unauthenticated(refusal) = e {
                metrics::counter!("ductor_api_auth_failures_total", "reason" => refusal.as_str())
                    .increment(1);
            }
        })?;
        if !scopes.iter().any(|&scope| caller.allows(scope)) {
            metrics::counter!("ductor_api_auth_failures_total", "reason" => "missing_scope")
                .increment(1);
            return Err(AuthError::MissingScope(scopes[0]));
        }
        Ok(Identity::Key(caller))
    }

    async fn caller(&self, authorization: Option<&[u8]>) -> Result<Caller, AuthError> {
        let header = authorization.ok_or(AuthError::Unauthenticated(Refusal::Missing))?;
        let presented = key::bearer(header)
            .and_then(key::parse)
            .ok_or(AuthError::Unauthenticated(Refusal::Malformed))?;
        let now = std::time::Instant::now();
        if self.unknown.known_unknown(presented.key_id, now) {
            return Err(AuthError::Unauthenticated(Refusal::Unknown));
        }
        let stored = store::load(&self.pool, presented.key_id)
            .await
            .map_err(AuthError::Unavailable)?;
        if stored.is_none() {
            self.unknown.note(presented.key_id, now);
        }
        let caller = key::verify(stored.as_ref(), presented).map_err(AuthError::Unauthenticated)?;
        let unnoted = stored.is_some_and(|k| k.use_unnoted);
        if unnoted && let Err(e) = store::touch(&self.pool, &caller.key_id).await {
            // Bookkeeping only: the request goes on.
            tracing::warn!(key_id = %caller.key_id, error = %e, "a key's last use was not noted");
        }
        Ok(caller)
    }
}

/// Why a request cannot act as the tenant it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantError {
    /// The request names a tenant other than its key's.
    Mismatch,
    /// Without authentication, the request names none where one is needed.
    Missing,
}

/// The tenant a request acts as: its key's, which a tenant the request
/// names must equal. Without authentication, the named one, or `default`
/// where the endpoint has one.
pub fn tenant_for(
    identity: &Identity,
    named: Option<&str>,
    default: Option<&str>,
) -> Result<String, TenantError> {
    match identity {
        Identity::Key(caller) => match named {
            Some(t) if t != caller.tenant => Err(TenantError::Mismatch),
            _ => Ok(caller.tenant.clone()),
        },
        Identity::Anonymous => named
            .or(default)
            .map(str::to_owned)
            .ok_or(TenantError::Missing),
    }
}

/// The tenants an operator's request sees: one, or all of them (`None`).
/// A key with the `admin` scope sees every tenant, or the one the request
/// names; any other key sees its own tenant only, and naming another is a
/// mismatch; without authentication (local development) the request sees
/// what it names, or everything.
pub fn tenants_seen(
    identity: &Identity,
    named: Option<&str>,
) -> Result<Option<String>, TenantError> {
    match identity {
        Identity::Key(caller) if caller.allows(Scope::Admin) => Ok(named.map(str::to_owned)),
        Identity::Key(_) => tenant_for(identity, named, None).map(Some),
        Identity::Anonymous => Ok(named.map(str::to_owned)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(tenant: &str) -> Identity {
        Identity::Key(Caller {
            key_id: "0123456789abcdef".into(),
            tenant: tenant.into(),
            scopes: vec![Scope::RunsWrite],
            requests_per_second: None,
        })
    }

    #[test]
    fn a_key_acts_as_its_own_tenant_only() {
        let acme = caller("acme");
        assert_eq!(tenant_for(&acme, None, Some("default")).unwrap(), "acme");
        assert_eq!(tenant_for(&acme, Some("acme"), None).unwrap(), "acme");
        assert_eq!(
            tenant_for(&acme, Some("globex"), Some("default")),
            Err(TenantError::Mismatch)
        );
    }

    #[test]
    fn an_admin_key_sees_every_tenant_and_a_tenant_key_its_own() {
        let acme = caller("acme");
        assert_eq!(tenants_seen(&acme, None), Ok(Some("acme".into())));
        assert_eq!(
            tenants_seen(&acme, Some("globex")),
            Err(TenantError::Mismatch)
        );
        let Identity::Key(mut admin) = caller("ops") else {
            unreachable!()
        };
        admin.scopes = vec![Scope::Admin];
        let admin = Identity::Key(admin);
        assert_eq!(tenants_seen(&admin, None), Ok(None));
        assert_eq!(
            tenants_seen(&admin, Some("globex")),
            Ok(Some("globex".into()))
        );
        assert_eq!(tenants_seen(&Identity::Anonymous, None), Ok(None));
    }

    #[test]
    fn without_authentication_the_request_names_its_tenant() {
        let anyone = Identity::Anonymous;
        assert_eq!(tenant_for(&anyone, Some("globex"), None).unwrap(), "globex");
        assert_eq!(
            tenant_for(&anyone, None, Some("default")).unwrap(),
            "default"
        );
        assert_eq!(tenant_for(&anyone, None, None), Err(TenantError::Missing));
    }
}
