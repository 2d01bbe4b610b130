//! One attempt: the handler run for one dispatch, and its result published.
//!
//! In: an admitted [`StepDispatch`], the trace context its record carried
//! and its offset's [`Ticket`]. Out: how the attempt task ended
//! ([`Finished`]), and a `step.handle` span around the handler. Guarantees: a handler that panics, or
//! that outruns `handler_timeout`, is answered with a retryable failure
//! instead of taking the worker down or holding the attempt forever; the
//! ticket is handed back, for its offset to be stored, only once the broker
//! has acknowledged the result; the result continues the dispatch's trace.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use tokio::time::Instant;
use tracing::Instrument;

use super::offsets::Ticket;
use super::publish::publish;
use super::{Shared, StepDispatch, StepOutcome, count};
use crate::contract::TraceContext;
use crate::contract::input::truncate;
use crate::infra::crash::CrashPoint;
use crate::infra::traces;

/// How an attempt task ended.
pub(super) enum Finished {
    /// The result is acknowledged by the broker: the offset may be stored.
    Published(Ticket),
    /// Publishing gave up at shutdown: the offset stays unstored.
    NotPublished,
    /// The armed [`CrashPoint::WorkerBeforePublish`] fired.
    HookStopped,
}

/// One attempt: run the handler, publish its result, report the ticket.
pub(super) async fn attempt<F, Fut>(
    shared: Arc<Shared<F>>,
    step: StepDispatch,
    trace: Option<TraceContext>,
    ticket: Ticket,
) -> Finished
where
    F: Fn(StepDispatch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepOutcome> + Send + 'static,
{
    let (run_id, tenant, stamp) = (step.run_id.clone(), step.tenant.clone(), step.stamp);
    let span = tracing::info_span!(
        target: traces::TARGET,
        parent: None,
        "step.handle",
        ductor.run_id = %step.run_id,
        ductor.step = %step.step,
        ductor.step_index = step.step_index,
        ductor.attempt = step.attempt,
        ductor.outcome = tracing::field::Empty,
    );
    // The result is the next hop of the dispatch's trace, from the
    // handler's span; the handler runs in that span, so a call it makes
    // can carry the trace on.
    let hop = traces::hop(&span, trace.as_ref());
    let started = Instant::now();
    // The call itself happens inside the guarded future, so a handler that
    // panics before returning its future is caught too.
    let handled = AssertUnwindSafe(async { (shared.handler)(step).await })
        .catch_unwind()
        .instrument(span.clone());
    let (outcome, label) = match shared.handler_timeout {
        Some(limit) => match tokio::time::timeout(limit, handled).await {
            Ok(r) => classify(r),
            Err(_) => (
                StepOutcome::Failed {
                    message: format!("step handler timed out after {} ms", limit.as_millis()),
                    retryable: true,
                },
                "timed_out",
            ),
        },
        None => classify(handled.await),
    };
    metrics::histogram!("ductor_worker_step_seconds", "pool" => shared.pool.clone())
        .record(started.elapsed().as_secs_f64());
    count(&shared.pool, label);
    span.record("ductor.outcome", label);
    drop(span);
    tracing::debug!(outcome = label, "step handled");

    let payload = outcome.result_payload(&run_id, &tenant, stamp, &shared.result_limits);
    if shared.crash.fires(CrashPoint::WorkerBeforePublish) {
        return Finished::HookStopped;
    }
    match publish(&shared, &run_id, &tenant, payload.as_bytes(), hop.as_ref()).await {
        Ok(()) => Finished::Published(ticket),
        Err(e) => {
            tracing::warn!(error = %e, "step result not published before shutdown; the dispatch will be redelivered");
            Finished::NotPublished
        }
    }
}

fn classify(
    result: Result<StepOutcome, Box<dyn std::any::Any + Send>>,
) -> (StepOutcome, &'static str) {
    match result {
        Ok(outcome @ StepOutcome::Succeeded(_)) => (outcome, "succeeded"),
        Ok(outcome @ StepOutcome::Failed { .. }) => (outcome, "failed"),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            tracing::error!(panic = %truncate(what.clone(), 256), "step handler panicked");
            (
                StepOutcome::Failed {
                    message: format!("step handler panicked: {what}"),
                    retryable: true,
                },
                "panicked",
            )
        }
    }
}
