//! Starts parked beside a lane: a Kafka start whose idempotency key another
//! caller (an HTTP request still deciding) holds waits here, not in its
//! lane, so the lane's other inputs go on.
//!
//! In: the starts a turn left out ([`crate::apply::IsolatedBatch::held`]),
//! each with its message. Out: those starts given back to a later turn of
//! the lane once their pause has passed, to be applied again; meanwhile the
//! keys they hold ([`Parked::holds`]), so that a later start with one of
//! them is parked behind it and they decide in the order they were read;
//! and the offsets the lane may store ([`Parked::offsets`]).
//!
//! Guarantee: the stored offset of a partition never passes a parked start,
//! so a crash, a shutdown or a rebalance redelivers it (and what followed
//! it, which applies again as no-ops): nothing parked is lost. At most
//! `coordinator.max_parked_starts` starts are parked per lane; past that a
//! start waits in its lane, as before parking. A start stays parked across
//! a rebalance: if its partition moved, the new owner reads it again from
//! the stored offset, and the routing key lets only one of the two decide.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::message::{Message, OwnedMessage};
use tokio::time::Instant;

use crate::apply::{Holds, RetryPolicy};
use crate::routing::RouteRequest;

/// A start left out of its batch, with the message it came in.
#[derive(Debug, Clone)]
pub struct ParkedStart {
    pub message: OwnedMessage,
    pub request: RouteRequest,
}

/// A partition, as offsets are kept.
type Partition = (String, i32);

/// One lane's parked starts.
#[derive(Debug, Default)]
pub struct Parked {
    /// In the order they were read.
    starts: Vec<ParkedStart>,
    /// Per partition with a parked start, the highest offset the lane has
    /// dealt with: what it stores once the partition's starts are decided.
    high: BTreeMap<Partition, i64>,
    /// When the parked starts are next applied again.
    due: Option<Instant>,
    /// The pause before that, doubling while nothing of them decides.
    pause: Duration,
}

impl Parked {
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// When the parked starts are next due, if any are parked.
    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Every parked start, once their pause has passed at `now`: they are
    /// applied again, ahead of the turn's batch. None before that.
    pub fn take_due(&mut self, now: Instant) -> Vec<ParkedStart> {
        match self.due {
            Some(due) if due <= now => {
                self.due = None;
                std::mem::take(&mut self.starts)
            }
            _ => Vec::new(),
        }
    }

    /// The keys of the starts still parked, and room for what
    /// `max_parked` leaves.
    pub fn holds(&self, max_parked: usize) -> Holds {
        Holds::parking(
            max_parked.saturating_sub(self.starts.len()),
            self.starts.iter().map(|s| &s.request),
        )
    }

    /// Parks the starts a turn left out, after those still parked. When
    /// the turn applied parked starts again, the next try comes after the
    /// shortest pause if one of them decided, else after twice the last.
    pub fn park(
        &mut self,
        held: Vec<ParkedStart>,
        some_decided: bool,
        retry: RetryPolicy,
        now: Instant,
    ) {
        self.starts.extend(held);
        if self.starts.is_empty() {
            self.due = None;
            self.pause = Duration::ZERO;
            return;
        }
        if self.due.is_some() {
            return;
        }
        self.pause = if some_decided || self.pause.is_zero() {
            retry.min
        } else {
            (self.pause * 2).min(retry.max)
        };
        self.due = Some(now + self.pause);
    }

