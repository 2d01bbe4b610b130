//! A run ended from outside its steps: cancelled, or failed because its state
//! would outgrow `coordinator.max_state_bytes` or because the workflow version
//! it runs is no longer defined.
//!
//! In: a `wakeup.cancel`; a transition another input would make; a run's state
//! and the definitions. Out: the `run.cancelled` or `run.failed` transition,
//! or the decision as it was when the new state fits. Guarantees: no
//! transition leaves a state over the bound except the one that fails the run
//! for it; the outstanding attempt of an ended run is closed (failed when the
//! input is its own result, cancelled otherwise), so its late result changes
//! nothing; a pending retry and a wait end with the run. Pure: no database, no
//! clock; what it decides is tested without either.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    Builder, Ctx, Decision, Entropy, MAX_DETAIL_ERROR_LEN, NoOpReason, RejectionClass,
    STATE_TOO_LARGE, Transition, WORKFLOW_MISSING, reject,
};
use crate::contract::TransitionKind;
use crate::contract::input::{CancelWakeup, Input, MISSING_WORKFLOW_REF, encoded_len, truncate};
use crate::coordinator::definition::{WorkflowDefinition, Workflows};
use crate::coordinator::state::{AttemptStatus, RunState, RunStatus};

/// Every input of a run loads its state and writes it back whole, so the
/// state's size bounds what each of them costs. A transition that would
/// leave it over `max` bytes, as Ductor encodes it, is not taken: the run
/// fails instead, for good, with class [`STATE_TOO_LARGE`] (a start has no
/// run to fail, and is refused with that class). The failure is taken
/// whatever its own size: it adds one error text to the state the run
/// had, and the run grows no more. An input to a failed run (a retry, a
/// signal, a cancel) that would not fit is refused with that class instead.
pub(super) fn bound_state(
    decision: Decision,
    state: Option<&RunState>,
    input: &Input,
    max: usize,
    at: &At<'_>,
) -> Decision {
    let Decision::Transition(t) = &decision else {
        return decision;
    };
    let len = encoded_len(&t.state);
    if len <= max {
        return decision;
    }
    let error =
        format!("{STATE_TOO_LARGE}: the run's state would be {len} bytes, over the limit of {max}");
    match (state, input) {
        (None, _) => reject(RejectionClass::StateTooLarge, error),
        // An input to a failed run (a retry, a signal, a cancel) that does
        // not fit is refused, and the run stays as it failed: failing it
        // again would record nothing of the input, so that the same input,
        // delivered again, would fail it once more.
        (Some(state), _) if state.status == RunStatus::Failed => {
            reject(RejectionClass::StateTooLarge, error)
        }
        (Some(state), _) => fail_too_large(state, input, error, at),
    }
}

/// Where a run is failed from outside its steps: its definition (so that
/// the child runs of the attempts it abandons are cancelled; `None` when
/// it is not defined any more), the time and the entropy.
pub(super) struct At<'a> {
    pub def: Option<&'a WorkflowDefinition>,
    pub now: DateTime<Utc>,
    pub entropy: &'a Entropy,
}

/// Fails the run whose next state would be too large. The outstanding
/// attempt, if any, ends: failed when the input is its own result (what it
/// returned is what did not fit), cancelled otherwise (it is abandoned, as
/// a cancel abandons it), so its late result changes nothing.
fn fail_too_large(state: &RunState, input: &Input, error: String, at: &At<'_>) -> Decision {
    let own = |stamp: Uuid| matches!(input, Input::Result(r) if r.stamp == stamp);
    let failure = Failure {
        cause: STATE_TOO_LARGE,
        error,
        input_ref: input.dedup_ref(),
    };
    fail_run(state, failure, own, at)
}

