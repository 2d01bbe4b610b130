//! The worker's loop: dispatches in, attempts spawned, offsets stored.
//!
//! In: the records of the pool's dispatch topic. Out: attempt tasks, at most
//! `max_in_flight` at once, and the stored offsets of the dispatches they
//! finished. Guarantees: the consumer is not polled while the bound is
//! reached; a dispatch that cannot be decoded, or whose deadline has passed
//! (counted from its publication when that was late), is skipped and its
//! offset stored; an offset is stored only once its result is acknowledged,
//! and never past an unfinished dispatch of its partition; at shutdown,
//! attempts still running after the grace are abandoned with their offsets
//! unstored, so they are redelivered.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::consumer::Consumer;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio::task::JoinError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::attempt::{Finished, attempt};
use super::offsets::Ticket;
use super::{Shared, StepDispatch, StepOutcome, Worker, count};

/// Pause after a consumer error, so a broken connection does not spin.
const CONSUMER_ERROR_PAUSE: Duration = Duration::from_millis(100);

impl Worker {
    pub(super) async fn consume<F, Fut>(
        &mut self,
        shared: &Arc<Shared<F>>,
        max_in_flight: usize,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()>
    where
        F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StepOutcome> + Send + 'static,
    {
        loop {
            let room = self.tasks.len() < max_in_flight;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(joined) = self.tasks.join_next() => self.finished(joined)?,
                msg = self.consumer.recv(), if room => match msg {
                    Ok(msg) => {
                        let ticket = self.tracker.received(msg.partition(), msg.offset());
                        let payload = msg.payload().unwrap_or_default();
                        if let Some(step) = self.admit(&shared.pool, payload, &msg) {
                            let span = tracing::info_span!(
                                "step",
                                run_id = %step.run_id,
                                step = %step.step,
                                attempt = step.attempt,
                                stamp = %step.stamp,
                            );
                            let trace = trace_context(&msg);
                            self.tasks.spawn(
                                attempt(shared.clone(), step, trace, ticket).instrument(span),
                            );
                        } else {
                            self.done(ticket);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "kafka consumer error");
                        tokio::select! {
                            _ = shutdown.cancelled() => return Ok(()),
                            _ = tokio::time::sleep(CONSUMER_ERROR_PAUSE) => {}
                        }
                    }
                },
            }
        }
    }

    /// The dispatch to run, or `None` for one to skip (its offset is stored).
    /// Its deadline counts from when it was published, when that was late
    /// (see [`crate::contract::LATE_DISPATCH_MS`]).
    fn admit(&self, pool: &str, payload: &[u8], msg: &impl Message) -> Option<StepDispatch> {
        let step = match StepDispatch::decode(payload) {
            Ok(step) => step,
            Err(e) => {
                // The coordinator wrote it, so this is a version mismatch
                // that no retry fixes; the step's timeout takes over.
                tracing::warn!(
                    topic = msg.topic(),
                    partition = msg.partition(),
                    offset = msg.offset(),
                    error = %e,
                    "skipping undecodable step dispatch"
                );
                count(pool, "undecodable");
                return None;
            }
        };
        let mut step = step;
        step.deadline += dispatch_delay(msg);
        if step.is_expired(Utc::now()) {
            tracing::debug!(
                run_id = %step.run_id,
                step = %step.step,
                attempt = step.attempt,
                stamp = %step.stamp,
                deadline = %step.deadline,
                "skipping step dispatch past its deadline"
            );
            count(pool, "expired");
            return None;
        }
        Some(step)
    }

    fn finished(&mut self, joined: Result<Finished, JoinError>) -> anyhow::Result<()> {
        match joined {
            Ok(Finished::Published(ticket)) => self.done(ticket),
            Ok(Finished::NotPublished) => {}
            Ok(Finished::HookStopped) => {
                anyhow::bail!("crash hook: stopped after the handler, before publishing")
            }
            Err(e) if e.is_cancelled() => {}
            // Handler panics are caught inside the task; this is a bug here.
            Err(e) => return Err(anyhow::Error::new(e).context("worker task panicked")),
        }
        Ok(())
    }

    /// Records a finished dispatch and stores the partition's new position
    /// if it moved.
    fn done(&mut self, ticket: Ticket) {
        let Some(next) = self.tracker.complete(ticket) else {
            return;
        };
        let mut tpl = TopicPartitionList::with_capacity(1);
        if let Err(e) =
            tpl.add_partition_offset(&self.topic, ticket.partition, Offset::Offset(next))
        {
            tracing::warn!(error = %e, partition = ticket.partition, "could not record offset");
            return;
        }
        if let Err(e) = self.consumer.store_offsets(&tpl) {
            tracing::info!(
                error = %e,
                partition = ticket.partition,
                "offset not stored (partition revoked?); the dispatch may be redelivered"
            );
        }
    }

    /// Waits for in-flight attempts, at most `grace`; abandons the rest.
    pub(super) async fn drain(&mut self, grace: Duration) -> anyhow::Result<()> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        tracing::info!(
            in_flight = self.tasks.len(),
            grace_ms = grace.as_millis() as u64,
            "worker stopping, waiting for in-flight steps"
        );
        let deadline = Instant::now() + grace;
        loop {
            match tokio::time::timeout_at(deadline, self.tasks.join_next()).await {
                Ok(Some(joined)) => self.finished(joined)?,
                Ok(None) => return Ok(()),
                Err(_) => {
                    tracing::warn!(
                        abandoned = self.tasks.len(),
                        "in-flight steps did not finish within the shutdown grace; they will be redelivered"
                    );
                    self.tasks.shutdown().await;
                    return Ok(());
                }
            }
        }
    }
}

/// How late a dispatch was published: its record's timestamp (set when the
/// drainer produced it) past its `ce_time` (when the transition committed),
/// when that is more than [`crate::contract::LATE_DISPATCH_MS`]; zero
/// otherwise, or when either is missing.
fn dispatch_delay(msg: &impl Message) -> chrono::TimeDelta {
    let produced = msg.timestamp().to_millis();
    let committed = msg
        .headers()
        .and_then(|hs| {
            hs.iter()
                .find(|h| h.key == crate::contract::headers::CE_TIME)
                .and_then(|h| h.value)
        })
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| DateTime::parse_from_rfc3339(v).ok())
        .map(|t| t.timestamp_millis());
    match (produced, committed) {
        (Some(p), Some(c)) if p - c > crate::contract::LATE_DISPATCH_MS => {
            chrono::TimeDelta::milliseconds(p - c)
        }
        _ => chrono::TimeDelta::zero(),
    }
}

/// The W3C trace context of a dispatch (its `traceparent` and
/// `tracestate` headers), which the attempt's result continues.
fn trace_context(msg: &impl Message) -> Option<crate::contract::TraceContext> {
    use crate::contract::headers::{TRACEPARENT, TRACESTATE};
    let headers = msg.headers()?;
    let values = |name: &'static str| {
        headers
            .iter()
            .filter(move |h| h.key == name)
            .filter_map(|h| h.value)
    };
    crate::contract::TraceContext::from_values(values(TRACEPARENT), values(TRACESTATE))
}
