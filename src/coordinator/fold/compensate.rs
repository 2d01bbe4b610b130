//! Compensation: `compensate = { .. }` on a task step, and
//! `catch = { compensate = true }` on the step whose failure undoes them.
//!
//! Each task step that succeeds and names a compensation is remembered
//! (`compensable`: its compensation, its step key and its output). When a
//! step of the run's own sequence fails for good with a cause a catch
//! catches, and its catch compensates, the run does not fail yet: it runs
//! the compensations of the steps remembered, newest first, one at a time,
//! each a task like any other (attempts, stamps, timeouts, retries by its
//! own policy) with the output of the step it undoes as its input and
//! `<step key of that step>/compensate` as its step key. Once the last one
//! succeeded the run fails with cause [`COMPENSATED`] and the error it
//! failed with; a compensation that fails for good fails the run with
//! cause [`COMPENSATION_FAILED`] and leaves it where it stands, so that a
//! retry of the run goes on from the compensation that failed. A
//! compensated run is not retried: what it did is undone.
//!
//! Only steps that succeeded are undone: an attempt cancelled or timed out
//! may have had its effect, and a worker that must undo such an attempt
//! answers it (or makes its call idempotent by its step key) instead.
//!
//! In: the transition being built. Out: the same, with the run remembering
//! a step, beginning to compensate, or moving to its next compensation.
//! Guarantees: pure; each remembered step is compensated at most once per
//! success of its compensation; a run of a workflow without compensations
//! pays one look at the step that succeeded.

use serde_json::{Value, json};

use super::Builder;
use crate::contract::{TransitionKind, names};
use crate::coordinator::definition::WorkflowDefinition;
use crate::coordinator::state::{Compensable, Compensating, RunStatus};

/// The cause of a run failed once every compensation ran.
pub const COMPENSATED: &str = "compensated";
/// The cause of a run failed because a compensation failed for good.
pub const COMPENSATION_FAILED: &str = "compensation_failed";

impl Builder<'_> {
    /// Task step `index` succeeded with `output`: remembered if it names a
    /// compensation.
    pub(super) fn remember(&mut self, def: &WorkflowDefinition, index: u32, output: &Value) {
        if def.step(index).is_none_or(|s| s.compensate.is_none()) {
            return;
        }
        let Some(compensation) = def.compensation_of(index) else {
            return;
        };
        let (_, items) = self.lane_labels(def);
        let step_key = self.step_key(index, &items);
        // A step that ran again under its key (a retry of the run started
        // its branch again) made its effect once: it is undone once, with
        // its newest output.
        if let Some(known) = self
            .state
            .compensable
            .iter_mut()
            .find(|c| c.step_key == step_key)
        {
            known.output = output.clone();
            return;
        }
        self.state.compensable.push(Compensable {
            step_index: compensation,
            step_key,
            output: output.clone(),
        });
    }

    /// Whether the run's own cursor runs compensations.
    pub(super) fn compensating(&self) -> bool {
        self.focus.is_empty() && self.state.compensating.is_some()
    }

    /// The compensation the run runs, if step `index` is it.
    fn current(&self, index: u32) -> Option<&Compensable> {
        if !self.compensating() {
            return None;
        }
        self.state
            .compensable
            .last()
            .filter(|c| c.step_index == index)
    }

    /// The input of compensation `index`: the output of the step it undoes.
    pub(super) fn compensation_input(&self, index: u32) -> Option<Value> {
        self.current(index).map(|c| c.output.clone())
    }

    /// The step key of compensation `index`.
    pub(super) fn compensation_key(&self, index: u32) -> Option<String> {
        self.current(index)
            .map(|c| names::compensation_key(&c.step_key))
    }

    /// Step `failed` failed for good with `cause`, and its catch
    /// compensates: the run begins with the newest compensation.
    pub(super) fn begin_compensating(
        &mut self,
        def: &WorkflowDefinition,
        failed: u32,
        cause: &str,
    ) -> TransitionKind {
        let name = def.step(failed).map(|s| s.name.clone()).unwrap_or_default();
        let error = self.state.error.take().unwrap_or_default();
        self.detail.remove("cause");
        self.detail(
            "compensating",
            json!({ "step": name, "cause": cause, "steps": self.state.compensable.len() }),
        );
        self.state.compensating = Some(Compensating {
            failed_step: failed,
            cause: cause.to_owned(),
            error,
            tries: 0,
        });
        self.state.status = RunStatus::Running;
        match self.next_compensation(def) {
            Some(_) => TransitionKind::RunCompensating,
            None => TransitionKind::RunFailed,
        }
    }

    /// The compensation the run ran succeeded: the one before it, or the
    /// end.
    pub(super) fn compensated_one(&mut self, def: &WorkflowDefinition) -> TransitionKind {
        if let Some(done) = self.state.compensable.pop() {
            self.detail("compensated_key", done.step_key.into());
        }
        match self.next_compensation(def) {
            Some(_) => TransitionKind::StepSucceeded,
            None => TransitionKind::RunFailed,
        }
    }

    /// Dispatches the newest compensation left, and returns its stamp; or,
    /// with none left, fails the run compensated.
    fn next_compensation(&mut self, def: &WorkflowDefinition) -> Option<uuid::Uuid> {
        let Some(next) = self.state.compensable.last().cloned() else {
            let c = self
                .state
                .compensating
                .clone()
                .unwrap_or_else(|| Compensating {
                    failed_step: self.state.step_index,
                    cause: String::new(),
                    error: String::new(),
                    tries: 0,
                });
            self.detail("cause", COMPENSATED.into());
            self.detail("compensated_cause", c.cause.clone().into());
            self.detail("compensated_step", c.failed_step.into());
            self.state.outstanding = None;
            self.state.pending_retry = None;
            self.fail_run(c.failed_step, c.error);
            return None;
        };
        let attempt = self.first_attempt(next.step_index);
        self.count_try(true);
        let stamp = self.dispatch(def, next.step_index, attempt, next.output)?;
        self.detail("next_stamp", stamp.to_string().into());
        Some(stamp)
    }

    /// A run that succeeded or was cancelled never compensates: what it
    /// remembered for that goes (the outputs are in its history).
    pub(super) fn forget_compensations(&mut self) {
        if matches!(
            self.state.status,
            RunStatus::Succeeded | RunStatus::Cancelled
        ) {
            self.state.compensable.clear();
        }
    }

    /// A compensation that failed for good fails the run with
    /// [`COMPENSATION_FAILED`], the failure's own cause beside it; the run
    /// stays at that compensation, for a retry to go on from.
    pub(super) fn compensation_failed(&mut self, kind: TransitionKind) -> TransitionKind {
        let failed = kind == TransitionKind::RunFailed
            && self.compensating()
            && self.state.status == RunStatus::Failed;
        let cause = self.detail.get("cause").cloned();
        let of_its_own = cause
            .as_ref()
            .and_then(Value::as_str)
            .is_some_and(|c| ["attempts_exhausted", "not_retryable"].contains(&c));
        if failed && of_its_own {
            self.detail("cause", COMPENSATION_FAILED.into());
            if let Some(cause) = cause {
                self.detail("compensation_cause", cause);
            }
        }
        kind
    }
}
