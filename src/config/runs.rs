//! The `[runs]` section: retention of finished runs.
//!
//! In: how long a finished run and its tombstone are kept, and the pace of
//! the purge. Out: a [`RunsConfig`] retention is built from (the section
//! may be left out: its defaults keep a run a week). Guarantees: a
//! tombstone outlives its run, so a start replayed from Kafka after its run
//! was deleted does not start it again; the purge's interval and batches
//! are at least 1.

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// Retention of finished runs: a run that ended longer than `retention_ms`
/// ago is deleted with its transitions and attempts, and leaves a tombstone
/// for `tombstone_retention_ms`, so that a late input for it (a start
/// replayed from Kafka) does not start it again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunsConfig {
    /// How long a finished run is kept; 0 keeps every run for ever.
    pub retention_ms: u64,
    /// How long a deleted run's tombstone is kept. Make it outlast the
    /// retention of the input topics.
    pub tombstone_retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Runs (and tombstones) deleted per statement.
    pub purge_batch: usize,
    /// Statements per retention run.
    pub purge_max_rounds: u32,
}

impl Default for RunsConfig {
    fn default() -> Self {
        RunsConfig {
            retention_ms: 7 * 86_400_000,
            tombstone_retention_ms: 30 * 86_400_000,
            purge_interval_ms: 60_000,
            purge_batch: 500,
            purge_max_rounds: 10,
        }
    }
}

impl RunsConfig {
    /// The purge's pace, and a tombstone that outlives its run.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("runs.tombstone_retention_ms", self.tombstone_retention_ms),
            ("runs.purge_interval_ms", self.purge_interval_ms),
            ("runs.purge_max_rounds", u64::from(self.purge_max_rounds)),
            ("runs.purge_batch", self.purge_batch as u64),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.retention_ms > 0 && self.tombstone_retention_ms < self.retention_ms {
            return Err(invalid(
                "runs.tombstone_retention_ms",
                "must be at least runs.retention_ms: a tombstone outlives its run",
            ));
        }
        Ok(())
    }
}
