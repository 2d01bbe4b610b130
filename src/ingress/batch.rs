//! One batch, handled whole: applied after its lane's parked starts that
//! are due, dead-lettered, parked, and its offsets stored.
//!
//! In: a batch of messages read for one lane, that lane's parked starts,
//! and shutdown. Out: a [`StepReport`] once every message is applied,
//! dead-lettered or parked and the offsets stored, counted in the lane's
//! [`super::Progress`]; `None` when shutdown interrupted the batch.
//! Guarantees: offsets are stored only after the batch's commit and its
//! dead letters' rows and acknowledgements, and never past a parked start, so a
//! crash anywhere redelivers what was not durably handled, which the
//! coordinator turns into zero new rows; a transient failure is retried
//! until it passes or the process shuts down, and an input that fails on
//! its own is dead-lettered alone.

use anyhow::Context;
use rdkafka::message::{Message, OwnedMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::misrouted::{forward, take_misrouted};
use super::offsets::{last_offsets, store_offsets};
use super::parked::ParkedStart;
use super::sort::{settle_inputs, settle_routed, sort};
use super::{IngressContext, StepReport, record_age};
use crate::apply::Holds;
use crate::infra::crash::CrashPoint;

/// Applies one batch and stores its offsets. `Ok(None)` when shutdown
/// interrupted it (nothing of it stored, so it is redelivered).
pub(super) async fn handle_batch(
    ctx: &IngressContext,
    lane: usize,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    ctx.progress.began(lane);
    let span = tracing::info_span!(
        target: crate::infra::traces::TARGET,
        "ingress.batch",
        ductor.lane = lane,
        messaging.batch.message_count = batch.len(),
    );
    let handled = handle_batch_in(ctx, lane, batch, shutdown)
        .instrument(span)
        .await;
    ctx.progress.finished(lane);
    if let Ok(Some(report)) = &handled {
        ctx.progress.handled(report);
    }
    handled
}

/// Applies `batch` after the lane's parked starts that are due, parks what
/// waits on a held key, and stores the offsets that passes.
async fn handle_batch_in(
    ctx: &IngressContext,
    lane: usize,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    // Canary: storing offsets first loses the batch on a crash.
    #[cfg(feature = "canary-offsets-before-commit")]
    store_offsets(
        ctx,
        &last_offsets(batch.iter())
            .into_iter()
            .map(|(at, offset)| (at, offset + 1))
            .collect(),
    );
    // Out of the lock while the batch applies; only this lane takes it.
    let mut parked = std::mem::take(&mut *ctx.parked(lane));
    let retried = parked.take_due(Instant::now());
    let mut holds = parked.holds(ctx.max_parked_starts);
    let processed = process_batch(ctx, batch, &retried, &mut holds, shutdown).await;
    let (report, held) = match processed {
        Ok(processed) => processed,
        Err(e) if shutdown.is_cancelled() => {
            // Interrupted while retrying: nothing of the batch is stored,
            // so it is redelivered after the restart.
            tracing::info!(
                error = format!("{e:#}"),
                "batch left for redelivery at shutdown"
            );
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    if ctx.crash.fires(CrashPoint::IngressAfterCommit) {
        anyhow::bail!("crash hook: stopped after commit, before storing offsets");
    }
    let retried_held = held
        .iter()
        .filter(|s| retried_included(&retried, s))
        .count();
    parked.park(
        held,
        retried_held < retried.len(),
        ctx.retry,
        Instant::now(),
    );
    let next = parked.offsets(&report.last_offsets);
    metrics::gauge!("ductor_ingress_parked_starts", "lane" => lane.to_string())
        .set(parked.len() as f64);
    *ctx.parked(lane) = parked;
    crate::crash_point!("ingress.before_offset_store");
    #[cfg(not(feature = "canary-offsets-before-commit"))]
    store_offsets(ctx, &next);
    #[cfg(feature = "canary-offsets-before-commit")]
    let _ = next;
    Ok(Some(report))
}

/// Whether `start` is one of the parked starts the turn applied again.
fn retried_included(retried: &[ParkedStart], start: &ParkedStart) -> bool {
    retried.iter().any(|r| {
        r.message.topic() == start.message.topic()
            && r.message.partition() == start.message.partition()
            && r.message.offset() == start.message.offset()
    })
}

/// Decodes, applies and dead-letters one batch, after the `retried`
/// parked starts. Returns only when every message of the batch is durably
/// handled or parked (the starts `holds` left out, returned with their
/// messages), with what became of them, or on shutdown/fatal error.
/// Offsets are the caller's to store.
async fn process_batch(
    ctx: &IngressContext,
    batch: &[OwnedMessage],
    retried: &[ParkedStart],
    holds: &mut Holds,
    shutdown: &CancellationToken,
) -> anyhow::Result<(StepReport, Vec<ParkedStart>)> {
    for msg in batch {
        record_age("ductor_ingress_apply_age_seconds", msg);
    }
    let mut sorted = sort(ctx, batch);
    let undecodable = sorted.dead.len();
    let misrouted =
        take_misrouted(&ctx.partition_counts, ctx.max_input_forwards, &mut sorted).await;
    sorted.retry_first(retried);
    let read = retried.iter().map(|s| &s.message).chain(batch);
    let mut step = StepReport {
        messages: batch.len() + retried.len(),
        last_offsets: last_offsets(read),
        undecodable,
        rejected: sorted.dead.len() - undecodable,
        ..StepReport::default()
    };
    let mut held = Vec::new();
    if !sorted.pending.is_empty() || !sorted.routed.is_empty() {
        let report = ctx
            .applier
            .apply_isolating(&sorted.pending, &sorted.routed, ctx.retry, holds, shutdown)
            .await
            .context("applying batch")?;
        held = sorted.held(&report);
        step.parked = held.len();
        if !held.is_empty() {
            tracing::info!(
                starts = held.len(),
                "starts wait on idempotency keys other callers hold; parked beside the lane"
            );
        }
        settle_inputs(&report, &mut sorted, &mut step);
        settle_routed(&report, &mut sorted, &mut step);
        step.conflicts = report.conflicts;
        step.intents_written = report.intents_written;
        // With a fast lane the applier hands over and wakes by itself.
        if report.intents_written > 0
            && ctx.applier.handoff.is_none()
            && let Some(wakeup) = &ctx.wakeup
        {
            wakeup.wake();
        }
        if report.conflicts > 0 {
            tracing::debug!(
                conflicts = report.conflicts,
                "batch recomputed after conflicts"
            );
        }
    }
    if !misrouted.is_empty() {
        // Forwarded on the dead letters' producer, made at its first use.
        let producer = ctx.dead_letters.producer.get()?;
        for m in &misrouted {
            forward(&producer, ctx.dead_letters.timeout, m, shutdown).await?;
        }
    }
    step.forwarded = misrouted.len();
    ctx.dead_letters.write(&sorted.dead, shutdown).await?;
    for letter in &sorted.dead {
        metrics::counter!("ductor_inputs_total", "topic" => letter.message.topic().to_string(), "outcome" => "dead_lettered")
            .increment(1);
    }
    Ok((step, held))
}
