//! A producer that sends at once, for publishes that have no company.
//!
//! `kafka.linger_ms` makes every producer hold a record that long, waiting
//! for others to batch with it: under load that saves requests and broker
//! CPU, but a quiet system pays the whole linger on every hop of a run (a
//! three-step run crosses four drainer publishes and three worker results).
//! A [`PromptProducer`] is the same producer with `linger.ms` 0, used by
//! the drainer and the worker only when they are quiet: a round of at most
//! `kafka.prompt_max_in_flight` publishes that starts with nothing else of
//! theirs in flight and more than `kafka.prompt_after_ms` after the round
//! before it ([`PromptProducer::enter`]). A linger pays only if another
//! record comes within it; when the last one came longer ago than a linger,
//! the next likely will too; the default (10 ms, five lingers) leaves a
//! quarter of capacity, where rounds come every few milliseconds, to the
//! lingering producer.
//! So a run that moves alone crosses no linger, and under load, when
//! publishes overlap or follow each other closely, they batch as before.
//!
//! In: a producer configuration (the one the lingering producer is made
//! from) and the bound.
//! Out: each record's delivery, as a `FutureProducer` reports it.
//! Guarantees: the producer is made with its owner, at start (so the first
//! quiet run does not wait for its connection and producer id), and polled for delivery reports only while it has
//! records in flight, on one blocking thread, so with nothing to send it
//! costs no CPU (a `FutureProducer`'s own polling thread costs about 1 %
//! of a core, always). A record the producer cannot take is given back as
//! an error; nothing is retried here.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::channel::oneshot;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::producer::future_producer::Delivery;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, ProducerContext};

/// How long one poll for delivery reports lasts (it serves every report
/// that comes meanwhile): the poller ends at most this long after the last.
/// Not shorter: the client library spins through the last millisecond of
/// each wait, so a poller of 5 ms waits would spin a fifth of the time.
const POLL_WAIT: Duration = Duration::from_millis(100);

/// Whether a round of `publishes` that starts with `in_flight` others
/// still unacknowledged, `since_last` after the round before it, goes out
/// at once: nothing else is in flight, the last round came more than
/// `after` ago, and the round is at most `quiet_max` (0: never).
fn is_quiet(
    in_flight: usize,
    since_last: Duration,
    publishes: usize,
    after: Duration,
    quiet_max: usize,
) -> bool {
    in_flight == 0 && since_last > after && publishes <= quiet_max && quiet_max > 0
}

/// A round of publishes in flight, from [`PromptProducer::enter`].
pub struct Turn<'a> {
    /// Whether it goes out on the prompt producer.
    pub prompt: bool,
    _guard: InFlightGuard<'a>,
}

/// Counts a process's publishes in flight for [`is_quiet`]; each
/// [`InFlight::enter`] is a round of them until its guard drops.
#[derive(Debug, Default)]
struct InFlight(AtomicUsize);

impl InFlight {
    /// Registers `n` publishes; returns how many others were in flight, and
    /// the guard that ends them.
    fn enter(&self, n: usize) -> (usize, InFlightGuard<'_>) {
        let before = self.0.fetch_add(n, Ordering::AcqRel);
        (before, InFlightGuard(&self.0, n))
    }
}

/// A round of publishes in flight; dropping it ends them.
struct InFlightGuard<'a>(&'a AtomicUsize, usize);

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// Hands each delivery report to the task that sent the record.
struct Reports {
    outstanding: Arc<AtomicUsize>,
}

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = Box<oneshot::Sender<Result<Delivery, KafkaError>>>;

    fn delivery(&self, result: &DeliveryResult<'_>, sender: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(message) => Ok(Delivery {
                partition: message.partition(),
                offset: message.offset(),
                timestamp: message.timestamp(),
            }),
            Err((error, _)) => Err(error.clone()),
        };
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
        // The sender may have stopped waiting (its task was cancelled).
        let _ = sender.send(owned);
    }
}

struct Made {
    producer: BaseProducer<Reports>,
    outstanding: Arc<AtomicUsize>,
    /// Whether a poller runs; there is at most one.
    polling: AtomicBool,
}

/// A producer with no linger, polled only while it has records in flight.
/// Cheap to clone.
#[derive(Clone)]
pub struct PromptProducer {
    made: Arc<Made>,
    /// Every publish of its process, on this producer or the lingering one.
    in_flight: Arc<InFlight>,
    /// When the last round started, in microseconds since `epoch`.
    last_round_us: Arc<AtomicU64>,
    epoch: Instant,
    /// How long after the last round a round may be quiet.
    quiet_after: Duration,
    quiet_max: usize,
}

impl PromptProducer {
    /// From the configuration of the producer it stands in for, with
    /// `linger.ms` 0, used for quiet rounds of at most `quiet_max`
    /// publishes (`kafka.prompt_max_in_flight`) that start more than
    /// `quiet_after` after the round before (`kafka.prompt_after_ms`); the
    /// producer is made now, and a configuration the client refuses is
    /// refused now.
    pub fn new(
        config: ClientConfig,
        quiet_max: usize,
        quiet_after: Duration,
    ) -> anyhow::Result<PromptProducer> {
        let outstanding = Arc::new(AtomicUsize::new(0));
        let producer = unlingered(config)
            .create_with_context(Reports {
                outstanding: outstanding.clone(),
            })
            .context("creating a kafka producer")?;
        Ok(PromptProducer {
            made: Arc::new(Made {
                producer,
                outstanding,
                polling: AtomicBool::new(false),
            }),
            in_flight: Arc::default(),
            last_round_us: Arc::default(),
            epoch: Instant::now(),
            quiet_after,
            quiet_max,
        })
    }

