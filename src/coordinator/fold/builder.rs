//! The builder of one transition: the new state, the attempt rows and the
//! effects, sealed with the transition's number and lifecycle event.
//!
//! In: the state a transition starts from, `now` and the caller's [`Entropy`];
//! the changes an input's handler asks for (dispatch an attempt, set a timer,
//! close an attempt, schedule a retry, succeed the run). Out: one
//! [`Decision::Transition`]. Guarantees: every transition numbers itself
//! `last_transition_seq + 1` and puts its `ductor.events` lifecycle event before
//! any other effect; an attempt is dispatched with its row, its step message and
//! its timeout timer together; a retry waits its policy's backoff, jittered by
//! the entropy, and the run fails when the policy allows no more. Pure: no
//! database, no clock; what it decides is tested without either.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::{
    AttemptWrite, Decision, Entropy, MAX_DETAIL_ERROR_LEN, Transition, TransitionRecord, add_ms,
    step,
};
use crate::contract::effects::{RunEvent, RunOutput, rfc3339};
use crate::contract::input::{Input, SCHEMA_VERSION, TimerKind, TimerWakeup, truncate};
use crate::contract::{Effect, EffectKind, EffectTarget, StepDispatch, TransitionKind, names};
use crate::coordinator::definition::{StepKind, WorkflowDefinition};
use crate::coordinator::state::{
    AttemptRecord, AttemptStatus, Outstanding, PendingRetry, RunState, RunStatus,
};

/// The `n`th stamp a transition with the entropy stamp `first`
/// introduces (from 0): `first` itself, then stamps derived from it. An odd
/// multiplier gives each `n` another stamp; the version and variant bits
/// are set again, so that each is a random UUID as `first` is.
pub fn derived_stamp(first: Uuid, n: u32) -> Uuid {
    if n == 0 {
        return first;
    }
    let mixed =
        first.as_u128() ^ u128::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    uuid::Builder::from_random_bytes(mixed.to_be_bytes()).into_uuid()
}

/// Accumulates one transition: the new state, attempt writes, effects after the event.
pub(super) struct Builder<'a> {
    pub(super) state: RunState,
    pub(super) from_status: Option<RunStatus>,
    pub(super) now: DateTime<Utc>,
    pub(super) entropy: &'a Entropy,
    pub(super) attempt_writes: Vec<AttemptWrite>,
    pub(super) effects: Vec<Effect>,
    pub(super) detail: Map<String, Value>,
    /// How many stamps the transition introduced so far ([`Builder::stamp`]).
    pub(super) stamps: u32,
    /// The branches whose cursors are in the state's own fields, outermost
    /// first, each swapped with the cursor it stands in for (`parallel`).
    pub(super) focus: Vec<usize>,
    /// The definition a focused transition settles its branches with.
    pub(super) def: Option<&'a WorkflowDefinition>,
}

impl<'a> Builder<'a> {
    pub(super) fn new(
        state: RunState,
        from_status: Option<RunStatus>,
        now: DateTime<Utc>,
        entropy: &'a Entropy,
    ) -> Self {
        Self {
            state,
            from_status,
            now,
            entropy,
            attempt_writes: Vec::new(),
            effects: Vec::new(),
            detail: Map::new(),
            stamps: 0,
            focus: Vec::new(),
            def: None,
        }
    }

    /// A stamp new to the run: the entropy's for the first the transition
    /// introduces, then stamps derived from it (a transition that starts
    /// branches dispatches several attempts), so that the entropy's stamp
    /// alone reproduces them all.
    pub(super) fn stamp(&mut self) -> Uuid {
        let n = self.stamps;
        self.stamps = self.stamps.saturating_add(1);
        derived_stamp(self.entropy.stamp, n)
    }

    pub(super) fn detail(&mut self, key: &str, value: Value) {
        self.detail.insert(key.to_owned(), value);
    }

