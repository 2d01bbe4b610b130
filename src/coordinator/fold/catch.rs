//! Failures a step catches: `catch = { next = "<step>" }`, or
//! `catch = { compensate = true }` (see `compensate`).
//!
//! When a step of the run's own sequence fails for good (its attempts
//! exhausted or its error not retryable, its wait for a signal timed out,
//! a branch or an item of it failed, a map's input no array or too long)
//! and it names a catch, the run does not fail: the error goes into the
//! run's document at the catch's result path (`/errors/<step>` by
//! default) as `{"step", "cause", "error"}`, becomes the newest output (the
//! input of the step caught to, unless it selects another), and the run
//! goes on at the catch's step in the same transition, a `step.caught`.
//! Failures from outside the run's steps (a cancel, a state too large, a
//! workflow gone) and failures of its data (a selection that finds
//! nothing, a loop past its bound) are not caught.
//!
//! In: the transition being sealed. Out: the same, or the run moved on.
//! Guarantees: pure; at most one catch per transition.

use serde_json::{Value, json};

use super::Builder;
use super::choice::index_of;
use crate::contract::TransitionKind;
use crate::contract::input::truncate;
use crate::coordinator::document;
use crate::coordinator::flow::{self, Target};
use crate::coordinator::state::RunStatus;

/// The causes of the failures a step's catch catches.
pub const CAUGHT: [&str; 7] = [
    "attempts_exhausted",
    "not_retryable",
    "signal_timeout",
    super::parallel::BRANCH_FAILED,
    super::parallel::ITEM_FAILED,
    super::parallel::NOT_AN_ARRAY,
    super::parallel::TOO_MANY_ITEMS,
];

impl Builder<'_> {
    /// The run failed in a step that catches the failure: it goes on at
    /// the catch's step instead. `kind` is the transition's as it was.
    pub(super) fn catch(
        &mut self,
        kind: TransitionKind,
    ) -> Result<TransitionKind, super::Decision> {
        let Some(def) = self.def else {
            return Ok(kind);
        };
        let cause = self.detail.get("cause").and_then(Value::as_str);
        let caught = self.focus.is_empty()
            && self.state.status == RunStatus::Failed
            && cause.is_some_and(|c| CAUGHT.contains(&c));
        let index = self.state.step_index;
        let step = def.step(index);
        let (Some(step), Some(catch), true) = (step, step.and_then(|s| s.catch.as_ref()), caught)
        else {
            return Ok(kind);
        };
        if catch.compensate {
            let cause = cause.unwrap_or_default().to_owned();
            let turned = self.begin_compensating(def, index, &cause);
            // A start stays a `run.started`, whatever its first step did.
            return Ok(match (kind, turned) {
                (TransitionKind::RunStarted, _) => kind,
                (TransitionKind::RunRetried, TransitionKind::RunCompensating) => kind,
                (_, turned) => turned,
            });
        }
        let Some(next) = catch.next.as_deref().and_then(|n| flow::index_of(def, n)) else {
            return Ok(kind);
        };
        let error = self.state.error.clone().unwrap_or_default();
        let value = json!({
            "step": step.name,
            "cause": cause,
            "error": truncate(error, super::MAX_DETAIL_ERROR_LEN),
        });
        if let (Some(results), Some(path)) = (self.state.results.as_mut(), step.error_path())
            && document::place(results, &path, value.clone()).is_err()
        {
            // Nowhere to put it: the run stays failed.
            return Ok(kind);
        }
        self.detail.remove("cause");
        self.detail("caught", value.clone());
        self.state.status = RunStatus::Running;
        self.state.error = None;
        self.state.output = value;
        let moved = self.after_step(def, index_of(def, Target::Step(next)))?;
        Ok(match (kind, moved) {
            (TransitionKind::RunStarted, _)
            | (TransitionKind::RunRetried, TransitionKind::StepSucceeded) => kind,
            (_, TransitionKind::StepSucceeded) => TransitionKind::StepCaught,
            (_, moved) => moved,
        })
    }
}
