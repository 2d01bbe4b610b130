//! The results frontier: an instant before which every attempt result on
//! the attempt-results topic has been applied, because the coordinator
//! group's committed offsets are past every record written before it.
//!
//! A step's timeout timer is published only once the frontier has passed
//! its deadline. A result a worker sent in time then always beats the
//! timeout, however long the partition it sits on waits for a crashed
//! `serve` to come back or for Postgres to return: a crash of Ductor delays
//! a timeout, it never turns a timely answer into a failed run.
//!
//! The frontier is probed from Kafka alone (committed offsets, high
//! watermarks, `offsets_for_times`), at the instant of the probe (the group
//! has caught up), `drainer.results_frontier_lag_ms` before it, and four
//! times that: under load a timeout fires up to that lag late.
//!
//! It is probed only while it is wanted: while a timeout is held whose
//! deadline has passed by the clock but not yet by the frontier. The
//! drainer says which deadline it waits for each time it looks at its
//! backlog ([`Frontier::want`]). With no timeout held back, as at idle,
//! nothing is probed and nothing wakes the drainer: a probe is a dozen
//! broker requests and a drain round, four times a second.
//!
//! In: the committed offsets of the coordinator's group (`kafka.group_id`)
//! on the attempt-results topic, every
//! `drainer.results_frontier_interval_ms` while wanted. Out: the
//! [`Frontier`] the drainer reads, a call of `moved` each time it
//! advances, and `ductor_results_frontier_lag_seconds` (0 when no timeout
//! waits for it). Guarantees: it only moves forward; a tracked one starts
//! at the epoch, so no timeout goes out before a probe has passed its
//! deadline; a failed probe leaves it where it was: timeouts wait, they
//! never go early.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::config::KafkaConfig;

/// The frontier as the drainer reads it; `None` when it is not tracked (a
/// drainer without an ingress to wait for, as in some tests), and then
/// timeouts are published when due.
#[derive(Debug, Clone, Default)]
pub struct Frontier(Option<Arc<Tracked>>);

#[derive(Debug)]
struct Tracked {
    /// The frontier, in milliseconds since the epoch.
    at: AtomicI64,
    /// The deadline of the earliest timeout held for it (`i64::MAX`: none).
    wanted: AtomicI64,
}

impl Frontier {
    /// A frontier that starts before everything: no timeout is published
    /// until the first probe has passed its deadline. It is wanted from
    /// the start, until the drainer first says what it waits for.
    pub fn tracked() -> Frontier {
        Frontier(Some(Arc::new(Tracked {
            at: AtomicI64::new(0),
            wanted: AtomicI64::new(UNSAID),
        })))
    }

    pub fn at(&self) -> Option<DateTime<Utc>> {
        let ms = self.0.as_ref()?.at.load(Ordering::Relaxed);
        DateTime::from_timestamp_millis(ms)
    }

    /// Moves it forward to `ms` (never back); true when it moved.
    pub fn advance(&self, ms: i64) -> bool {
        self.0
            .as_ref()
            .is_some_and(|f| f.at.fetch_max(ms, Ordering::Relaxed) < ms)
    }

    /// The drainer's word on what it waits for: the deadline of the
    /// earliest timeout the frontier holds back, or `None` when none is.
    pub fn want(&self, deadline: Option<DateTime<Utc>>) {
        if let Some(f) = &self.0 {
            let ms = deadline.map_or(i64::MAX, |d| d.timestamp_millis());
            f.wanted.store(ms, Ordering::Relaxed);
        }
    }

    /// Whether a probe at `now_ms` could release a held timeout.
    pub fn wanted_at(&self, now_ms: i64) -> bool {
        self.0.as_ref().is_some_and(|f| {
            wanted(
                f.wanted.load(Ordering::Relaxed),
                f.at.load(Ordering::Relaxed),
                now_ms,
            )
        })
    }
}

/// The wanted deadline before the drainer first said it.
const UNSAID: i64 = i64::MIN;

/// A probe is wanted when the earliest held deadline has passed by the
/// clock and the frontier has not passed it yet, or when the drainer has
/// not said yet.
fn wanted(deadline: i64, at: i64, now_ms: i64) -> bool {
    deadline == UNSAID || (deadline <= now_ms && at < deadline)
}

