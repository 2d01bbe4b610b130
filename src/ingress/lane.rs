//! Reading: the consumer's messages gathered into bounded batches, one turn
//! after the other or by lanes.
//!
//! In: the consumer's messages, each lane's parked starts as they fall due,
//! and shutdown. Out: batches, each handled whole by its lane
//! ([`handle_batch`]). With `coordinator.apply_lanes` at one, one turn
//! follows the other; above one, a reader hands partition `p`'s messages
//! to lane `p % apply_lanes`, which batches and applies them on its own.
//! Guarantees: a batch stops growing at `coordinator.batch_max_inputs`
//! messages or `coordinator.batch_max_bytes` bytes of values, whichever
//! comes first; a lane's channel holds at most two batches' worth of
//! messages, and a lane keeps each partition's messages in read order; a
//! lone message lingers `coordinator.batch_linger_ms` for company, a
//! backlog does not wait; a lane that fails stops the reader and the other
//! lanes, and what none of them applied is left unstored, to be
//! redelivered.

use std::time::Duration;

use anyhow::Context;
use rdkafka::message::{Message, OwnedMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::batch::handle_batch;
use super::{IngressContext, StepReport, record_age};

/// Reads one batch, waiting for its first message until `first_by` (for
/// ever without it), and handles it as lane 0. `Ok(None)` when there was
/// nothing to handle or shutdown interrupted it.
pub(super) async fn turn(
    ctx: &IngressContext,
    first_by: Option<Instant>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<StepReport>> {
    let due = ctx.parked(0).due();
    let until = match (first_by, due) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let batch = match next_batch(ctx, shutdown, until).await? {
        Some(batch) => batch,
        // Nothing came, but the parked starts are due: their turn alone.
        None if !shutdown.is_cancelled() && due.is_some_and(|d| d <= Instant::now()) => Vec::new(),
        None => return Ok(None),
    };
    handle_batch(ctx, 0, &batch, shutdown).await
}

/// Consumes until shutdown or a failure: one turn after the other, or by
/// lanes.
pub(super) async fn consume(
    ctx: &IngressContext,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    if ctx.apply_lanes <= 1 {
        // The serial ingress: one turn after the other, until shutdown.
        while turn(ctx, None, shutdown).await?.is_some() {}
        return Ok(());
    }
    // Lanes: the reader hands each message to its partition's lane; a lane
    // batches, applies and stores offsets on its own. A failing lane stops
    // the ingress (the error is returned); stopping leaves what the lanes
    // have not applied unstored, so it is redelivered.
    let stop = shutdown.child_token();
    let turn = tokio::sync::Semaphore::new(1);
    let mut senders = Vec::with_capacity(ctx.apply_lanes);
    let mut lanes = Vec::with_capacity(ctx.apply_lanes);
    for index in 0..ctx.apply_lanes {
        let (tx, rx) = tokio::sync::mpsc::channel(ctx.batch_max_inputs * 2);
        senders.push(tx);
        lanes.push(lane(ctx, index, rx, &turn, &stop));
    }
    let reader = async {
        loop {
            let msg = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok::<(), anyhow::Error>(()),
                msg = ctx.consumer.recv() => msg,
            };
            match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    let index = m.partition().unsigned_abs() as usize % senders.len();
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => return Ok(()),
                        sent = senders[index].send(m.detach()) => {
                            if sent.is_err() {
                                return Ok(());
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    };
    let lanes = async {
        let result = futures::future::try_join_all(lanes).await.map(|_| ());
        // One lane failed or every lane stopped: stop the reader too.
        stop.cancel();
        result
    };
    let (read, applied) = tokio::join!(reader, lanes);
    applied.and(read)
}

/// One apply lane: batches from its channel until shutdown or a failure.
/// A small batch applies only with `turn`, which the lanes share.
async fn lane(
    ctx: &IngressContext,
    index: usize,
    mut messages: tokio::sync::mpsc::Receiver<OwnedMessage>,
    turn: &tokio::sync::Semaphore,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let mut batch = Gathered::new(ctx);
        let due = ctx.parked(index).due();
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            m = messages.recv() => match m {
                Some(m) => batch.push(m),
                None => return Ok(()),
            },
            // The parked starts' turn, with whatever is queued.
            () = sleep_until(due) => {}
        }
        // What queued up while the previous batch was applied is a batch
        // already: take it without waiting. Only a lone message, one that
        // found the lane idle, lingers for company.
        take_queued(&mut messages, &mut batch);
        if batch.messages.len() == 1 {
            let deadline = Instant::now() + ctx.batch_linger;
            while !batch.full() {
                tokio::select! {
                    biased;
                    m = messages.recv() => match m {
                        Some(m) => batch.push(m),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
        }
        // A batch below the threshold (none by default) takes turns with the
        // other lanes' small batches, and what arrives while it waits joins
        // it. A batch at or above it applies at once.
        let _turn = if batch.messages.len() < ctx.concurrent_batch_min_inputs {
            let permit = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                permit = turn.acquire() => permit.context("the lanes' turn was closed")?,
            };
            take_queued(&mut messages, &mut batch);
            Some(permit)
        } else {
            None
        };
        let handled = handle_batch(ctx, index, &batch.messages, stop).await;
        match handled {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) => {
                stop.cancel();
                return Err(e);
            }
        }
    }
}

/// A batch being gathered: full at `coordinator.batch_max_inputs` inputs
/// or `coordinator.batch_max_bytes` bytes of values, whichever comes first.
struct Gathered {
    messages: Vec<OwnedMessage>,
    bytes: usize,
    max_inputs: usize,
    max_bytes: usize,
}

impl Gathered {
    fn new(ctx: &IngressContext) -> Gathered {
        Gathered {
            messages: Vec::new(),
            bytes: 0,
            max_inputs: ctx.batch_max_inputs,
            max_bytes: ctx.batch_max_bytes,
        }
    }

    fn push(&mut self, message: OwnedMessage) {
        self.bytes += message.payload().map_or(0, <[u8]>::len);
        self.messages.push(message);
    }

    fn full(&self) -> bool {
        self.messages.len() >= self.max_inputs || self.bytes >= self.max_bytes
    }
}

/// Sleeps until `deadline`; for ever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Moves what is already queued in `messages` into `batch`, until it is full.
fn take_queued(messages: &mut tokio::sync::mpsc::Receiver<OwnedMessage>, batch: &mut Gathered) {
    while !batch.full() {
        match messages.try_recv() {
            Ok(m) => batch.push(m),
            Err(_) => break,
        }
    }
}

/// Waits for one message, until `first_by` if given, then gathers more
/// until the batch is full or the linger time has passed. `None` on
/// shutdown or at `first_by`, with nothing in hand.
async fn next_batch(
    ctx: &IngressContext,
    shutdown: &CancellationToken,
    first_by: Option<Instant>,
) -> anyhow::Result<Option<Vec<OwnedMessage>>> {
    let mut batch = Gathered::new(ctx);
    let given_up = async {
        match first_by {
            Some(deadline) => tokio::time::sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(given_up);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(None),
            _ = &mut given_up => return Ok(None),
            msg = ctx.consumer.recv() => match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    batch.push(m.detach());
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    let deadline = Instant::now() + ctx.batch_linger;
    while !batch.full() {
        tokio::select! {
            biased;
            msg = ctx.consumer.recv() => match msg {
                Ok(m) => {
                    record_age("ductor_ingress_fetch_age_seconds", &m);
                    batch.push(m.detach());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consumer error");
                    break;
                }
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    Ok(Some(batch.messages))
}
