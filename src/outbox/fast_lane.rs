//! The fast lane: intents that the apply transaction claimed as it
//! inserted them, handed over in memory right after the commit, so they go
//! out with no claim statement and no round to wait for.
//!
//! In, through a [`Handoff`] held by the apply layer: committed claims with
//! the instant their lease began; the claims of a commit whose outcome is
//! unknown; the positions a batch statement may have claimed when its reply
//! was lost. Out: the intents published and then marked completed, a few
//! large updates at a time; the rest given back to the claim rounds, which
//! are woken for them.
//!
//! Guarantees: bounded, with [`HANDOFF_QUEUE`] batches waiting and
//! [`FAST_LANE_IN_FLIGHT`] being published at once. A publish starts only
//! if it can end before the lease does; a batch that waited too long goes
//! back to the claim rounds instead. An intent is completed only after its
//! acknowledgement, and only while this drainer's claim stands. The lane
//! ends when the last [`Handoff`] is gone and only after everything handed
//! over was published and its completion written; if the process dies
//! first, the leases run out and the reconciler redrives the intents.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{Semaphore, mpsc};

use super::publish::{Cause, Unpublished};
use super::{ClaimedIntent, Drainer, IntentPosition, Wakeup};

/// Batches handed over at once before the apply waits for the fast lane.
const HANDOFF_QUEUE: usize = 64;

/// Handed-over batches being published at once.
const FAST_LANE_IN_FLIGHT: usize = 64;

/// The apply layer's side of the fast lane: who claims at insert, for how
/// long, and where the committed claims go.
#[derive(Clone)]
pub struct Handoff {
    drainer_id: String,
    lease_s: f64,
    sender: mpsc::Sender<Handed>,
    wakeup: Wakeup,
    /// Due intents committed as `pending` (they wait behind an undelivered
    /// one) since the fast lane last completed something.
    pending_behind: Arc<AtomicUsize>,
    /// Intents this lane published, see [`Handoff::delivered`] (read by
    /// the tests and harnesses only).
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
    delivered: Arc<AtomicU64>,
}

/// What the apply layer hands over after a transaction ended.
enum Handed {
    /// Committed and claimed by this drainer, the lease running since the
    /// instant given: publish now.
    Publish(Vec<ClaimedIntent>, Instant),
    /// The commit's outcome is unknown: give the claims back (a no-op if
    /// the transaction in fact rolled back).
    Release(Vec<i64>),
    /// A batch statement failed without its reply, which would have named
    /// the intents it claimed: give back, by position (run, seq, effect
    /// index), whatever it claimed if it committed after all.
    ReleaseAt(Vec<IntentPosition>),
}

/// The drainer's side of the fast lane.
pub struct FastLane {
    receiver: mpsc::Receiver<Handed>,
    pending_behind: Arc<AtomicUsize>,
    delivered: Arc<AtomicU64>,
}

impl Handoff {
    /// The claimer named in intents inserted as `claimed`.
    pub fn drainer_id(&self) -> &str {
        &self.drainer_id
    }

    /// The claim lease, in seconds.
    pub fn lease_s(&self) -> f64 {
        self.lease_s
    }

