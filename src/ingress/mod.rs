//! The coordinator's Kafka ingress.
//!
//! In: the records of `requests`, `wakeups` and `attempt-results`, read by
//! the group `kafka.group_id`. Out: batches applied by the apply stage,
//! dead letters, stored offsets, and a [`StepReport`] per batch.
//! Guarantees: a batch stops growing at `coordinator.batch_max_inputs`
//! messages or `coordinator.batch_max_bytes` bytes; an offset is stored
//! only after its batch committed and its dead letters were recorded and
//! acknowledged.
//!
//! One consumer group reads `requests`, `wakeups` and `attempt-results`.
//! Messages are gathered into bounded batches, decoded, and applied in one
//! Postgres transaction by the [`crate::apply::Applier`]. With
//! `coordinator.apply_lanes` above one, partition `p` is applied by lane
//! `p % apply_lanes`: each lane keeps its partitions in order and stores
//! only their offsets, and the lanes' transactions overlap (one commits
//! while another loads and folds). A run's inputs share its key and so its
//! partition number; a run touched by two lanes anyway is fenced by
//! `record_version` like any other race. Inputs that cannot be decoded or
//! that the coordinator rejects are recorded in Postgres and go to the
//! dead-letter topic. Offsets are stored (`enable.auto.offset.store=false`)
//! only after the transaction, the dead letters' rows and their publishes
//! have succeeded, so a crash anywhere leads to a
//! redelivery, which the coordinator turns into zero new rows.
//!
//! - `context`: the consumer and the ingress's fixed inputs;
//! - `lane`: reading, and gathering bounded batches, serially or by lanes;
//! - `batch`: one batch handled whole, from apply to stored offsets;
//! - `sort`: a batch sorted by what each message is ([`classify`]), and
//!   settled by what each came to ([`dead_letter`]);
//! - [`dead_letters`]: the recorded letters, and the operator's list,
//!   replay and discard of them;
//! - [`misrouted`]: inputs on a partition their run does not belong on,
//!   forwarded to the one it does;
//! - `parked`: starts that wait on a key another caller holds, beside
//!   their lane;
//! - `offsets`: which offsets a batch lets the consumer store;
//! - `progress`: whether the lanes move, for readiness;
//! - `lag`: how far the consumer is behind, from its statistics.
//!
//! [`run`] is the loop; [`step`] is one turn of the serial ingress, for
//! tests that drive it a batch at a time and read what each batch did
//! ([`StepReport`]) instead of waiting on the database.

mod batch;
pub mod classify;
mod context;
pub mod dead_letter;
pub mod dead_letters;
mod lag;
mod lane;
pub mod misrouted;
mod offsets;
mod parked;
mod progress;
mod sort;

pub use context::{CONSUMER_LAG, IngressContext};
// Named only by the harnesses: the consumer's type.
#[cfg(feature = "internals")]
pub use context::IngressConsumerContext;
#[cfg(any(test, feature = "internals"))]
pub use offsets::next_offsets;
pub use progress::Progress;

use std::collections::BTreeMap;

use anyhow::Context;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::Message;
use tokio_util::sync::CancellationToken;

use lane::consume;

/// What the ingress did with one batch, once it was applied, its dead
/// letters published and its offsets stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Messages in the batch.
    pub messages: usize,
    /// The offset of the batch's last message on each `(topic, partition)`.
    pub last_offsets: BTreeMap<(String, i32), i64>,
    /// Inputs and routed starts that made a transition.
    pub applied: usize,
    /// Inputs and routed starts that changed nothing (duplicates, stale
    /// results).
    pub no_ops: usize,
    /// Inputs and routed starts the coordinator or the routing plane
    /// refused; dead-lettered.
    pub rejected: usize,
    /// Inputs that failed on their own in the database; dead-lettered.
    pub failed: usize,
    /// Messages that did not decode; dead-lettered.
    pub undecodable: usize,
    /// Recomputations after lost races.
    pub conflicts: u32,
    /// Effect intents committed.
    pub intents_written: usize,
    /// Routed starts parked beside the lane because another caller holds
    /// their key; they are applied again in a later turn.
    pub parked: usize,
    /// Inputs on a partition their run does not belong on, forwarded to
    /// the right one (see [`misrouted`]); those forwarded too often are
    /// counted in `rejected`.
    pub forwarded: usize,
}

impl StepReport {
    /// Whether the batch held message `offset` of `topic`/`partition`, or
    /// one after it.
    #[cfg(any(test, feature = "internals"))]
    pub fn covers(&self, topic: &str, partition: i32, offset: i64) -> bool {
        self.last_offsets
            .get(&(topic.to_string(), partition))
            .is_some_and(|last| *last >= offset)
    }

    /// Messages of the batch sent to the dead-letter topic.
    #[cfg(any(test, feature = "internals"))]
    pub fn dead_lettered(&self) -> usize {
        self.rejected + self.failed + self.undecodable
    }

    /// Counts one input by its `ductor_inputs_total` outcome label.
    fn count(&mut self, outcome: &str) {
        match outcome {
            "applied" => self.applied += 1,
            "stale" | "deduplicated" => self.no_ops += 1,
            _ => self.rejected += 1,
        }
    }
}

/// Consumes until `shutdown`, finishing the batch in hand.
pub async fn run(ctx: IngressContext, shutdown: CancellationToken) -> anyhow::Result<()> {
    subscribe(&ctx)?;
    let result = consume(&ctx, &shutdown).await;
    close(&ctx);
    result
}

/// Subscribes the ingress consumer to the input topics.
pub fn subscribe(ctx: &IngressContext) -> anyhow::Result<()> {
    let topics = [
        ctx.requests_topic.as_str(),
        ctx.wakeups_topic.as_str(),
        ctx.results_topic.as_str(),
    ];
    ctx.consumer
        .subscribe(&topics)
        .context("subscribing to input topics")?;
    tracing::info!(topics = ?topics, "ingress subscribed");
    Ok(())
}

/// Commits the offsets stored so far, which the broker keeps for the
/// group, and leaves the input topics.
pub fn close(ctx: &IngressContext) {
    if let Err(e) = ctx.consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::debug!(error = %e, "final offset commit skipped");
    }
    ctx.consumer.unsubscribe();
}

/// One turn of the serial ingress, for a caller that drives it one batch at
/// a time (tests, after [`subscribe`]): waits up to `wait` for a first
/// message, gathers a batch as the loop does, applies it and stores its
/// offsets. `Ok(None)` when no message came within `wait`, or when
/// shutdown interrupted the batch (nothing of it stored, so it is
/// redelivered). Lanes play no part: the batch is lane 0's.
#[cfg(any(test, feature = "internals"))]
pub async fn step(
    ctx: &IngressContext,
    wait: std::time::Duration,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    lane::turn(ctx, Some(tokio::time::Instant::now() + wait), shutdown).await
}

/// Records how long ago `msg` was produced (its Kafka timestamp), when the
/// ingress fetched it or began to apply it: the input's age, in seconds.
fn record_age<M: Message>(name: &'static str, msg: &M) {
    if let Some(ms) = msg.timestamp().to_millis() {
        let now_ms = chrono::Utc::now().timestamp_millis();
        metrics::histogram!(name).record((now_ms - ms).max(0) as f64 / 1000.0);
    }
}
