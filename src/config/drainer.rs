//! The `[drainer]` section: how the outbox's intents are claimed,
//! published, retried, parked and purged.
//!
//! In: the drainer's batch, its lease and heartbeats, its intervals, its
//! publish retries and its retention. Out: a [`DrainerConfig`] the drainer
//! and its maintenance are built from. Guarantees: a batch holds 1 to
//! 10000 intents, no interval or bound is 0, and a live drainer's
//! heartbeats come at least twice within `member_timeout_ms`, so it is not
//! taken for dead. That a claim outlives a publish (`lease_ms` against
//! `kafka.delivery_timeout_ms`) spans two sections and is checked in
//! `config/mod.rs`.

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainerConfig {
    /// Run the outbox drainer inside `serve`.
    pub enabled: bool,
    /// Most intents claimed and published in one round.
    pub batch_max_intents: usize,
    /// Safety-net poll when no wake-up arrives. Every source of due work
    /// wakes the claim rounds itself: a commit in this process, `NOTIFY`
    /// from other processes, the reconciler giving claims back, the results
    /// frontier moving, and the next intent falling due; so the poll only
    /// bounds what a missed wake-up could cost, and an idle drainer's
    /// queries are this interval apart.
    pub poll_interval_ms: u64,
    /// How long a claim is held before the reconciler hands the intent to
    /// another drainer. Must exceed `kafka.delivery_timeout_ms`, or a slow
    /// publish could be redriven while still in flight.
    pub lease_ms: u64,
    /// How often expired claims, and claims of drainers that stopped, are
    /// looked for.
    pub reconcile_interval_ms: u64,
    /// How often a drainer records that it is alive.
    pub heartbeat_interval_ms: u64,
    /// A drainer whose heartbeat is this old is taken to be dead: its claims
    /// are given back without waiting out their lease, so the effects of a
    /// killed process are published within seconds. A drainer judges others
    /// only after reaching the database for this long itself.
    pub member_timeout_ms: u64,
    /// Completed intents are deleted this long after completion.
    pub retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Rows deleted per retention statement.
    pub purge_batch: usize,
    /// Retention statements per retention run, so one run stays bounded.
    pub purge_max_rounds: u32,
    /// Upper bound on the pause after failed rounds (broker or database
    /// down), and on how far one intent's next try is pushed back.
    pub max_backoff_ms: u64,
    /// How far an intent whose publish failed is pushed back before it is
    /// claimed again; doubled for every try it had, up to `max_backoff_ms`.
    /// Its run's later effects on the same topic wait behind it.
    pub publish_retry_min_ms: u64,
    /// Permanent publish failures (the record too large for the broker, an
    /// unknown or invalid topic, no authorisation) after which an intent is
    /// parked: out of the claim rounds, with its error, until `ductor
    /// outbox redrive`.
    pub park_after_failures: u32,
    /// How often the backlog gauges are refreshed.
    pub metrics_interval_ms: u64,
    /// How often the results frontier is probed while a timeout waits for
    /// it (none is probed at idle): the instant before which
    /// the coordinator has applied every attempt result (see
    /// `ductor::outbox::frontier`). A step's timeout is published only once the
    /// frontier has passed its deadline, so a result sent in time is never
    /// beaten by the timeout while its partition waits for a crashed
    /// `serve`.
    pub results_frontier_interval_ms: u64,
    /// Besides "caught up now", the frontier is probed this long ago and
    /// four times that: under load, when the coordinator is never quite
    /// caught up, timeouts are published up to this much late.
    pub results_frontier_lag_ms: u64,
}

impl DrainerConfig {
    /// Its batches, intervals, heartbeats and retention.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_max_intents == 0 || self.batch_max_intents > 10_000 {
            return Err(invalid(
                "drainer.batch_max_intents",
                "must be between 1 and 10000",
            ));
        }
        for (key, value) in [
            ("drainer.poll_interval_ms", self.poll_interval_ms),
            ("drainer.reconcile_interval_ms", self.reconcile_interval_ms),
            ("drainer.heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("drainer.purge_interval_ms", self.purge_interval_ms),
            ("drainer.metrics_interval_ms", self.metrics_interval_ms),
            ("drainer.max_backoff_ms", self.max_backoff_ms),
            ("drainer.publish_retry_min_ms", self.publish_retry_min_ms),
            (
                "drainer.results_frontier_interval_ms",
                self.results_frontier_interval_ms,
            ),
            (
                "drainer.results_frontier_lag_ms",
                self.results_frontier_lag_ms,
            ),
            (
                "drainer.park_after_failures",
                u64::from(self.park_after_failures),
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.member_timeout_ms < 2 * self.heartbeat_interval_ms {
            return Err(invalid(
                "drainer.member_timeout_ms",
                "must be at least twice drainer.heartbeat_interval_ms, or a live drainer could be taken for dead",
            ));
        }
        if self.purge_batch == 0 {
            return Err(invalid("drainer.purge_batch", "must be at least 1"));
        }
        Ok(())
    }
}