/// One partition as probed: what the group committed (`None`: nothing
/// yet), its high watermark, and the first offset whose timestamp is at or
/// after the probed instant (`None`: no such record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probed {
    pub committed: Option<i64>,
    pub high: i64,
    pub first_at_or_after: Option<i64>,
}

/// Every record written before the probed instant has been applied: on
/// each partition the committed offset is past the last of them.
pub fn covered(partitions: &[Probed]) -> bool {
    partitions.iter().all(|p| {
        let needed = p.first_at_or_after.unwrap_or(p.high);
        p.committed.unwrap_or(0) >= needed
    })
}

/// The newest of `candidates` (instants, newest first) the group has
/// covered, if any.
fn probe(
    consumer: &BaseConsumer,
    topic: &str,
    candidates: &[i64],
    timeout: Duration,
) -> anyhow::Result<Option<i64>> {
    let md = consumer
        .fetch_metadata(Some(topic), timeout)
        .with_context(|| format!("fetching metadata of {topic}"))?;
    let partitions = md
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len() as i32);
    anyhow::ensure!(partitions > 0, "{topic} has no partitions");
    let mut all = TopicPartitionList::new();
    for p in 0..partitions {
        all.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(all, timeout)
        .context("fetching the coordinator's committed offsets")?;
    let mut base = Vec::with_capacity(partitions as usize);
    for p in 0..partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .with_context(|| format!("fetching watermarks of {topic}/{p}"))?;
        let committed = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        base.push((p, committed, high));
    }
    for &at in candidates {
        let mut times = TopicPartitionList::new();
        for p in 0..partitions {
            times
                .add_partition_offset(topic, p, Offset::Offset(at))
                .context("building the offsets-for-times request")?;
        }
        let found = consumer
            .offsets_for_times(times, timeout)
            .context("looking up offsets by time")?;
        let probed: Vec<Probed> = base
            .iter()
            .map(|&(p, committed, high)| Probed {
                committed,
                high,
                first_at_or_after: match found.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => Some(o),
                    _ => None,
                },
            })
            .collect();
        if covered(&probed) {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

/// What [`run`] probes, and how often.
#[derive(Debug, Clone)]
pub struct FrontierOptions {
    pub kafka: KafkaConfig,
    pub group_id: String,
    pub topic: String,
    pub interval: Duration,
    pub lag: Duration,
}

fn reader(options: &FrontierOptions) -> anyhow::Result<BaseConsumer> {
    crate::infra::kafka::offsets_reader_config(
        &options.kafka,
        &options.group_id,
        "results-frontier",
    )
    .create()
    .context("creating the results-frontier reader")
}

/// The instants one probe at `now_ms` tries, newest first.
fn candidates(options: &FrontierOptions, now_ms: i64) -> [i64; 3] {
    let lag = options.lag.as_millis() as i64;
    [now_ms, now_ms - lag, now_ms - 4 * lag]
}

/// One probe now, with a reader of its own: the newest instant the
/// coordinator group has covered, in milliseconds since the epoch, if any
/// of those tried. Blocks on the broker.
#[cfg(any(test, feature = "internals"))]
pub fn probe_once(options: &FrontierOptions) -> anyhow::Result<Option<i64>> {
    let consumer = reader(options)?;
    let timeout = Duration::from_millis(options.kafka.admin_timeout_ms);
    let now = Utc::now().timestamp_millis();
    probe(
        &consumer,
        &options.topic,
        &candidates(options, now),
        timeout,
    )
}

/// Keeps `frontier` moving while it is wanted, until `shutdown`, calling
/// `moved` whenever it did (the drainer's wake-up: held timeouts may be
/// due now).
pub async fn run(
    options: FrontierOptions,
    frontier: Frontier,
    moved: impl Fn(),
    shutdown: CancellationToken,
) {
    let consumer = match reader(&options) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "no results frontier; timeouts wait"
            );
            return;
        }
    };
    let consumer = Arc::new(consumer);
    let timeout = Duration::from_millis(options.kafka.admin_timeout_ms);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(options.interval) => {}
        }
        let now = Utc::now().timestamp_millis();
        if !frontier.wanted_at(now) {
            metrics::gauge!("ductor_results_frontier_lag_seconds").set(0.0);
            continue;
        }
        let candidates = candidates(&options, now);
        let (consumer, topic) = (consumer.clone(), options.topic.clone());
        let probing =
            tokio::task::spawn_blocking(move || probe(&consumer, &topic, &candidates, timeout));
        // A probe waits on the broker; shutting down does not wait for it.
        let probed = tokio::select! {
            _ = shutdown.cancelled() => return,
            probed = probing => probed,
        };
        match probed {
            Ok(Ok(Some(at))) => {
                failing = false;
                if frontier.advance(at) {
                    metrics::gauge!("ductor_results_frontier_lag_seconds")
                        .set((now - at) as f64 / 1000.0);
                    moved();
                }
            }
            Ok(Ok(None)) => {
                failing = false;
                if let Some(at) = frontier.at() {
                    metrics::gauge!("ductor_results_frontier_lag_seconds")
                        .set((now - at.timestamp_millis()) as f64 / 1000.0);
                }
            }
            Ok(Err(e)) if !failing => {
                failing = true;
                tracing::warn!(
                    error = format!("{e:#}"),
                    "probing the results frontier failed; timeouts wait"
                );
            }
            Ok(Err(_)) => {}
            Err(e) => tracing::error!(error = %e, "the results-frontier probe panicked"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(committed: Option<i64>, high: i64, first: Option<i64>) -> Probed {
        Probed {
            committed,
            high,
            first_at_or_after: first,
        }
    }

    #[test]
    fn an_instant_is_covered_once_every_partition_is_committed_past_it() {
        // Caught up everywhere, or nothing written yet.
        assert!(covered(&[p(Some(10), 10, None), p(None, 0, None)]));
        // Records after the instant may wait; those before may not.
        assert!(covered(&[p(Some(7), 10, Some(7))]));
        assert!(!covered(&[p(Some(6), 10, Some(7))]));
        // A partition behind its high watermark, with nothing after the
        // instant: what it holds was written before it.
        assert!(!covered(&[p(Some(10), 10, None), p(Some(3), 4, None)]));
        // Nothing committed on a partition that holds records.
        assert!(!covered(&[p(None, 2, None)]));
    }

    #[test]
    fn the_frontier_only_moves_forward_and_an_untracked_one_is_absent() {
        let f = Frontier::tracked();
        assert!(f.advance(1_000));
        assert!(!f.advance(500));
        assert_eq!(f.at().map(|t| t.timestamp_millis()), Some(1_000));
        assert_eq!(Frontier::default().at(), None);
        assert!(!Frontier::default().advance(1));
    }

    #[test]
    fn a_probe_is_wanted_only_while_a_held_deadline_has_passed_by_the_clock() {
        // Held, due by the clock, not yet passed by the frontier.
        assert!(wanted(1_000, 500, 1_000));
        // Not due yet, or already passed: the drainer has been woken.
        assert!(!wanted(1_000, 500, 999));
        assert!(!wanted(1_000, 1_000, 2_000));
        // Nothing held.
        assert!(!wanted(i64::MAX, 0, i64::MAX - 1));
        // Not said yet, however far the frontier is.
        assert!(wanted(UNSAID, 5_000, 0));
    }

    #[test]
    fn a_tracked_frontier_is_wanted_until_the_drainer_says_what_it_waits_for() {
        let f = Frontier::tracked();
        assert!(f.wanted_at(0), "wanted from the start");
        f.want(None);
        assert!(!f.wanted_at(i64::MAX - 1), "nothing held: never wanted");
        let deadline = DateTime::from_timestamp_millis(5_000).unwrap();
        f.want(Some(deadline));
        assert!(!f.wanted_at(4_999));
        assert!(f.wanted_at(5_000));
        assert!(f.advance(5_000));
        assert!(!f.wanted_at(6_000), "passed: the held timeout is free");
        assert!(
            !Frontier::default().wanted_at(0),
            "an untracked one never is"
        );
    }
}