    /// How many intents this lane has published so far (acknowledged by
    /// the broker; their completion may still be on its way). It counts
    /// this lane alone, where `ductor_outbox_fast_lane_total` adds up every
    /// drainer of the process.
    #[cfg(any(test, feature = "internals"))]
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// After a commit: publish `claimed` now; wake the claim rounds when
    /// other due intents were committed as `pending`, and tell them when
    /// the commit's first timer falls due, so that an idle drainer looks
    /// again by then.
    pub async fn committed(
        &self,
        claimed: Vec<ClaimedIntent>,
        leased_at: Instant,
        pending_due: usize,
        next_timer: Option<DateTime<Utc>>,
    ) {
        if pending_due > 0 {
            self.pending_behind
                .fetch_add(pending_due, Ordering::Relaxed);
            self.wakeup.wake();
        }
        if let Some(at) = next_timer {
            self.wakeup.due_at(at);
        }
        if claimed.is_empty() {
            return;
        }
        if self
            .sender
            .send(Handed::Publish(claimed, leased_at))
            .await
            .is_err()
        {
            // The drainer stopped: the claims expire and are redriven.
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }

    /// After a commit whose outcome is unknown: hand the claims back.
    pub async fn uncertain(&self, claimed: Vec<i64>) {
        if !claimed.is_empty() && self.sender.send(Handed::Release(claimed)).await.is_err() {
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }

    /// After a batch statement that failed without its reply: whatever it
    /// may have claimed at these positions goes back to the claim rounds at
    /// once, instead of waiting for the lease. Nothing of it was handed over,
    /// so nothing of it is in flight.
    pub async fn uncertain_at(&self, positions: Vec<IntentPosition>) {
        if !positions.is_empty()
            && self
                .sender
                .send(Handed::ReleaseAt(positions))
                .await
                .is_err()
        {
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }
}

impl Drainer {
    /// The fast lane of this drainer: give the [`Handoff`] to the apply
    /// layer and the [`FastLane`] to [`run_with_fast_lane`].
    pub fn fast_lane(&self, wakeup: &Wakeup) -> (Handoff, FastLane) {
        let (sender, receiver) = mpsc::channel(HANDOFF_QUEUE);
        let pending_behind = self.pending_behind.clone();
        let delivered = Arc::new(AtomicU64::new(0));
        (
            Handoff {
                drainer_id: self.drainer_id.clone(),
                lease_s: self.config.lease_ms as f64 / 1000.0,
                sender,
                wakeup: wakeup.clone(),
                pending_behind: pending_behind.clone(),
                delivered: delivered.clone(),
            },
            FastLane {
                receiver,
                pending_behind,
                delivered,
            },
        )
    }

    /// Publishes one handed-over batch and passes what was delivered to
    /// the completer.
    async fn publish_handed(
        &self,
        claimed: Vec<ClaimedIntent>,
        leased_at: Instant,
        lane: &FastLaneShared,
    ) {
        // A publish must end before the lease does, or the reconciler could
        // hand the intent to another drainer while it is still in flight
        // (a duplicate that may land after a later effect). One that waited
        // too long in the lane goes back to the claim rounds instead.
        let lease = Duration::from_millis(self.config.lease_ms);
        if leased_at.elapsed() + self.publish_timeout >= lease {
            let late: Vec<Unpublished> = claimed
                .iter()
                .map(|c| {
                    Unpublished::new(
                        c.intent_id,
                        "waited too long in the fast lane",
                        Cause::NotTried,
                    )
                })
                .collect();
            if let Err(e) = self.release(&late).await {
                tracing::warn!(error = format!("{e:#}"), "releasing late intents failed");
            }
            lane.wakeup.wake();
            return;
        }
        let (delivered, failed) = self.publish_all(&claimed).await;
        metrics::counter!("ductor_outbox_fast_lane_total").increment(delivered.len() as u64);
        lane.delivered
            .fetch_add(delivered.len() as u64, Ordering::Relaxed);
        if let Err(e) = self.restart_late_clocks(&claimed, &delivered).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "restarting late step clocks failed"
            );
        }
        if !delivered.is_empty() {
            crate::crash_point!("drainer.after_publish");
            // The completer outlives every publish task.
            let _ = lane.completions.send(delivered);
        }
        if !failed.is_empty() {
            if let Err(e) = self.release(&failed).await {
                tracing::warn!(error = format!("{e:#}"), "releasing failed intents failed");
            }
            lane.wakeup.wake();
        }
    }
}

struct FastLaneShared {
    completions: mpsc::UnboundedSender<Vec<i64>>,
    wakeup: Wakeup,
    delivered: Arc<AtomicU64>,
}

/// Marks what the fast lane delivered completed: everything that arrived
/// while the previous statement ran goes into the next one, so a busy lane
/// makes few, large updates instead of one per batch.
async fn completer(
    drainer: Arc<Drainer>,
    mut completions: mpsc::UnboundedReceiver<Vec<i64>>,
    pending_behind: Arc<AtomicUsize>,
    wakeup: Wakeup,
) {
    while let Some(first) = completions.recv().await {
        let mut ids = first;
        while ids.len() < drainer.config.batch_max_intents {
            match completions.try_recv() {
                Ok(more) => ids.extend(more),
                Err(_) => break,
            }
        }
        if let Err(e) = drainer.complete(&ids).await {
            // Left claimed: after the lease they are published again, with
            // the same key and bytes.
            tracing::warn!(
                error = format!("{e:#}"),
                "marking published intents completed failed"
            );
        }
        // Intents committed behind these may be claimable now.
        if pending_behind.load(Ordering::Relaxed) > 0 {
            wakeup.wake();
        }
    }
}

/// Publishes what the apply layer hands over until every [`Handoff`] is
/// gone (the ingress and the API stopped, so a batch committed during
/// shutdown is still published), then waits for the publishes in flight
/// and their completion.
pub(super) async fn fast_lane(drainer: Arc<Drainer>, mut lane: FastLane, wakeup: Wakeup) {
    let (completions, completed) = mpsc::unbounded_channel();
    let completing = tokio::spawn(completer(
        drainer.clone(),
        completed,
        lane.pending_behind.clone(),
        wakeup.clone(),
    ));
    let shared = Arc::new(FastLaneShared {
        completions,
        wakeup,
        delivered: lane.delivered.clone(),
    });
    let in_flight = Arc::new(Semaphore::new(FAST_LANE_IN_FLIGHT));
    let tasks = tokio_util::task::TaskTracker::new();
    while let Some(handed) = lane.receiver.recv().await {
        match handed {
            Handed::Publish(claimed, leased_at) => {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let (drainer, shared) = (drainer.clone(), shared.clone());
                tasks.spawn(async move {
                    drainer.publish_handed(claimed, leased_at, &shared).await;
                    drop(permit);
                });
            }
            Handed::Release(ids) => {
                let failed: Vec<Unpublished> = ids
                    .into_iter()
                    .map(|id| {
                        Unpublished::new(id, "the commit's outcome was unknown", Cause::NotTried)
                    })
                    .collect();
                if let Err(e) = drainer.release(&failed).await {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "giving back uncertain claims failed"
                    );
                }
                shared.wakeup.wake();
            }
            Handed::ReleaseAt(positions) => {
                if let Err(e) = drainer.release_at(&positions).await {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "giving back the claims of an uncertain batch failed"
                    );
                }
                shared.wakeup.wake();
            }
        }
    }
    tasks.close();
    tasks.wait().await;
    drop(shared);
    let _ = completing.await;
}