    /// Dispatches `attempt` of step `step_index` with the entropy's stamp and
    /// `input`: the attempt row, the step message and its timeout timer.
    /// `None` if the step does not exist.
    pub(super) fn dispatch(
        &mut self,
        def: &WorkflowDefinition,
        step_index: u32,
        attempt: u32,
        input: Value,
    ) -> Option<Uuid> {
        let step = step(def, step_index)?;
        let stamp = self.stamp();
        let (branch, items) = self.lane_labels(def);
        let key = self
            .compensation_key(step_index)
            .unwrap_or_else(|| self.step_key(step_index, &items));
        let deadline = add_ms(self.now, step.timeout_ms);
        let s = &mut self.state;
        s.step_index = step_index;
        s.attempt = attempt;
        s.pending_retry = None;
        s.outstanding = Some(Outstanding {
            stamp,
            step_index,
            attempt,
            dispatched_at: self.now,
            deadline,
        });
        let record = AttemptRecord {
            stamp,
            step_index,
            attempt,
            status: AttemptStatus::Dispatched,
            dispatched_at: self.now,
            deadline,
            finished_at: None,
            error: None,
        };
        s.attempts.push(record.clone());
        self.attempt_writes.push(AttemptWrite::Insert(record));
        if step.kind == StepKind::Child {
            self.start_child(step, &key, attempt, stamp, input);
            self.timer(TimerKind::Timeout, stamp, deadline);
            return Some(stamp);
        }
        let s = &self.state;
        let dispatch = StepDispatch {
            schema_version: SCHEMA_VERSION,
            run_id: s.run_id.clone(),
            tenant: s.tenant.clone(),
            workflow: s.workflow.clone(),
            workflow_version: s.workflow_version,
            step: step.name.clone(),
            step_index,
            attempt,
            step_key: key,
            stamp,
            deadline,
            input,
            branch,
            item: items.last().copied(),
        };
        let target = EffectTarget::StepQueue {
            pool: step.pool.clone(),
        };
        let effect = Effect::now(target, EffectKind::StepDispatch, &dispatch);
        self.effects.push(effect);
        self.timer(TimerKind::Timeout, stamp, deadline);
        Some(stamp)
    }

    /// The step key of step `index` in the cursor in focus, which runs in
    /// `items` of the maps around it. Its visit is the step's own in the
    /// run's sequence; a step in a branch or an item takes that of the step
    /// of the run's sequence that holds it, which a loop may start again
    /// (the steps inside start once per branch and item, and their retries
    /// keep the key).
    pub(super) fn step_key(&self, index: u32, items: &[u32]) -> String {
        let s = &self.state;
        let top = self
            .focus
            .first()
            .and_then(|&i| s.lanes.get(i))
            .map_or(index, |l| l.parallel);
        let visit = s.visits.get(&top).map_or(1, |v| v.count);
        names::step_key_of_items(&s.run_id, index, visit, items)
    }

    /// A durable timer: the canonical `wakeup.timer` input, published at `due`.
    pub(super) fn timer(&mut self, kind: TimerKind, stamp: Uuid, due: DateTime<Utc>) {
        let wakeup = Input::Timer(TimerWakeup {
            run_id: self.state.run_id.clone(),
            tenant: self.state.tenant.clone(),
            timer: kind,
            stamp,
        });
        self.effects.push(Effect {
            target: EffectTarget::Wakeups,
            kind: EffectKind::WakeupTimer,
            payload: wakeup.to_json(),
            not_before: Some(due),
        });
    }

    /// Every step is done: the run succeeded with the last one's output,
    /// published to the workflow's output topic if it has one.
    pub(super) fn succeed_run(&mut self, def: &WorkflowDefinition) {
        self.state.status = RunStatus::Succeeded;
        if let Some(topic) = &def.output_topic {
            let s = &self.state;
            let output = RunOutput {
                schema_version: SCHEMA_VERSION,
                run_id: &s.run_id,
                tenant: &s.tenant,
                workflow: &s.workflow,
                output: &s.output,
            };
            let target = EffectTarget::Output {
                topic: topic.clone(),
            };
            let effect = Effect::now(target, EffectKind::RunOutput, &output);
            self.effects.push(effect);
        }
    }

    /// Closes the outstanding attempt `stamp` with a final status.
    pub(super) fn finish_attempt(
        &mut self,
        stamp: Uuid,
        status: AttemptStatus,
        error: Option<String>,
    ) {
        self.close_attempt(stamp, status, error);
        self.state.outstanding = None;
    }

    /// Closes the dispatched attempt `stamp` with a final status, whichever
    /// cursor it is outstanding in.
    pub(super) fn close_attempt(
        &mut self,
        stamp: Uuid,
        status: AttemptStatus,
        error: Option<String>,
    ) {
        if let Some(record) = self
            .state
            .attempts
            .iter_mut()
            .find(|a| a.stamp == stamp && a.status == AttemptStatus::Dispatched)
        {
            record.status = status;
            record.finished_at = Some(self.now);
            record.error.clone_from(&error);
            let index = record.step_index;
            self.abandon_child(index, stamp, status);
        }
        self.attempt_writes.push(AttemptWrite::Finish {
            stamp,
            status,
            finished_at: self.now,
            error,
        });
    }

