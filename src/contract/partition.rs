//! The partitioning rule every producer of Ductor's inputs follows: the
//! partition of a run's input is `toPositive(murmur2(run_id)) % partitions`,
//! the Java client's default partitioner (and Kafka Streams', and Kafka
//! Connect's), which librdkafka calls `murmur2_random`.
//!
//! A run has one writer only while all its inputs land on one partition
//! number of each input topic: the range assignor gives partition p of
//! every input topic to one process. Two producers that hash a run's key
//! differently (librdkafka's default is CRC32) put its inputs on two
//! partitions, owned by two processes. Ductor's producers all set
//! [`PARTITIONER`]; the ingress checks each input against
//! [`partition_for`] and forwards one that is elsewhere.
//!
//! In: key bytes and a partition count. Out: a partition. Pure; the
//! figures match `org.apache.kafka.common.utils.Utils.murmur2`.

/// The librdkafka `partitioner` every producer of Ductor sets: murmur2 of
/// the key, as the Java client, for keyed messages (random for unkeyed
/// ones, which Ductor never produces).
pub const PARTITIONER: &str = "murmur2_random";

/// Kafka's murmur2 (32-bit, seed `0x9747b28c`) of `data`, as the Java
/// client computes it.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let length = data.len();
    let mut h: u32 = SEED ^ (length as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition a message keyed `key` belongs on, of `partitions` (at
/// least one): the Java client's `toPositive(murmur2(key)) % partitions`.
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    let positive = murmur2(key) & 0x7fff_ffff;
    positive % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures of the Java client's `Utils.murmur2` (kafka-clients 4.4.0),
    /// the reference every other client follows.
    const JAVA: [(&str, i32, i32); 8] = [
        ("21", -973_932_308, 0),
        ("foobar", -790_332_482, 6),
        ("a-little-bit-long-string", -985_981_536, 8),
        ("a-little-bit-longer-string", -1_486_304_829, 11),
        (
            "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58_897_971,
            5,
        ),
        ("abc", 479_470_107, 3),
        ("run-1", 637_533_037, 1),
        ("", 275_646_681, 9),
    ];

    #[test]
    fn murmur2_matches_the_java_client() {
        for (key, hash, partition_of_12) in JAVA {
            assert_eq!(murmur2(key.as_bytes()), hash, "murmur2({key:?})");
            assert_eq!(
                partition_for(key.as_bytes(), 12),
                partition_of_12,
                "partition of {key:?} among 12"
            );
        }
    }

    #[test]
    fn every_partition_is_in_range() {
        for n in 1..=7 {
            for i in 0..500 {
                let p = partition_for(format!("run-{i}").as_bytes(), n);
                assert!((0..n).contains(&p), "{p} of {n}");
            }
        }
        assert_eq!(partition_for(b"x", 0), 0, "no partitions is read as one");
    }
}