    /// The next offset to store for each partition of a turn, given the
    /// last offset the turn read of each (`last`): one past it, or past the
    /// highest read before while starts were parked on it; but never past
    /// a start still parked on it, which is the next to read again. Call
    /// after [`Parked::park`].
    pub fn offsets(&mut self, last: &BTreeMap<Partition, i64>) -> BTreeMap<Partition, i64> {
        let mut lowest: BTreeMap<Partition, i64> = BTreeMap::new();
        for start in &self.starts {
            let at = (start.message.topic().to_string(), start.message.partition());
            let offset = start.message.offset();
            lowest
                .entry(at)
                .and_modify(|o| *o = (*o).min(offset))
                .or_insert(offset);
        }
        let mut next = BTreeMap::new();
        for (at, &offset) in last {
            let high = self.high.get(at).map_or(offset, |h| (*h).max(offset));
            match lowest.get(at) {
                Some(&parked) => {
                    self.high.insert(at.clone(), high);
                    next.insert(at.clone(), parked);
                }
                None => {
                    self.high.remove(at);
                    next.insert(at.clone(), high + 1);
                }
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;

    const RETRY: RetryPolicy = RetryPolicy {
        min: Duration::from_millis(50),
        max: Duration::from_millis(300),
        bisect_after: 5,
    };

    fn start(partition: i32, offset: i64, key: &str) -> ParkedStart {
        ParkedStart {
            message: OwnedMessage::new(
                None,
                None,
                "requests".into(),
                Timestamp::NotAvailable,
                partition,
                offset,
                None,
            ),
            request: RouteRequest::keyed("acme", key),
        }
    }

    fn at(partition: i32) -> Partition {
        ("requests".to_string(), partition)
    }

    #[test]
    fn a_stored_offset_never_passes_a_parked_start_and_catches_up_once_it_decides() {
        let now = Instant::now();
        let mut parked = Parked::default();
        // A turn read offsets 10..=20 of partition 0 and 5 of partition 1,
        // and left out the start at 12.
        parked.park(vec![start(0, 12, "k")], false, RETRY, now);
        let last = BTreeMap::from([(at(0), 20), (at(1), 5)]);
        assert_eq!(
            parked.offsets(&last),
            BTreeMap::from([(at(0), 12), (at(1), 6)])
        );
        // Later turns read on; partition 0 stays at the parked start.
        parked.park(Vec::new(), false, RETRY, now);
        assert_eq!(
            parked.offsets(&BTreeMap::from([(at(0), 30)])),
            BTreeMap::from([(at(0), 12)])
        );
        // The start is applied again (only it: the turn read offset 12)
        // and decides: the partition stores past everything it read.
        let retried = parked.take_due(now + RETRY.min);
        assert_eq!(retried.len(), 1);
        parked.park(Vec::new(), true, RETRY, now);
        assert!(parked.len() == 0 && parked.due().is_none());
        assert_eq!(
            parked.offsets(&BTreeMap::from([(at(0), 12)])),
            BTreeMap::from([(at(0), 31)])
        );
        // Nothing parked any more: a turn stores one past what it read.
        assert_eq!(
            parked.offsets(&BTreeMap::from([(at(0), 40)])),
            BTreeMap::from([(at(0), 41)])
        );
    }

    #[test]
    fn parked_starts_come_back_after_a_pause_that_doubles_while_none_decides() {
        let now = Instant::now();
        let mut parked = Parked::default();
        parked.park(vec![start(0, 1, "a")], false, RETRY, now);
        assert_eq!(parked.due(), Some(now + RETRY.min));
        assert!(parked.take_due(now).is_empty(), "not before the pause");
        // Another start parks meanwhile: the pause stands.
        parked.park(vec![start(0, 2, "b")], false, RETRY, now);
        assert_eq!(parked.due(), Some(now + RETRY.min));
        let mut pauses = Vec::new();
        let mut t = now;
        for _ in 0..4 {
            t = parked.due().expect("still parked");
            let again = parked.take_due(t);
            assert_eq!(again.len(), 2, "all of them, in the order read");
            assert_eq!(again[0].message.offset(), 1);
            parked.park(again, false, RETRY, t);
            pauses.push(parked.due().unwrap() - t);
        }
        assert_eq!(
            pauses,
            [100, 200, 300, 300].map(Duration::from_millis),
            "doubling up to the longest pause"
        );
        // One of them decides: the shortest pause again.
        let again = parked.take_due(parked.due().unwrap());
        parked.park(vec![again[1].clone()], true, RETRY, t);
        assert_eq!(parked.due(), Some(t + RETRY.min));
    }

    #[test]
    fn holds_name_the_parked_keys_and_leave_room_up_to_the_bound() {
        let now = Instant::now();
        let mut parked = Parked::default();
        parked.park(vec![start(0, 1, "a"), start(0, 2, "b")], false, RETRY, now);
        assert_eq!(parked.len(), 2);
        let holds = parked.holds(3);
        assert_eq!(holds.room(), 1);
        assert!(holds.holds(&start(0, 9, "a").request));
        assert!(holds.holds(&start(3, 9, "b").request));
        assert!(!holds.holds(&start(0, 9, "c").request));
        assert_eq!(parked.holds(1).room(), 0, "past the bound");
    }
}