    /// Registers a round of `publishes` about to start, on whichever
    /// producer; the turn says whether they go out on this one, and ends
    /// when dropped.
    pub fn enter(&self, publishes: usize) -> Turn<'_> {
        let (others, guard) = self.in_flight.enter(publishes);
        // Microseconds since the epoch, plus one so that no round is at 0,
        // which stands for "none yet".
        let now_us = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1) + 1;
        let last_us = self.last_round_us.swap(now_us, Ordering::AcqRel);
        let since_last = if last_us == 0 {
            Duration::MAX
        } else {
            Duration::from_micros(now_us.saturating_sub(last_us))
        };
        Turn {
            prompt: is_quiet(
                others,
                since_last,
                publishes,
                self.quiet_after,
                self.quiet_max,
            ),
            _guard: guard,
        }
    }

    /// Sends one record and waits for the broker's acknowledgement (or the
    /// producer's `message.timeout.ms`).
    pub async fn send(
        &self,
        topic: &str,
        key: &[u8],
        payload: &[u8],
        headers: OwnedHeaders,
    ) -> Result<Delivery, KafkaError> {
        let made = &self.made;
        let (sender, report) = oneshot::channel();
        let record = BaseRecord::with_opaque_to(topic, Box::new(sender))
            .key(key)
            .payload(payload)
            .headers(headers);
        // Counted before it is handed over: its report may come at once.
        made.outstanding.fetch_add(1, Ordering::AcqRel);
        if let Err((error, _)) = made.producer.send(record) {
            made.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(error);
        }
        if !made.polling.swap(true, Ordering::AcqRel) {
            poll_while_outstanding(made.clone());
        }
        report.await.unwrap_or(Err(KafkaError::Canceled))
    }
}

/// The configuration of the prompt producer: its lingering twin's, with
/// `linger.ms` 0.
fn unlingered(mut config: ClientConfig) -> ClientConfig {
    config.set("linger.ms", "0");
    config
}

/// Serves delivery reports on a blocking thread until none is awaited; the
/// one poller, started by a send that found none running. Before it ends
/// it looks once more: a send that came while it was ending found it still
/// running and started none.
fn poll_while_outstanding(made: Arc<Made>) {
    tokio::task::spawn_blocking(move || {
        loop {
            while made.outstanding.load(Ordering::Acquire) > 0 {
                made.producer.poll(POLL_WAIT);
            }
            made.polling.store(false, Ordering::Release);
            if made.outstanding.load(Ordering::Acquire) == 0
                || made.polling.swap(true, Ordering::AcqRel)
            {
                return;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_means_alone_a_linger_after_the_last_round_and_small() {
        let ms = Duration::from_millis;
        assert!(is_quiet(0, ms(10), 1, ms(2), 4));
        assert!(is_quiet(0, Duration::MAX, 4, ms(2), 4), "the first round");
        assert!(
            !is_quiet(0, ms(10), 5, ms(2), 4),
            "a round larger than the bound batches"
        );
        assert!(
            !is_quiet(1, ms(10), 1, ms(2), 4),
            "others in flight: batch with them"
        );
        assert!(
            !is_quiet(0, ms(1), 1, ms(2), 4),
            "the last round came within a linger"
        );
        assert!(!is_quiet(0, ms(10), 1, ms(2), 0), "0 turns it off");
    }

    #[test]
    fn in_flight_counts_the_others_and_ends_with_its_guard() {
        let count = InFlight::default();
        let (first, a) = count.enter(2);
        let (second, b) = count.enter(1);
        assert_eq!((first, second), (0, 2));
        drop(a);
        let (third, c) = count.enter(1);
        assert_eq!(third, 1);
        drop((b, c));
        assert_eq!(count.enter(1).0, 0);
    }

    #[test]
    fn a_configuration_the_client_refuses_is_refused_at_once() {
        let mut config = ClientConfig::new();
        config.set("acks", "not a number");
        let refused = PromptProducer::new(config, 4, Duration::ZERO)
            .err()
            .expect("refused");
        assert!(format!("{refused:#}").contains("acks"), "{refused:#}");
    }

    #[test]
    fn its_linger_is_zero_whatever_it_was_given() {
        let mut config = ClientConfig::new();
        config.set("linger.ms", "50");
        assert_eq!(unlingered(config).get("linger.ms"), Some("0"));
    }

    #[test]
    fn a_turn_is_prompt_only_alone_and_after_a_pause() {
        let config = ClientConfig::new();
        let after = Duration::from_millis(2);
        let mut prompt = PromptProducer::new(config.clone(), 2, after).expect("valid");
        // Its clock started a second ago, so that a round at its start is a
        // second before now.
        prompt.epoch -= Duration::from_secs(1);
        let first = prompt.enter(2);
        assert!(first.prompt, "the first round");
        drop(first);
        assert!(!prompt.enter(1).prompt, "right after the round before");
        // The last round at the clock's start: a second ago.
        prompt.last_round_us.store(1, Ordering::Release);
        let alone = prompt.enter(1);
        assert!(alone.prompt, "alone, a pause after the last round");
        prompt.last_round_us.store(1, Ordering::Release);
        assert!(!prompt.enter(1).prompt, "the last one is still in flight");
        drop(alone);
        prompt.last_round_us.store(1, Ordering::Release);
        assert!(!prompt.enter(3).prompt, "a round over the bound");
        let off = PromptProducer::new(config, 0, after).expect("valid");
        assert!(!off.enter(1).prompt, "0 turns it off");
    }
}
