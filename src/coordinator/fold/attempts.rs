//! Attempts of task steps: their results, their timeouts and their retries.
//!
//! In: an `attempt.result`, or a `wakeup.timer` of kind `timeout` or `retry`,
//! for a run that exists. Out: the transition it makes (the step succeeded and
//! the run moves on, a retry scheduled or dispatched, the run failed), or a
//! no-op for a duplicate or for an attempt the run no longer waits for.
//! Guarantees: only the result or timeout carrying the stamp of the outstanding
//! attempt, and only the retry timer naming the pending retry, changes the run:
//! a late result of an abandoned attempt changes nothing. Pure: no database, no
//! clock; what it decides is tested without either.

use serde_json::Value;

use super::{Ctx, Decision, NoOpReason, RejectionClass, reject, step};
use crate::contract::TransitionKind;
use crate::contract::input::{AttemptOutcome, AttemptResult, TimerKind, TimerWakeup};
use crate::coordinator::definition::WorkflowDefinition;
use crate::coordinator::state::{AttemptRecord, AttemptStatus};

impl Ctx<'_> {
    pub(super) fn on_result(&self, result: &AttemptResult) -> Decision {
        let stamp = result.stamp;
        if let Some(chain) =
            self.lane_of(|l| l.outstanding.as_ref().is_some_and(|o| o.stamp == stamp))
        {
            return self.in_lane(chain, |ctx| ctx.on_result(result));
        }
        let Some(attempt) = self.state.attempt_by_stamp(result.stamp) else {
            return reject(
                RejectionClass::UnknownStamp,
                "stamp names no attempt of this run",
            );
        };
        // Canary: without stamp fencing, a duplicate or a late result of an
        // abandoned attempt changes the run. Only for proving the chaos
        // checker notices.
        let fenced =
            cfg!(not(feature = "canary-no-stamp-dedup")) || self.state.status.is_terminal();
        if fenced
            && (!self.is_outstanding(result.stamp) || attempt.status != AttemptStatus::Dispatched)
        {
            return Decision::NoOp(match attempt.status {
                AttemptStatus::Succeeded | AttemptStatus::Failed => NoOpReason::DuplicateResult,
                AttemptStatus::Dispatched | AttemptStatus::TimedOut | AttemptStatus::Cancelled => {
                    NoOpReason::StaleResult
                }
            });
        }
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        match &result.outcome {
            AttemptOutcome::Succeeded { output } => self.on_success(def, attempt, output),
            AttemptOutcome::Failed { message, retryable } => {
                let mut b = self.builder();
                b.finish_attempt(attempt.stamp, AttemptStatus::Failed, Some(message.clone()));
                let error = format!(
                    "step {} attempt {} failed: {message}",
                    attempt.step_index, attempt.attempt
                );
                let kind = b.after_failure(
                    def,
                    attempt,
                    error,
                    *retryable,
                    TransitionKind::StepRetryScheduled,
                );
                b.finish(kind, self.input.dedup_ref())
            }
        }
    }

    fn on_success(
        &self,
        def: &WorkflowDefinition,
        attempt: &AttemptRecord,
        output: &Value,
    ) -> Decision {
        let mut b = self.builder();
        b.finish_attempt(attempt.stamp, AttemptStatus::Succeeded, None);
        b.detail("stamp", attempt.stamp.to_string().into());
        b.detail("completed_step", attempt.step_index.into());
        b.detail("output", output.clone());
        let Some(done) = step(def, attempt.step_index) else {
            return reject(
                RejectionClass::UnknownWorkflow,
                "workflow has fewer steps than the run",
            );
        };
        if b.compensating() {
            let kind = b.compensated_one(def);
            return b.finish(kind, self.input.dedup_ref());
        }
        b.remember(def, attempt.step_index, output);
        if let Err(error) = b.step_done(done, output.clone()) {
            b.fail_data(attempt.step_index, super::RESULT_PATH_BLOCKED, error);
            return b.finish(TransitionKind::RunFailed, self.input.dedup_ref());
        }
        match b.after_step(def, super::choice::after(def, attempt.step_index)) {
            Ok(kind) => b.finish(kind, self.input.dedup_ref()),
            Err(rejection) => rejection,
        }
    }

    pub(super) fn on_timer(&self, timer: &TimerWakeup) -> Decision {
        if let Some(chain) = self.lane_of(|lane| lane.names(timer)) {
            return self.in_lane(chain, |ctx| ctx.on_timer(timer));
        }
        if timer.timer == TimerKind::Wake {
            return self.on_wake(timer);
        }
        let Some(attempt) = self.state.attempt_by_stamp(timer.stamp) else {
            return reject(
                RejectionClass::UnknownStamp,
                "stamp names no attempt of this run",
            );
        };
        let due = match timer.timer {
            TimerKind::Timeout => {
                self.is_outstanding(timer.stamp) && attempt.status == AttemptStatus::Dispatched
            }
            TimerKind::Wake => false,
            TimerKind::Retry => {
                !self.state.status.is_terminal()
                    && self
                        .state
                        .pending_retry
                        .as_ref()
                        .is_some_and(|p| p.after_stamp == timer.stamp)
            }
        };
        if !due {
            return Decision::NoOp(NoOpReason::DuplicateTimer);
        }
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        let mut b = self.builder();
        match timer.timer {
            TimerKind::Timeout => {
                let timeout_ms = step(def, attempt.step_index).map_or(0, |s| s.timeout_ms);
                let error = format!(
                    "step {} attempt {} timed out after {timeout_ms} ms",
                    attempt.step_index, attempt.attempt
                );
                b.finish_attempt(attempt.stamp, AttemptStatus::TimedOut, Some(error.clone()));
                let kind = b.after_failure(def, attempt, error, true, TransitionKind::StepTimedOut);
                b.finish(kind, self.input.dedup_ref())
            }
            TimerKind::Wake => Decision::NoOp(NoOpReason::DuplicateTimer),
            TimerKind::Retry => self.retry_attempt(def, b, timer),
        }
    }

    /// The retry timer of the pending retry: the step's next attempt.
    fn retry_attempt(
        &self,
        def: &WorkflowDefinition,
        mut b: super::Builder<'_>,
        timer: &TimerWakeup,
    ) -> Decision {
        let index = self.state.step_index;
        // After every attempt of the step: a map's items number them
        // between them.
        let next_attempt = b.first_attempt(index);
        b.count_try(false);
        let Some(retried) = step(def, index) else {
            return reject(
                RejectionClass::UnknownWorkflow,
                "workflow has fewer steps than the run",
            );
        };
        let input = match b.step_input(retried, index) {
            Ok(input) => input,
            Err(error) => {
                b.fail_data(index, super::UNRESOLVED_POINTER, error);
                return b.finish(TransitionKind::RunFailed, self.input.dedup_ref());
            }
        };
        let Some(stamp) = b.dispatch(def, index, next_attempt, input) else {
            return reject(
                RejectionClass::UnknownWorkflow,
                "workflow has fewer steps than the run",
            );
        };
        b.detail("after_stamp", timer.stamp.to_string().into());
        b.detail("stamp", stamp.to_string().into());
        b.finish(TransitionKind::StepRetried, self.input.dedup_ref())
    }
}