    /// After a failed or timed-out attempt: schedule a retry if the policy allows one,
    /// otherwise fail the run. Returns the transition kind.
    pub(super) fn after_failure(
        &mut self,
        def: &WorkflowDefinition,
        attempt: &AttemptRecord,
        error: String,
        retryable: bool,
        retry_kind: TransitionKind,
    ) -> TransitionKind {
        self.detail("stamp", attempt.stamp.to_string().into());
        self.detail(
            "error",
            truncate(error.clone(), MAX_DETAIL_ERROR_LEN).into(),
        );
        let policy = step(def, attempt.step_index).map(|s| &s.retry);
        // The attempt's number within its visit of the step (a loop's later
        // visits number their attempts on).
        let first = self
            .state
            .visits
            .get(&attempt.step_index)
            .map_or(1, |v| v.first_attempt);
        // A branch or an item counts its own: a map's items number the
        // attempts of one step between them.
        let nth = match self.tries() {
            Some(tries) => tries,
            None => attempt.attempt.saturating_sub(first).saturating_add(1),
        };
        match policy {
            Some(policy) if retryable && nth < policy.max_attempts => {
                let backoff_ms = policy.backoff_ms(nth, self.entropy.jitter_unit);
                let due_at = add_ms(self.now, backoff_ms);
                self.state.pending_retry = Some(PendingRetry {
                    after_stamp: attempt.stamp,
                    due_at,
                });
                self.timer(TimerKind::Retry, attempt.stamp, due_at);
                self.detail("backoff_ms", backoff_ms.into());
                self.detail("retry_due_at", rfc3339(due_at).into());
                retry_kind
            }
            _ => {
                let cause = if retryable {
                    "attempts_exhausted"
                } else {
                    "not_retryable"
                };
                self.detail("cause", cause.into());
                self.state.status = RunStatus::Failed;
                self.state.error = Some(error);
                TransitionKind::RunFailed
            }
        }
    }

    /// Numbers the transition, prepends the lifecycle event and seals it.
    /// A transition of a branch first settles it: what its end does to its
    /// parallel step and the cursors around it.
    pub(super) fn finish(mut self, kind: TransitionKind, input_ref: String) -> Decision {
        let kind = match self.settle(kind).and_then(|kind| self.catch(kind)) {
            Ok(kind) => self.compensation_failed(kind),
            Err(rejection) => return rejection,
        };
        self.forget_compensations();
        self.answer_parent();
        // The entropy's stamp reproduces every stamp the transition
        // introduced; a transition that names none of them (a branch
        // started and cancelled at once) records it.
        let named = ["stamp", "next_stamp"].iter().any(|k| {
            self.detail.get(*k).and_then(Value::as_str) == Some(&self.entropy.stamp.to_string())
        });
        if self.stamps > 0 && !named {
            self.detail("first_stamp", self.entropy.stamp.to_string().into());
        }
        let seq = self.state.last_transition_seq.saturating_add(1);
        // The transition that failed the run names the failure: a
        // `run.failed`, or a start or retry whose first step failed at once.
        let failed_now =
            kind == TransitionKind::RunFailed || self.from_status != Some(RunStatus::Failed);
        self.state.failed_seq = match self.state.status {
            RunStatus::Failed if failed_now => Some(seq),
            // A signal or a cancel of a failed run keeps the failure it
            // names; one that failed before it was kept failed last.
            RunStatus::Failed => self.state.failure_seq(),
            _ => None,
        };
        self.state.last_transition_seq = seq;
        self.state.updated_at = self.now;
        let s = &self.state;
        let event = RunEvent {
            schema_version: SCHEMA_VERSION,
            run_id: &s.run_id,
            tenant: &s.tenant,
            seq,
            kind,
            status: s.status.as_str(),
            step_index: s.step_index,
            attempt: s.attempt,
            at: self.now,
        };
        let event = Effect::now(EffectTarget::Events, EffectKind::RunEvent, &event);
        let mut effects = Vec::with_capacity(self.effects.len() + 1);
        effects.push(event);
        effects.append(&mut self.effects);
        let record = TransitionRecord {
            seq,
            input_ref,
            kind,
            from_status: self.from_status,
            to_status: s.status,
            step_index: s.step_index,
            at: self.now,
            detail: Value::Object(self.detail),
        };
        Decision::Transition(Box::new(Transition {
            state: self.state,
            record,
            attempt_writes: self.attempt_writes,
            effects,
        }))
    }
}
