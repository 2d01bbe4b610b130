//! Signals: `wakeup.signal` to a run that exists.
//!
//! In: a signal with its producer-chosen `signal_id`. Out: the transition that
//! records it (`run.signalled`), or, when the step the run waits in awaits it,
//! the transition that consumes it and moves the run on; a no-op for the same
//! signal again or a run that succeeded or was cancelled. A failed run
//! records signals as a running one does, so that a retry finds them and a
//! signal delivered again after the retry is a duplicate, not a new one.
//! Guarantees: a signal is recorded once per
//! `signal_id`, and another name or payload under a recorded id is refused
//! (`idempotency_mismatch`); a run holds at most `MAX_SIGNALS_PER_RUN`, and
//! keeps the payload only of those a later step will await. Pure: no database,
//! no clock; what it decides is tested without either.

use serde_json::json;

use super::waits::keeps_signal;
use super::{Ctx, Decision, NoOpReason, RejectionClass, reject};
use crate::contract::input::SignalWakeup;
use crate::contract::{TransitionKind, fingerprint};
use crate::coordinator::state::{Lane, MAX_SIGNALS_PER_RUN, RunStatus, SignalRecord};

impl Ctx<'_> {
    pub(super) fn on_signal(&self, signal: &SignalWakeup) -> Decision {
        if let Some(decision) = self.signal_in_lane(signal) {
            return decision;
        }
        let s = self.state;
        let fingerprint = fingerprint::signal(&signal.name, &signal.payload);
        let recorded = s.signals.iter().find(|r| r.signal_id == signal.signal_id);
        if let Some(stored) = recorded.and_then(|r| r.fingerprint.as_ref())
            && *stored != fingerprint
        {
            return reject(
                RejectionClass::IdempotencyMismatch,
                "wakeup.signal: signal_id already recorded with another name or payload",
            );
        }
        if s.status.is_terminal() && s.status != RunStatus::Failed {
            return Decision::NoOp(NoOpReason::RunTerminal);
        }
        if recorded.is_some() {
            return Decision::NoOp(NoOpReason::DuplicateSignal);
        }
        if s.signals.len() >= MAX_SIGNALS_PER_RUN {
            return reject(
                RejectionClass::TooManySignals,
                format!("run already holds {MAX_SIGNALS_PER_RUN} signals"),
            );
        }
        let mut b = self.builder();
        let mut record = SignalRecord {
            signal_id: signal.signal_id.clone(),
            name: signal.name.clone(),
            received_at: self.now,
            payload: None,
            kept: false,
            consumed_by: None,
            fingerprint: Some(fingerprint),
        };
        b.detail("signal_id", signal.signal_id.clone().into());
        b.detail("name", signal.name.clone().into());
        b.detail("payload", signal.payload.clone());
        let def = self.definition().ok();
        let awaited = s
            .waiting
            .as_ref()
            .filter(|w| w.signal.as_deref() == Some(signal.name.as_str()));
        if let (Some(def), Some(waiting)) = (def, awaited) {
            // The step waits for this signal: it is consumed, the run moves on.
            record.consumed_by = Some(waiting.step_index);
            b.state.signals.push(record);
            let member = json!({"signal_id": signal.signal_id, "payload": signal.payload});
            return match b.complete_wait(def, member) {
                Ok(kind) => b.finish(kind, self.input.dedup_ref()),
                Err(rejection) => rejection,
            };
        }
        // A retry of a failed run starts the step it failed in again: that
        // step may await the signal too.
        let first = match s.status {
            RunStatus::Failed => s.step_index,
            _ => s.step_index.saturating_add(1),
        };
        let at = s.step_index;
        if def.is_some_and(|def| keeps_signal(def, at, first, &s.signals, &signal.name)) {
            record.kept = true;
            record.payload = Some(signal.payload.clone());
        }
        b.state.signals.push(record);
        b.finish(TransitionKind::RunSignalled, self.input.dedup_ref())
    }
}

impl Ctx<'_> {
    /// A branch or an item that waits for the signal takes it: the first
    /// that began to wait. `None` when none waits for it, or when the
    /// signal is recorded already (judged as any other).
    fn signal_in_lane(&self, signal: &SignalWakeup) -> Option<Decision> {
        let recorded = self
            .state
            .signals
            .iter()
            .any(|r| r.signal_id == signal.signal_id);
        let awaits = |l: &Lane| {
            l.waiting
                .as_ref()
                .is_some_and(|w| w.signal.as_deref() == Some(signal.name.as_str()))
        };
        let chain = self.lane_of(awaits).filter(|_| !recorded)?;
        Some(self.in_lane(chain, |ctx| ctx.on_signal(signal)))
    }
}
