//! A failed run started again from the step it failed in.
//!
//! In: a `wakeup.retry` for a run that exists. Out: the `run.retried`
//! transition (the run is running again: a task step is dispatched with a
//! fresh attempt, numbered after the step's last one, under a fresh stamp; a
//! sleep or a wait for a signal begins again), or a no-op: the run applied
//! this `action_id` already, it is not failed, or it is failed by another
//! transition than the one the retry names (`failed_seq`). Guarantees: a run
//! applies each `action_id` once, whatever happened to it since, and
//! retries each failure at most once; a retry that changed nothing never
//! changes anything later, so one delivered again after a crash decides as
//! it did the first time; a run applies at most
//! [`MAX_RETRIES_PER_RUN`]; a retry that would leave the state over
//! `coordinator.max_state_bytes` is refused and the run stays as it failed
//! (see `halt::bound_state`); attempts the failure closed stay closed, so
//! their late results change nothing. Pure: no database, no clock; what it
//! decides is tested without either.

use super::{Ctx, Decision, NoOpReason, RejectionClass, reject, step};
use crate::contract::TransitionKind;
use crate::contract::input::{MAX_REASON_LEN, RetryWakeup, truncate};
use crate::coordinator::definition::StepKind;
use crate::coordinator::state::{MAX_RETRIES_PER_RUN, RetryRecord, RunStatus};

use super::waits::Entered;

impl Ctx<'_> {
    pub(super) fn on_retry(&self, retry: &RetryWakeup) -> Decision {
        if let Some(refused) = self.refuse_retry(retry) {
            return refused;
        }
        let s = self.state;
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        let Some(failed_step) = step(def, s.step_index) else {
            return fewer_steps();
        };
        let mut b = self.builder();
        b.state.retries.push(RetryRecord {
            action_id: retry.action_id.clone(),
            at: self.now,
            step_index: s.step_index,
        });
        b.state.status = RunStatus::Running;
        b.state.error = None;
        b.detail("action_id", retry.action_id.clone().into());
        b.detail("failed_seq", retry.failed_seq.into());
        b.detail("retried_step", s.step_index.into());
        if let Some(previous) = &s.error {
            b.detail("previous_error", truncate(previous.clone(), 256).into());
        }
        if let Some(reason) = &retry.reason {
            b.detail("reason", truncate(reason.clone(), MAX_REASON_LEN).into());
        }
        // A compensation that failed goes on with its policy afresh.
        b.count_try(true);
        let entered = if matches!(failed_step.kind, StepKind::Task | StepKind::Child) {
            match b.step_input(failed_step, s.step_index) {
                Ok(input) => match b.dispatch(def, s.step_index, self.next_attempt(), input) {
                    Some(stamp) => Entered::Started(stamp),
                    None => return fewer_steps(),
                },
                Err(error) => {
                    b.fail_data(s.step_index, super::UNRESOLVED_POINTER, error);
                    Entered::Failed
                }
            }
        } else {
            match b.enter(def, s.step_index) {
                Ok(entered) => entered,
                Err(rejection) => return rejection,
            }
        };
        let kind = match entered {
            Entered::Started(stamp) => {
                b.detail("next_stamp", stamp.to_string().into());
                TransitionKind::RunRetried
            }
            Entered::Succeeded => TransitionKind::RunSucceeded,
            // A step that cannot start (a sleep whose time is not in its
            // input) fails the run again, in the same transition.
            Entered::Failed => TransitionKind::RunFailed,
        };
        b.finish(kind, self.input.dedup_ref())
    }

    /// Why the retry changes nothing or is refused, if it does not apply.
    fn refuse_retry(&self, retry: &RetryWakeup) -> Option<Decision> {
        let s = self.state;
        if s.retries.iter().any(|r| r.action_id == retry.action_id) {
            return Some(Decision::NoOp(NoOpReason::DuplicateRetry));
        }
        if s.is_compensated() {
            return Some(Decision::NoOp(NoOpReason::RunCompensated));
        }
        let Some(failed_seq) = s.failure_seq() else {
            return Some(Decision::NoOp(NoOpReason::RunNotFailed));
        };
        if failed_seq != retry.failed_seq {
            return Some(Decision::NoOp(NoOpReason::StaleRetry));
        }
        (s.retries.len() >= MAX_RETRIES_PER_RUN).then(|| {
            reject(
                RejectionClass::TooManyRetries,
                format!("run already applied {MAX_RETRIES_PER_RUN} retries"),
            )
        })
    }

    /// The number of the step's next attempt: after every attempt it had,
    /// so that each (step, attempt) names one attempt of the run.
    fn next_attempt(&self) -> u32 {
        let s = self.state;
        s.attempts
            .iter()
            .filter(|a| a.step_index == s.step_index)
            .map(|a| a.attempt)
            .max()
            .unwrap_or(0)
            .saturating_add(1)
    }
}

fn fewer_steps() -> Decision {
    reject(
        RejectionClass::UnknownWorkflow,
        "workflow has fewer steps than the run",
    )
}
