//! A producer that sends at once, for publishes that have no company.
//!
//! `kafka.linger_ms` makes every producer hold a record that long, waiting
//! for others to batch with it: under load that saves requests and broker
//! CPU, but a quiet system pays the whole linger on every hop of a run (a
//! three-step run crosses four drainer publishes and three worker results).
//! A [`PromptProducer`] is the same producer with `linger.ms` 0, used by
//! the drainer and the worker only while few of their publishes are in
//! flight ([`is_quiet`]), so the linger grows from nothing at idle to
//! `kafka.linger_ms` under load.
//!
//! In: a producer configuration (the one the shared producer is made from).
//! Out: each record's delivery, as a `FutureProducer` reports it. Guarantees: the producer is made when the first
//! record is sent, and then polled for delivery reports only while it has
//! records in flight, on a blocking thread, so with nothing to send it
//! costs no CPU (a `FutureProducer`'s own polling thread costs about 1 %
//! of a core, always). A record the producer cannot take is given back as
//! an error; nothing is retried here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Context;
use futures::channel::oneshot;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::producer::future_producer::Delivery;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, ProducerContext};

/// Longest wait of one poll for delivery reports; a report ends it early.
const POLL_WAIT: Duration = Duration::from_millis(100);

/// Whether a publish that starts with `in_flight` others of its process
/// still unacknowledged goes out at once: fewer than `quiet_max`
/// (0: never).
pub fn is_quiet(in_flight: usize, quiet_max: usize) -> bool {
    in_flight < quiet_max
}

/// Counts a process's publishes in flight for [`is_quiet`]; each
/// [`InFlight::enter`] is one publish until its guard drops.
#[derive(Debug, Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    /// Registers a publish; returns how many others were in flight, and the
    /// guard that ends it.
    pub fn enter(&self) -> (usize, InFlightGuard<'_>) {
        let before = self.0.fetch_add(1, Ordering::AcqRel);
        (before, InFlightGuard(&self.0))
    }
}

/// One publish in flight; dropping it ends it.
pub struct InFlightGuard<'a>(&'a AtomicUsize);

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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
}

/// A producer with no linger, made on first use and polled only while it
/// has records in flight. Cheap to clone.
#[derive(Clone)]
pub struct PromptProducer {
    config: ClientConfig,
    made: Arc<OnceLock<Arc<Made>>>,
    making: Arc<Mutex<()>>,
}

impl PromptProducer {
    /// From the configuration of the producer it stands in for, with
    /// `linger.ms` 0; the configuration is checked now.
    pub fn new(mut config: ClientConfig) -> anyhow::Result<PromptProducer> {
        config.set("linger.ms", "0");
        config
            .create_native_config()
            .context("checking a kafka producer's configuration")?;
        Ok(PromptProducer {
            config,
            made: Arc::default(),
            making: Arc::default(),
        })
    }

    fn made(&self) -> anyhow::Result<Arc<Made>> {
        if let Some(made) = self.made.get() {
            return Ok(made.clone());
        }
        let _one = self.making.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(made) = self.made.get() {
            return Ok(made.clone());
        }
        let outstanding = Arc::new(AtomicUsize::new(0));
        let producer = self
            .config
            .create_with_context(Reports {
                outstanding: outstanding.clone(),
            })
            .context("creating kafka producer")?;
        let made = Arc::new(Made {
            producer,
            outstanding,
        });
        let _ = self.made.set(made.clone());
        Ok(made)
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
        let made = self
            .made()
            .map_err(|e| KafkaError::ClientCreation(format!("{e:#}")))?;
        let (sender, report) = oneshot::channel();
        let record = BaseRecord::with_opaque_to(topic, Box::new(sender))
            .key(key)
            .payload(payload)
            .headers(headers);
        // Counted before it is handed over: its report may come at once.
        let before = made.outstanding.fetch_add(1, Ordering::AcqRel);
        if let Err((error, _)) = made.producer.send(record) {
            made.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(error);
        }
        if before == 0 {
            poll_while_outstanding(made);
        }
        report.await.unwrap_or(Err(KafkaError::Canceled))
    }
}

/// Serves delivery reports on a blocking thread until none is awaited.
/// Started by the send that found nothing outstanding; a send that comes
/// while the last poller is ending starts another, which is harmless.
fn poll_while_outstanding(made: Arc<Made>) {
    tokio::task::spawn_blocking(move || {
        while made.outstanding.load(Ordering::Acquire) > 0 {
            made.producer.poll(POLL_WAIT);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_means_fewer_in_flight_than_the_bound() {
        assert!(is_quiet(0, 1));
        assert!(is_quiet(7, 8));
        assert!(!is_quiet(8, 8));
        assert!(!is_quiet(0, 0), "0 turns it off");
    }

    #[test]
    fn in_flight_counts_the_others_and_ends_with_its_guard() {
        let count = InFlight::default();
        let (first, a) = count.enter();
        let (second, b) = count.enter();
        assert_eq!((first, second), (0, 1));
        drop(a);
        let (third, c) = count.enter();
        assert_eq!(third, 1);
        drop((b, c));
        assert_eq!(count.enter().0, 0);
    }

    #[test]
    fn a_configuration_the_client_refuses_is_refused_at_once() {
        let mut config = ClientConfig::new();
        config.set("acks", "not a number");
        let refused = PromptProducer::new(config).err().expect("refused");
        assert!(format!("{refused:#}").contains("acks"), "{refused:#}");
    }

    #[test]
    fn its_linger_is_zero_whatever_it_was_given() {
        let mut config = ClientConfig::new();
        config.set("linger.ms", "50");
        let prompt = PromptProducer::new(config).expect("valid");
        assert_eq!(prompt.config.get("linger.ms"), Some("0"));
    }
}
