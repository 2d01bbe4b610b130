//! Offsets: which offsets a batch lets the consumer store.
//!
//! In: the messages of a batch (with the parked starts it applied again).
//! Out: the last offset the batch holds of each `(topic, partition)`, the
//! next offset to read of each, and those as the list the consumer stores.
//! Guarantees: pure but for [`store_offsets`] itself; a partition's next
//! offset is one past the highest offset of it the batch held, whatever
//! order its messages came in; a store that a revoked partition refuses is
//! logged and left to redelivery, which applies as no-ops. When to store
//! is the caller's: only after the batch is durably handled, and never
//! past a parked start.

use std::collections::BTreeMap;

use rdkafka::consumer::Consumer;
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};

use super::IngressContext;

/// Stores `next`, the next offset to read of each partition. A partition
/// that was revoked meanwhile refuses the store; its new owner re-reads the
/// messages and they apply as no-ops.
pub(super) fn store_offsets(ctx: &IngressContext, next: &BTreeMap<(String, i32), i64>) {
    if let Err(e) = ctx.consumer.store_offsets(&offset_list(next)) {
        tracing::info!(error = %e, "offsets not stored (partition revoked?); they will be redelivered as no-ops");
    }
}

/// The offsets to store once `batch` is applied: for each of its
/// partitions, one past its last message.
#[cfg(any(test, feature = "internals"))]
pub fn next_offsets(batch: &[OwnedMessage]) -> TopicPartitionList {
    let next = last_offsets(batch.iter())
        .into_iter()
        .map(|(at, offset)| (at, offset + 1))
        .collect();
    offset_list(&next)
}

/// `next` as the consumer stores it.
fn offset_list(next: &BTreeMap<(String, i32), i64>) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(next.len());
    for ((topic, partition), offset) in next {
        if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(error = %e, topic, partition, "could not record offset");
        }
    }
    tpl
}

/// The offset of the last message of `batch` on each of its partitions.
pub(super) fn last_offsets<'m>(
    batch: impl Iterator<Item = &'m OwnedMessage>,
) -> BTreeMap<(String, i32), i64> {
    let mut last: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for msg in batch {
        let entry = last
            .entry((msg.topic().to_string(), msg.partition()))
            .or_insert(msg.offset());
        *entry = (*entry).max(msg.offset());
    }
    last
}

#[cfg(test)]
mod tests {
    use rdkafka::Timestamp;

    use super::*;

    fn message(topic: &str, partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            topic.into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn stored(list: &TopicPartitionList) -> Vec<(String, i32, Offset)> {
        list.elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition(), e.offset()))
            .collect()
    }

    #[test]
    fn the_last_offset_of_each_partition_is_its_highest_whatever_the_order() {
        let batch = [
            message("requests", 0, 7),
            message("requests", 1, 3),
            message("requests", 0, 5),
            message("wakeups", 0, 2),
            message("requests", 1, 4),
        ];
        let last = last_offsets(batch.iter());
        let expected: BTreeMap<(String, i32), i64> = [
            (("requests".to_string(), 0), 7),
            (("requests".to_string(), 1), 4),
            (("wakeups".to_string(), 0), 2),
        ]
        .into_iter()
        .collect();
        assert_eq!(last, expected);
    }

    #[test]
    fn the_offsets_to_store_are_one_past_each_partitions_last_message() {
        let batch = [
            message("requests", 1, 10),
            message("requests", 0, 3),
            message("requests", 1, 9),
        ];
        assert_eq!(
            stored(&next_offsets(&batch)),
            vec![
                ("requests".to_string(), 0, Offset::Offset(4)),
                ("requests".to_string(), 1, Offset::Offset(11)),
            ]
        );
    }

    #[test]
    fn an_empty_batch_stores_nothing() {
        assert!(last_offsets(std::iter::empty()).is_empty());
        assert_eq!(next_offsets(&[]).count(), 0);
        assert_eq!(offset_list(&BTreeMap::new()).count(), 0);
    }
}
