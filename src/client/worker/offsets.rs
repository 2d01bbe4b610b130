//! Offset bookkeeping: which offset of each partition the worker may store.
//!
//! In: each message as it is received, and each as it is finished, in any
//! order. Out: a partition's new position when it moves. Guarantees: the
//! position never passes an unfinished offset, so a dispatch that finishes
//! early never carries the group past an earlier one still running; when a
//! partition is delivered again from an earlier offset (a rebalance gave it
//! back), the tickets of before no longer move it. Pure: no broker, no clock;
//! what it decides is tested without either.

use std::collections::{BTreeMap, BTreeSet};

/// Names one received message for [`OffsetTracker::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ticket {
    pub(super) partition: i32,
    offset: i64,
    /// Bumped when the partition rewinds (a rebalance gave it back at an
    /// earlier committed offset): older tickets no longer move its position.
    epoch: u64,
}

/// Per-partition progress: which received offsets are still unfinished, so
/// the stored position never passes one of them. Pure bookkeeping, bounded
/// by the in-flight limit.
#[derive(Debug, Default)]
pub(super) struct OffsetTracker {
    partitions: BTreeMap<i32, PartitionProgress>,
}

#[derive(Debug, Default)]
struct PartitionProgress {
    epoch: u64,
    last_received: Option<i64>,
    unfinished: BTreeSet<i64>,
    /// Highest finished offset + 1 in this epoch.
    finished_next: Option<i64>,
    /// The last position handed out for storing in this epoch (at first,
    /// the epoch's first offset: the position it started from).
    stored: Option<i64>,
}

impl OffsetTracker {
    /// Records a message as received and unfinished.
    pub(super) fn received(&mut self, partition: i32, offset: i64) -> Ticket {
        let p = self.partitions.entry(partition).or_default();
        if p.last_received.is_some_and(|last| offset <= last) {
            // Redelivery from an earlier position: start over; the older
            // in-flight messages come again in this epoch.
            *p = PartitionProgress {
                epoch: p.epoch + 1,
                ..PartitionProgress::default()
            };
        }
        // The position before anything of this epoch finished.
        p.stored.get_or_insert(offset);
        p.last_received = Some(offset);
        p.unfinished.insert(offset);
        Ticket {
            partition,
            offset,
            epoch: p.epoch,
        }
    }

    /// Marks a message finished; returns the partition's new position (the
    /// next offset to consume) if it advanced.
    pub(super) fn complete(&mut self, ticket: Ticket) -> Option<i64> {
        let p = self.partitions.get_mut(&ticket.partition)?;
        if p.epoch != ticket.epoch || !p.unfinished.remove(&ticket.offset) {
            return None;
        }
        let next = ticket.offset + 1;
        p.finished_next = Some(p.finished_next.map_or(next, |n| n.max(next)));
        // Within an epoch offsets arrive in order, so everything received
        // below the oldest unfinished offset is finished.
        let position = match p.unfinished.first() {
            Some(&oldest) => oldest,
            None => p.finished_next?,
        };
        if p.stored.is_some_and(|s| position <= s) {
            return None;
        }
        p.stored = Some(position);
        Some(position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_position_never_passes_an_unfinished_offset() {
        let mut t = OffsetTracker::default();
        let a = t.received(0, 10);
        let b = t.received(0, 11);
        let c = t.received(0, 13); // 12 is a gap (a control record)
        assert_eq!(t.complete(c), None, "10 and 11 are unfinished");
        assert_eq!(t.complete(a), Some(11));
        assert_eq!(t.complete(a), None, "a second completion changes nothing");
        assert_eq!(t.complete(b), Some(14));
        let d = t.received(0, 14);
        let other = t.received(1, 3);
        assert_eq!(t.complete(other), Some(4), "partitions are independent");
        assert_eq!(t.complete(d), Some(15));
    }

    #[test]
    fn a_rewound_partition_ignores_tickets_of_the_earlier_epoch() {
        let mut t = OffsetTracker::default();
        let old = t.received(0, 10);
        let _old_next = t.received(0, 11);
        // Rebalanced away and back: delivered again from 10.
        let again = t.received(0, 10);
        assert_eq!(t.complete(old), None);
        assert_eq!(t.complete(again), Some(11));
        let next = t.received(0, 11);
        assert_eq!(t.complete(next), Some(12));
    }
}
