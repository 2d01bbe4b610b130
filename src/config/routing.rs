//! The `[routing]` section: how the HTTP API decides exactly once per
//! idempotency key, and how long it keeps its decisions.
//!
//! In: the reservations' and decisions' lifetimes, the sweeper and
//! retention, the largest accepted body, and what a duplicate request does
//! while the first is still deciding (per pool, or by default). Out: a
//! [`RoutingConfig`] the routing plane is built from. Guarantees: no
//! lifetime, interval or batch is 0, and a body of at least 1024 bytes is
//! always accepted.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// What a duplicate request does while the first caller with its key is
/// still deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DuplicatePolicy {
    /// Wait, up to the pool's `wait_timeout_ms`, for the first caller's
    /// decision and return it.
    Wait,
    /// Answer "in progress" at once (HTTP 409).
    Reject,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// How long a reservation may stay `pending` before the sweeper marks it
    /// `failed_before_commit`, so that another caller can reclaim the key.
    pub pending_ttl_ms: u64,
    /// How long a decision stays valid: a request with the same key within
    /// it gets the same run; after it, a new decision.
    pub completed_ttl_ms: u64,
    /// How often the sweeper runs.
    pub sweep_interval_ms: u64,
    /// Rows swept per statement.
    pub sweep_batch: usize,
    /// Failed rows, and completed rows past their TTL, are deleted this long
    /// after they died. Pending rows are never deleted.
    pub retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Rows deleted per retention statement.
    pub purge_batch: usize,
    /// Retention statements per retention run.
    pub purge_max_rounds: u32,
    /// Largest accepted `POST /v1/runs` body.
    pub max_body_bytes: usize,
    /// Default duplicate-waiter policy: `wait` or `reject`.
    pub duplicate_policy: DuplicatePolicy,
    /// Default bound on a duplicate's wait under the `wait` policy.
    pub wait_timeout_ms: u64,
    /// Per-pool overrides, e.g. `[routing.pools.payments]
    /// duplicate_policy = "reject"`.
    pub pools: BTreeMap<String, PoolRouting>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRouting {
    /// This pool's duplicate-waiter policy.
    pub duplicate_policy: Option<DuplicatePolicy>,
    /// This pool's bound on a duplicate's wait.
    pub wait_timeout_ms: Option<u64>,
}

impl RoutingConfig {
    /// Its TTLs, intervals, batches and body bound.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("routing.pending_ttl_ms", self.pending_ttl_ms),
            ("routing.completed_ttl_ms", self.completed_ttl_ms),
            ("routing.sweep_interval_ms", self.sweep_interval_ms),
            ("routing.purge_interval_ms", self.purge_interval_ms),
            ("routing.wait_timeout_ms", self.wait_timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.sweep_batch == 0 || self.purge_batch == 0 {
            return Err(invalid(
                "routing.sweep_batch",
                "sweep_batch and purge_batch must be at least 1",
            ));
        }
        if self.max_body_bytes < 1024 {
            return Err(invalid("routing.max_body_bytes", "must be at least 1024"));
        }
        Ok(())
    }
}
