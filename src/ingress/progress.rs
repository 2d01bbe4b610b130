//! Whether the ingress moves, for readiness and the gauges.
//!
//! In: each lane's "took up a batch" and "done with it", and the report of
//! each batch handled whole. Out: the lanes stalled now, with how long each
//! has held its batch ([`LaneWatch`]), the age of the oldest batch held,
//! the gauges `ductor_ingress_stalled_lanes` and
//! `ductor_ingress_oldest_batch_age_seconds`, and, for the harnesses, how
//! many batches and inputs went through. Guarantees: a lane that holds a
//! batch for longer than `coordinator.stall_after_ms` is reported stalled
//! whatever holds it (the database away, a lock, a dead letter that cannot
//! be published), and stops being so once it lets go; recording is a
//! relaxed atomic store, never a lock on a lane's path.

use std::time::Duration;

use super::StepReport;
use crate::infra::health::LaneWatch;

/// Whether the ingress moves: every apply lane records when it took up the
/// batch in its hands. A lane that has held one for longer than
/// `coordinator.stall_after_ms` without committing it (the database away,
/// a lock held, a dead letter that cannot be published) is stalled, and
/// so are its partitions: readiness says so, and so do the gauges
/// `ductor_ingress_stalled_lanes` and `ductor_ingress_oldest_batch_age_seconds`.
#[derive(Debug)]
pub struct Progress {
    /// Per lane: when it took up its batch (Unix ms), 0 while idle.
    busy_since_ms: Vec<std::sync::atomic::AtomicI64>,
    stall_after: Duration,
    /// Batches handled whole (applied, dead-lettered, offsets stored) since
    /// the ingress was made, over every lane.
    batches: std::sync::atomic::AtomicU64,
    /// Inputs and routed starts of those batches that made a transition.
    applied: std::sync::atomic::AtomicU64,
}

impl Progress {
    pub fn new(lanes: usize, stall_after: Duration) -> Progress {
        Progress {
            busy_since_ms: (0..lanes.max(1))
                .map(|_| std::sync::atomic::AtomicI64::new(0))
                .collect(),
            stall_after,
            batches: std::sync::atomic::AtomicU64::new(0),
            applied: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn slot(&self, lane: usize) -> &std::sync::atomic::AtomicI64 {
        &self.busy_since_ms[lane % self.busy_since_ms.len()]
    }

    pub(super) fn began(&self, lane: usize) {
        let now = chrono::Utc::now().timestamp_millis();
        self.slot(lane)
            .store(now.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn finished(&self, lane: usize) {
        self.slot(lane)
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn handled(&self, report: &StepReport) {
        use std::sync::atomic::Ordering::Relaxed;
        self.batches.fetch_add(1, Relaxed);
        self.applied.fetch_add(report.applied as u64, Relaxed);
    }

    /// Batches this ingress has handled whole, offsets stored.
    #[cfg(any(test, feature = "internals"))]
    pub fn batches_handled(&self) -> u64 {
        self.batches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Inputs and routed starts this ingress has applied as transitions.
    #[cfg(any(test, feature = "internals"))]
    pub fn inputs_applied(&self) -> u64 {
        self.applied.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long the longest-held batch has been held, if any.
    pub fn oldest_batch_age(&self) -> Option<Duration> {
        let now = chrono::Utc::now().timestamp_millis();
        self.busy_since_ms
            .iter()
            .map(|s| s.load(std::sync::atomic::Ordering::Relaxed))
            .filter(|since| *since > 0)
            .map(|since| Duration::from_millis((now - since).max(0) as u64))
            .max()
    }

    /// Sets the gauges; `serve` calls it every second.
    pub fn observe(&self) {
        metrics::gauge!("ductor_ingress_stalled_lanes").set(self.stalled().len() as f64);
        metrics::gauge!("ductor_ingress_oldest_batch_age_seconds")
            .set(self.oldest_batch_age().map_or(0.0, |age| age.as_secs_f64()));
    }
}

impl LaneWatch for Progress {
    /// The lanes stalled now, with how long each has held its batch.
    fn stalled(&self) -> Vec<(usize, Duration)> {
        let now = chrono::Utc::now().timestamp_millis();
        self.busy_since_ms
            .iter()
            .enumerate()
            .filter_map(|(lane, s)| {
                let since = s.load(std::sync::atomic::Ordering::Relaxed);
                let age = Duration::from_millis((now - since).max(0) as u64);
                (since > 0 && age >= self.stall_after).then_some((lane, age))
            })
            .collect()
    }
}