/// Fails a run whose workflow version `workflows` no longer defines, so
/// that no input of it can apply any more: its outstanding attempt is
/// abandoned (cancelled, so a late result changes nothing), a pending
/// retry is dropped, a wait is ended (its wake timer then finds the run
/// finished), and the `run.failed` transition, from no input, has
/// [`MISSING_WORKFLOW_REF`] for its input and [`WORKFLOW_MISSING`] for its
/// cause. `None` when there is nothing to fail: the run is finished, or
/// its version is defined. Like the failure of a state too large, it is
/// taken whatever its size.
pub fn fail_missing_workflow(
    state: &RunState,
    workflows: &Workflows,
    now: DateTime<Utc>,
) -> Option<Transition> {
    if state.status.is_terminal()
        || workflows
            .get(&state.workflow, state.workflow_version)
            .is_some()
    {
        return None;
    }
    let failure = Failure {
        cause: WORKFLOW_MISSING,
        error: format!(
            "{WORKFLOW_MISSING}: workflow {:?} version {} is no longer defined",
            state.workflow, state.workflow_version
        ),
        input_ref: MISSING_WORKFLOW_REF.to_owned(),
    };
    // Nothing is dispatched and nothing is jittered.
    let entropy = Entropy {
        stamp: Uuid::nil(),
        jitter_unit: 0.0,
    };
    let at = At {
        def: None,
        now,
        entropy: &entropy,
    };
    match fail_run(state, failure, |_| false, &at) {
        Decision::Transition(transition) => Some(*transition),
        Decision::NoOp(_) | Decision::Rejection(_) => None,
    }
}

/// Why a run is failed from outside its steps.
struct Failure {
    /// The class, in the detail's `cause` and at the start of `error`.
    cause: &'static str,
    error: String,
    input_ref: String,
}

/// Fails the run for good. Its outstanding attempt, if any, ends: failed
/// when `own(stamp)` says the input is that attempt's own result,
/// cancelled otherwise.
fn fail_run(
    state: &RunState,
    failure: Failure,
    own: impl Fn(Uuid) -> bool,
    at: &At<'_>,
) -> Decision {
    let Failure {
        cause,
        error,
        input_ref,
    } = failure;
    let mut b = Builder::new(state.clone(), Some(state.status), at.now, at.entropy);
    b.def = at.def;
    if let Some(outstanding) = state.outstanding.as_ref() {
        let status = if own(outstanding.stamp) {
            AttemptStatus::Failed
        } else {
            AttemptStatus::Cancelled
        };
        b.detail("stamp", outstanding.stamp.to_string().into());
        b.finish_attempt(outstanding.stamp, status, Some(error.clone()));
    }
    b.state.pending_retry = None;
    b.state.waiting = None;
    b.cancel_all_lanes(&error);
    b.state.status = RunStatus::Failed;
    b.detail("cause", cause.into());
    b.detail(
        "error",
        truncate(error.clone(), MAX_DETAIL_ERROR_LEN).into(),
    );
    b.state.error = Some(error);
    b.finish(TransitionKind::RunFailed, input_ref)
}

impl Ctx<'_> {
    /// A running run is cancelled, and so is a failed one, which then is
    /// never retried; one that succeeded or was cancelled stays as it is.
    pub(super) fn on_cancel(&self, cancel: &CancelWakeup) -> Decision {
        if self.state.status.is_terminal() && self.state.status != RunStatus::Failed {
            return Decision::NoOp(NoOpReason::RunTerminal);
        }
        let mut b = self.builder();
        let reason = cancel
            .reason
            .clone()
            .unwrap_or_else(|| "cancelled".to_owned());
        if let Some(outstanding) = self.state.outstanding.as_ref() {
            b.detail("stamp", outstanding.stamp.to_string().into());
            b.finish_attempt(
                outstanding.stamp,
                AttemptStatus::Cancelled,
                Some(reason.clone()),
            );
        }
        b.state.pending_retry = None;
        b.state.waiting = None;
        b.cancel_all_lanes(&reason);
        // No step will consume a signal kept for it: the history has its
        // payload.
        for signal in b.state.signals.iter_mut().filter(|s| s.kept) {
            signal.kept = false;
            signal.payload = None;
        }
        b.state.status = RunStatus::Cancelled;
        b.detail(
            "reason",
            truncate(reason.clone(), MAX_DETAIL_ERROR_LEN).into(),
        );
        if let Some(action_id) = &cancel.action_id {
            b.detail("action_id", action_id.clone().into());
        }
        b.state.error = Some(reason);
        b.finish(TransitionKind::RunCancelled, self.input.dedup_ref())
    }
}
