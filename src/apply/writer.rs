//! Who writes a batch, as its history records it.
//!
//! In: this process (host and pid), its role, and each new assignment of
//! the ingress's partitions. Out: the label every transition of a batch
//! carries in `run_transitions.writer`. Guarantees: a label names one
//! assignment of one process, so two writers of one run at once would show
//! in its history however they came about.

/// Who writes a batch, as `run_transitions.writer` records it:
/// `<host>:<pid>/<role>#<epoch>`. The ingress's epoch moves on at every
/// assignment of its partitions, so that two writers of one run at once
/// (which co-partitioning rules out) would show in the history as two
/// writers interleaved.
#[derive(Debug)]
pub struct Writer {
    name: String,
    epoch: std::sync::atomic::AtomicU64,
}

impl Writer {
    /// This process in `role` (`ingress`, `api`, `submit`, ...).
    pub fn new(role: &str) -> Writer {
        let host = crate::outbox::hostname();
        Writer {
            name: format!("{host}:{}/{role}", std::process::id()),
            epoch: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A new assignment: the epoch moves on.
    pub fn reassigned(&self) {
        self.epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn label(&self) -> String {
        let epoch = self.epoch.load(std::sync::atomic::Ordering::Relaxed);
        format!("{}#{epoch}", self.name)
    }
}
