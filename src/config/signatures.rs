//! The `[signatures]` section: which inputs must carry their tenant's
//! signature, and the keys to check it with.
//!
//! In: the pools whose starts must be signed (or every input), the window
//! a signature stays fresh, serve's timer key and each tenant's key. Out:
//! whether an input must be signed ([`SignaturesConfig::required`]) and the
//! key to check it with. Guarantees: every key is at least
//! [`MIN_SIGNING_KEY_BYTES`] long, and `all_inputs` is never on without a
//! timer key, so that no unsigned timer is taken for serve's own. The
//! window's bound against `routing.completed_ttl_ms` spans two sections
//! and is checked in `config/mod.rs`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ConfigError, SigningKey, invalid};

/// Signed inputs (`ductor-signature`, HMAC-SHA256 of the time of signing
/// and the record's value with the tenant's key; see
/// [`crate::contract::signature`]). Where they are required, an unsigned,
/// mis-signed or stale input is dead-lettered with class
/// `unauthenticated`. Kafka ACLs decide who may write a topic at all;
/// signatures decide which tenant a writer may speak for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignaturesConfig {
    /// Pools whose `run.start` inputs must be signed.
    #[serde(default)]
    pub pools: Vec<String>,
    /// Every input from outside Ductor must be signed: starts of any pool,
    /// attempt results, signals and cancels (a result or a signal names no
    /// pool, so only this covers them). Requires `timer_key`, so that
    /// Ductor's own timers, which share the wakeups topic with signals and
    /// cancels, cannot be forged by a writer of signals either.
    #[serde(default)]
    pub all_inputs: bool,
    /// How far the time a signature names may lie from when its input
    /// reached Kafka (the record's `LogAppendTime`, which `ductor topics
    /// create` gives the input topics, else when the ingress reads it),
    /// before or after: a copy replayed later is refused. Within it a
    /// replay is deduplicated, which is why a signed start must carry an
    /// idempotency key or a run id, and why this must stay below
    /// `routing.completed_ttl_ms`. On a topic without `LogAppendTime`, an
    /// ingress that falls this far behind refuses the signed inputs it
    /// reads late.
    #[serde(default = "default_signature_max_age_ms")]
    pub max_age_ms: u64,
    /// The key `serve` signs its own inputs with (`wakeup.timer`: timeouts,
    /// retries, wakes; and what child runs and their parents tell each
    /// other: a child's `run.start`, its `attempt.result` to its parent, a
    /// parent's `wakeup.cancel`), set through
    /// `DUCTOR__SIGNATURES__TIMER_KEY`. Set, every timer and every start
    /// naming a parent the ingress reads must carry its signature, so that
    /// a writer of the wakeups topic who knows an attempt's stamp (every
    /// worker of the pool sees it) cannot time an attempt out or end a
    /// wait, nor a tenant start a run that answers another's attempt.
    /// Needed by child steps wherever starts must be signed (`pools`,
    /// `all_inputs`): `serve` refuses to start without it then. Only serve
    /// holds it; at least 16 bytes. Timers already on the topic when it is
    /// first set are refused, so set it on a quiet system or before the
    /// first run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer_key: Option<SigningKey>,
    /// Each tenant's signing key. Set them through the environment
    /// (`DUCTOR__SIGNATURES__TENANT_KEYS__ACME=...`) rather than a file;
    /// they are redacted wherever the configuration is printed. The HTTP
    /// API signs the signals and cancels it puts on Kafka with them.
    #[serde(default)]
    pub tenant_keys: BTreeMap<String, SigningKey>,
}

impl SignaturesConfig {
    /// Whether an input of this kind (a start of `start_pool`, or another
    /// input from outside Ductor) must be signed.
    pub fn required(&self, start_pool: Option<&str>) -> bool {
        self.all_inputs || start_pool.is_some_and(|pool| self.pools.iter().any(|p| p == pool))
    }

    /// `tenant`'s key, if it has one.
    pub fn key(&self, tenant: &str) -> Option<&[u8]> {
        self.tenant_keys.get(tenant).map(|k| k.0.as_bytes())
    }

    /// Serve's timer key, if set.
    pub fn timer_key(&self) -> Option<&[u8]> {
        self.timer_key.as_ref().map(|k| k.0.as_bytes())
    }
}

fn default_signature_max_age_ms() -> u64 {
    300_000
}

/// Shortest signing key accepted: a key guessed is a tenant impersonated.
pub const MIN_SIGNING_KEY_BYTES: usize = 16;

impl SignaturesConfig {
    /// Every key long enough, and the timer key that `all_inputs` needs.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some((tenant, _)) = self
            .tenant_keys
            .iter()
            .find(|(_, key)| key.0.len() < MIN_SIGNING_KEY_BYTES)
        {
            return Err(invalid(
                "signatures.tenant_keys",
                format!(
                    "the key of tenant {tenant:?} is shorter than {MIN_SIGNING_KEY_BYTES} bytes"
                ),
            ));
        }
        if self
            .timer_key
            .as_ref()
            .is_some_and(|key| key.0.len() < MIN_SIGNING_KEY_BYTES)
        {
            return Err(invalid(
                "signatures.timer_key",
                format!("is shorter than {MIN_SIGNING_KEY_BYTES} bytes"),
            ));
        }
        if self.all_inputs && self.timer_key.is_none() {
            return Err(invalid(
                "signatures.timer_key",
                "must be set with signatures.all_inputs: timers share the wakeups topic with \
                 signals and cancels, so unsigned ones could be forged by any writer of signals",
            ));
        }
        Ok(())
    }
}
