//! `child` steps: a run that starts another workflow's run and takes its
//! outcome as the step's result.
//!
//! Each attempt of a child step is one child run. The attempt's stamp is
//! the child's run id: its start is a routed `run.start` on the requests
//! topic, keyed by the parent's step key and the attempt
//! ([`names::child_key`]), so that however often it is delivered the
//! routing plane decides one run, and it names its `parent` (the run and
//! the stamp). The child's outcome comes back as the `attempt.result` of
//! that stamp, so that the parent folds it as any worker's: fenced by its
//! stamp, timed out and retried by the step's policy. An attempt the
//! parent abandons (its timeout, a cancel of the parent, a sibling branch
//! that failed fast) cancels its child with a `wakeup.cancel` on the
//! requests topic, behind the start it cancels, so that it cannot overtake
//! it.
//!
//! In: a child step's attempt to start or to abandon; a run's transition
//! that ends it. Out: the effects: the child's start or cancel, or the
//! parent's result. Guarantees: a run answers its parent once for each
//! time it ends (a failed run that is retried and then succeeds answers
//! again, which the parent's stamp fence turns into a no-op); a child
//! that succeeded answers with its output, one that failed or was
//! cancelled with its error, not retryable: its steps retried by their own
//! policies, and a new child would run them again under keys of its own.
//! The step's `retry` starts another child after a timeout only. Pure: no
//! database, no clock; what it decides is tested without either.

use serde_json::Value;
use uuid::Uuid;

use super::Builder;
use crate::contract::input::{
    AttemptOutcome, AttemptResult, CancelWakeup, Input, MAX_ERROR_MESSAGE_LEN, ParentRef, RunStart,
    truncate,
};
use crate::contract::{Effect, EffectKind, EffectTarget, names};
use crate::coordinator::definition::{StepDefinition, StepKind};
use crate::coordinator::state::{AttemptStatus, RunStatus};

/// The reason a child run's cancel gives.
pub const PARENT_LEFT: &str = "its parent no longer waits for it";

impl Builder<'_> {
    /// The start of the child run of `attempt` of `step`, under `stamp`
    /// (its run id), with `input`; `step_key` the step's key.
    pub(super) fn start_child(
        &mut self,
        step: &StepDefinition,
        step_key: &str,
        attempt: u32,
        stamp: Uuid,
        input: Value,
    ) {
        let s = &self.state;
        let start = RunStart {
            run_id: stamp.to_string(),
            tenant: s.tenant.clone(),
            workflow: step.workflow.clone().unwrap_or_default(),
            workflow_version: step.version,
            pool: s.pool.clone(),
            input,
            correlation_id: s.correlation_id.clone(),
            parent: Some(Box::new(ParentRef {
                run_id: s.run_id.clone(),
                stamp,
            })),
        };
        let key = names::child_key(step_key, attempt);
        let effect = Effect::now(
            EffectTarget::Requests {
                run_id: start.run_id.clone(),
            },
            EffectKind::ChildStart,
            &start.to_routed_json(&key),
        );
        self.effects.push(effect);
    }

    /// Cancels the child run of the attempt `stamp` of step `index` if the
    /// step is a child step and the attempt was abandoned (`status`).
    pub(super) fn abandon_child(&mut self, index: u32, stamp: Uuid, status: AttemptStatus) {
        if !matches!(status, AttemptStatus::TimedOut | AttemptStatus::Cancelled) {
            return;
        }
        let is_child = self
            .def
            .and_then(|def| def.step(index))
            .is_some_and(|step| step.kind == StepKind::Child);
        if !is_child {
            return;
        }
        let cancel = Input::Cancel(CancelWakeup {
            run_id: stamp.to_string(),
            tenant: self.state.tenant.clone(),
            reason: Some(PARENT_LEFT.to_owned()),
            action_id: None,
        });
        self.effects.push(Effect {
            target: EffectTarget::Requests {
                run_id: stamp.to_string(),
            },
            kind: EffectKind::ChildCancel,
            payload: cancel.to_json(),
            not_before: None,
        });
    }

    /// A child run that this transition ends answers its parent's
    /// attempt.
    pub(super) fn answer_parent(&mut self) {
        let ended = self.state.status.is_terminal()
            && !self.from_status.is_some_and(RunStatus::is_terminal);
        let Some(parent) = self.state.parent.clone().filter(|_| ended) else {
            return;
        };
        let s = &self.state;
        let error = |what: &str, retryable: bool| AttemptOutcome::Failed {
            message: truncate(
                format!(
                    "child run {} {what}: {}",
                    s.run_id,
                    s.error.as_deref().unwrap_or("no error")
                ),
                MAX_ERROR_MESSAGE_LEN,
            ),
            retryable,
        };
        // A child's steps retried by their own policies before it failed:
        // its failure is for good. (`ended` holds: the run is not running.)
        let outcome = match s.status {
            RunStatus::Succeeded => AttemptOutcome::Succeeded {
                output: s.output.clone(),
            },
            RunStatus::Failed => error("failed", false),
            RunStatus::Cancelled | RunStatus::Running => error("was cancelled", false),
        };
        let result = Input::Result(AttemptResult {
            run_id: parent.run_id.clone(),
            tenant: s.tenant.clone(),
            stamp: parent.stamp,
            outcome,
        });
        self.effects.push(Effect {
            target: EffectTarget::AttemptResults {
                run_id: parent.run_id,
            },
            kind: EffectKind::ChildResult,
            payload: result.to_json(),
            not_before: None,
        });
    }
}
