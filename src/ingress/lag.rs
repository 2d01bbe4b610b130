//! How far the ingress is behind its input topics, from librdkafka's
//! statistics.
//!
//! In: the statistics JSON librdkafka hands the ingress consumer every
//! `kafka.statistics_interval_ms`, and the input topics' names. Out: for
//! each input topic, the messages of the partitions this process consumes
//! that its group has not committed yet (`ductor_ingress_consumer_lag_messages`).
//! Guarantees: pure, no clock, no I/O; every input topic gets a value (0
//! when this process consumes none of its partitions), so that a gauge never
//! keeps the lag of partitions that moved to another process; a partition
//! whose offsets are not known yet counts 0, never a negative number.
//!
//! The statistics reach the context only while the ingress polls its
//! consumer: while every lane is stuck on a batch the reader stops reading,
//! and the gauge keeps the lag it had then. `ductor_ingress_stalled_lanes`
//! and readiness tell that case.

use std::collections::HashMap;

use serde::Deserialize;

/// The part of librdkafka's statistics the lag is read from (see its
/// `STATISTICS.md`); every other field is ignored.
#[derive(Deserialize)]
struct Statistics {
    #[serde(default)]
    topics: HashMap<String, TopicStatistics>,
}

#[derive(Deserialize)]
struct TopicStatistics {
    #[serde(default)]
    partitions: HashMap<String, PartitionStatistics>,
}

#[derive(Deserialize)]
struct PartitionStatistics {
    partition: i32,
    /// `active` while this consumer fetches the partition; `none` or
    /// `stopped` once it is assigned elsewhere, when its offsets are stale.
    #[serde(default)]
    fetch_state: String,
    /// The end of the partition (the last stable offset, under
    /// `read_committed`) less the group's committed offset; -1 when either
    /// is not known.
    #[serde(default = "unknown")]
    consumer_lag: i64,
    /// The same against the offset stored for the next commit: known
    /// earlier, before the first commit of a new group.
    #[serde(default = "unknown")]
    consumer_lag_stored: i64,
    /// The first offset the partition still holds, the last stable offset
    /// and the high watermark; -1 when not known.
    #[serde(default = "unknown")]
    lo_offset: i64,
    #[serde(default = "unknown")]
    ls_offset: i64,
    #[serde(default = "unknown")]
    hi_offset: i64,
}

impl PartitionStatistics {
    /// Messages behind: against the committed offset, else the stored one,
    /// else (nothing stored yet, so nothing applied since this consumer
    /// took the partition, and a group without offsets starts at the
    /// earliest) the whole partition from its first offset on.
    fn lag(&self) -> u64 {
        let lag = if self.consumer_lag >= 0 {
            self.consumer_lag
        } else if self.consumer_lag_stored >= 0 {
            self.consumer_lag_stored
        } else {
            // The ingress reads committed records only: its end is the
            // last stable offset where the statistics know it.
            let end = if self.ls_offset >= 0 {
                self.ls_offset
            } else {
                self.hi_offset
            };
            if end >= 0 && self.lo_offset >= 0 {
                end - self.lo_offset
            } else {
                0
            }
        };
        u64::try_from(lag).unwrap_or(0)
    }
}

fn unknown() -> i64 {
    -1
}

/// The messages each of `topics` has that the group has not committed,
/// summed over the partitions this consumer fetches. The lag against the
/// committed offset is what Kafka's own tools report for the group; where
/// the group has committed nothing yet, what [`PartitionStatistics::lag`]
/// can tell stands in for it.
pub fn consumer_lag(
    statistics: &[u8],
    topics: &[String],
) -> Result<Vec<(String, u64)>, serde_json::Error> {
    let statistics: Statistics = serde_json::from_slice(statistics)?;
    Ok(topics
        .iter()
        .map(|topic| {
            let lag = statistics.topics.get(topic).map_or(0, |t| {
                t.partitions
                    .values()
                    // -1 is librdkafka's partition of messages not yet
                    // assigned to one; it is never fetched.
                    .filter(|p| p.partition >= 0 && p.fetch_state == "active")
                    .map(PartitionStatistics::lag)
                    .sum()
            });
            (topic.clone(), lag)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(id: i32, state: &str, lag: i64, stored: i64) -> serde_json::Value {
        serde_json::json!({
            "partition": id, "fetch_state": state, "consumer_lag": lag,
            "consumer_lag_stored": stored, "lo_offset": 40, "ls_offset": 100, "hi_offset": 100,
            "committed_offset": 100 - lag,
        })
    }

    fn statistics(partitions: &[serde_json::Value]) -> Vec<u8> {
        let partitions: serde_json::Map<String, serde_json::Value> = partitions
            .iter()
            .map(|p| (p["partition"].to_string(), p.clone()))
            .collect();
        serde_json::json!({
            "name": "ductor-ingress#consumer-1", "type": "consumer", "ts": 1,
            "topics": {"t.requests": {"topic": "t.requests", "partitions": partitions}},
        })
        .to_string()
        .into_bytes()
    }

    fn topics() -> Vec<String> {
        vec!["t.requests".into(), "t.wakeups".into()]
    }

    #[test]
    fn the_lag_is_summed_over_the_partitions_this_consumer_fetches() {
        let stats = statistics(&[
            partition(0, "active", 7, 5),
            partition(1, "active", 3, 3),
            // Assigned to another process: its offsets are stale.
            partition(2, "stopped", 50, 50),
            partition(3, "none", -1, -1),
            partition(-1, "none", 9, 9),
        ]);
        assert_eq!(
            consumer_lag(&stats, &topics()).unwrap(),
            vec![("t.requests".into(), 10), ("t.wakeups".into(), 0)]
        );
    }

    #[test]
    fn a_group_that_has_committed_nothing_counts_from_its_stored_offset_or_the_first() {
        let stored = statistics(&[partition(0, "active", -1, 4)]);
        assert_eq!(
            consumer_lag(&stored, &topics()).unwrap()[0],
            ("t.requests".into(), 4)
        );
        // Nothing stored either: the partition from its first offset (40)
        // to its last stable one (100).
        let nothing = statistics(&[partition(1, "active", -1, -1)]);
        assert_eq!(
            consumer_lag(&nothing, &topics()).unwrap()[0],
            ("t.requests".into(), 60)
        );
        // Offsets not fetched yet: nothing is known, nothing is counted.
        let unknown = br#"{"topics": {"t.requests": {"partitions": {"0": {"partition": 0,
            "fetch_state": "active", "consumer_lag": -1, "consumer_lag_stored": -1,
            "lo_offset": -1, "ls_offset": -1, "hi_offset": -1}}}}}"#;
        assert_eq!(
            consumer_lag(unknown, &topics()).unwrap()[0],
            ("t.requests".into(), 0)
        );
    }

    #[test]
    fn statistics_without_topics_give_every_topic_zero_and_garbage_is_an_error() {
        let lag = consumer_lag(br#"{"name": "c", "type": "consumer"}"#, &topics()).unwrap();
        assert_eq!(lag, vec![("t.requests".into(), 0), ("t.wakeups".into(), 0)]);
        assert!(consumer_lag(b"not json", &topics()).is_err());
    }
}
